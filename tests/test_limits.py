"""One statement of a model's limits: a family's ``register_family(limits=)``, read by every length
check of generation through attnlab.generate.state.context_of (a family that stated a shorter
context than its config's position table is held to it); and the bare bases of the language
models (GPT-2, Mamba, Mamba-2, RWKV) are one pattern, attnlab.models.causal_lm.Headless."""
import pytest
import torch

import attnlab.models  # noqa: F401  (registers every family)
from attnlab.generate import generate
from attnlab.generate.state import context_of
from attnlab.generate.text import complete
from attnlab.models.causal_lm import Headless
from attnlab.models.registry import family


@pytest.fixture
def gpt_stating_eight(monkeypatch):
    fam = family("gpt2")
    monkeypatch.setattr(fam, "limits", lambda c: {"vocab_size": c.vocab_size, "context": 8})
    torch.manual_seed(0)
    return fam.for_kind("causal-lm").build(fam.preset("tiny")).eval()      # 64 positions in its config


def test_generation_reads_the_family_s_statement(gpt_stating_eight):
    model = gpt_stating_eight
    assert model.config.max_seq_len == 64 and context_of(model) == 8 and model.input_limits()["context"] == 8
    with pytest.raises(ValueError, match=r"6 prompt \+ 3 new tokens exceed the model's context of 8 tokens"):
        generate(model, torch.tensor([[1, 2, 3, 4, 5, 6]]), 3)
    assert generate(model, torch.tensor([[1, 2, 3, 4, 5, 6]]), 2).shape == (1, 8)


def test_complete_caps_the_reply_at_the_stated_context(gpt_stating_eight):
    class Chars:
        def decode(self, ids):
            return "".join(chr(97 + i % 26) for i in ids)
    out = complete(gpt_stating_eight, Chars(), [1, 2, 3, 4, 5], 10, temperature=0.0)
    assert out.max_new_tokens == 3 and out.new_tokens == 3


def test_a_recurrent_family_states_no_limit_and_generation_sets_none():
    fam = family("mamba")
    model = fam.for_kind("causal-lm").build(fam.preset("tiny"))
    assert context_of(model) is None


@pytest.mark.parametrize("model_type, name, with_head", [("gpt2", "GPT2Model", "GPT2LMHeadModel"),
                                                         ("mamba", "MambaModel", "MambaForCausalLM"),
                                                         ("mamba2", "Mamba2Model", "Mamba2ForCausalLM"),
                                                         ("rwkv", "RwkvModel", "RwkvForCausalLM")])
def test_the_bare_bases_are_one_pattern(model_type, name, with_head):
    fam = family(model_type)
    model = fam.architecture(name).build(fam.preset("tiny"))
    assert isinstance(model, Headless) and isinstance(model.lm_head, torch.nn.Identity)
    assert model(torch.tensor([[1, 2, 3]])).shape[-1] == model.config.d_model
    with pytest.raises(TypeError, match=rf"^{type(model).__name__} has no language-model head, so it does not "
                                        rf"generate; load a {with_head} checkpoint to generate$"):
        model.generate(torch.tensor([[1]]), 2)
