"""The registry's rules for registering and finding families and architectures, and the
attnlab-native directory format."""
import json
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import attnlab
from attnlab.models import GPT, Transformer
from attnlab.models.convert import Rule, split_prefix, with_prefix
from attnlab.models.pretrained import SavePretrained
from attnlab.models.registry import architecture_of, families, family, register_family


@dataclass
class _Config:
    width: int = 3


class _Net(SavePretrained, nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config, self.proj = config, nn.Linear(config.width, config.width)


def _sizes(*, vocab_size, context, d_model, num_heads, num_layers, d_ff=None, dropout=0.0, colour="red"):
    return _Config(d_model)


def test_registration_is_checked():
    limits = lambda c: {"vocab_size": 8, "context": None}         # noqa: E731
    with pytest.raises(ValueError, match="together .* or none of them"):
        register_family("reg-half", _Config, config_from_hf=dict, limits=limits)
    with pytest.raises(ValueError, match="build_config lacks context, d_model"):
        register_family("reg-sizes", _Config, build_config=lambda *, vocab_size, **kw: None, limits=limits)
    with pytest.raises(ValueError, match="give limits=, the input limits"):
        register_family("reg-limits", _Config)
    with pytest.raises(ValueError, match="'gpt2' is already registered"):
        register_family("gpt2", _Config, limits=limits)
    with pytest.raises(ValueError, match="unknown modality 'smell'"):
        register_family("reg-smell", _Config, build_config=_sizes, limits=limits, modality="smell")
    fam = register_family("reg-native", _Config, build_config=_sizes, limits=limits)
    assert fam.options == {"colour": "red"} and not fam.hf
    with pytest.raises(ValueError, match="has no architecture registered"):
        fam.default
    with pytest.raises(ValueError, match="unknown kind 'chatbot'; kinds: causal-lm, seq2seq, base"):
        fam.register("Net", _Net, kind="chatbot")
    with pytest.raises(ValueError, match="native family .* takes no prefix"):
        fam.register("Net", _Net, kind="base", prefix="net.")
    with pytest.raises(ValueError, match="already registered"):
        fam.register("Transformer", Transformer, kind="seq2seq")        # a class belongs to one architecture
    arch = fam.register("Net", _Net, kind="base")
    assert fam.default is arch and architecture_of(_Net(_Config())) is arch
    with pytest.raises(TypeError, match="built from a _Config, got GPTConfig"):
        arch.build(family("gpt2").preset("tiny"))
    with pytest.raises(ValueError, match="has no causal-lm architecture \\(it has: base\\)"):
        fam.for_kind("causal-lm")


def test_lookups_name_what_exists():
    with pytest.raises(ValueError, match=r"x\.json: unsupported model_type 'gpt'; supported: .*gpt2"):
        family("gpt", "x.json")
    with pytest.raises(ValueError, match="unknown kind 'lm'"):
        families("lm")
    with pytest.raises(ValueError, match="nn.Linear|Linear is not a registered architecture"):
        architecture_of(nn.Linear(2, 2))
    assert architecture_of(GPT(family("gpt2").preset("tiny"))).name == "GPT2LMHeadModel"


def test_prefix_helpers_are_inverse():
    rules = [Rule("a.{i}.w", "base.h.{i}.w"), Rule(("b", "c"), ("base.b", "base.c")), Rule("head", "head")]
    base, head = split_prefix(rules, "base.")
    assert [r.theirs for r in base] == [("h.{i}.w",), ("b", "c")] and head == [rules[2]]
    assert with_prefix(base, "base.") + head == rules


def test_native_directory_keeps_config_and_weights(tmp_path):
    fam = family("transformer")
    model = fam.default.build(fam.preset("tiny", share_embeddings=True, tie_output=True, pad_id=0))
    attnlab.save_pretrained(model, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "transformer" and saved["architectures"] == ["Transformer"]
    assert saved["d_model"] == 32 and saved["pad_id"] == 0
    back = attnlab.from_pretrained(tmp_path)
    assert back.config == model.config and back.src_embedding is back.tgt_embedding
    assert back.output_projection.weight is back.tgt_embedding.weight, "tied weights stay tied"
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    (tmp_path / "config.json").write_text(json.dumps({**saved, "colour": "red"}))
    with pytest.raises(ValueError, match="config.json: unknown TransformerConfig field\\(s\\): colour"):
        attnlab.from_pretrained(tmp_path)


def test_top_level_loaders_are_lazy():
    assert callable(attnlab.from_pretrained) and callable(attnlab.load_tokenizer)
    assert {"from_pretrained", "save_pretrained", "load_tokenizer"} <= set(dir(attnlab))
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        attnlab.nothing
