"""The contract (tests/contract.py) over every registered (model type, architecture), plus the
registry's presets and sizing builders. The parameters are read from the registry when this
file is collected, so a family registered by importing its module is tested without an edit here."""
import pytest
import torch

import attnlab.models  # noqa: F401  (importing the package registers every model file)
import contract
from attnlab.models import GPT, GPTModel, Llama, Mixtral, Transformer
from attnlab.models.registry import architectures, families, family

pytest.importorskip("transformers")

ARCHS = architectures()
HF = [a for a in ARCHS if a.family.hf]
GENERATES = [a for a in ARCHS if contract.generates(a)]


def _ids(archs):
    return [f"{a.model_type}/{a.name}" for a in archs]


def test_the_registry_holds_the_built_in_architectures():
    got = {(a.model_type, a.name): (a.model_cls, a.kind) for a in ARCHS}
    want = {("gpt2", "GPT2LMHeadModel"): (GPT, "causal-lm"), ("gpt2", "GPT2Model"): (GPTModel, "base"),
            ("llama", "LlamaForCausalLM"): (Llama, "causal-lm"),
            ("mixtral", "MixtralForCausalLM"): (Mixtral, "causal-lm"),
            ("transformer", "Transformer"): (Transformer, "seq2seq")}
    assert want.items() <= got.items()
    assert {"gpt2", "llama", "mixtral"} <= {f.model_type for f in families("causal-lm")}
    assert "transformer" not in {f.model_type for f in families("causal-lm")}
    assert family("gpt2").default.name == "GPT2LMHeadModel"


@pytest.mark.parametrize("arch", ARCHS, ids=_ids(ARCHS))
def test_forward_and_gradients(arch):
    contract.check_forward_and_gradients(arch)


@pytest.mark.parametrize("arch", ARCHS, ids=_ids(ARCHS))
def test_state_dict_and_directory_round_trips(arch, tmp_path):
    contract.check_state_dict_round_trip(arch, tmp_path / "state")
    contract.check_directory_round_trip(arch, tmp_path / "dir")


@pytest.mark.parametrize("arch", HF, ids=_ids(HF))
def test_to_transformers(arch, tmp_path):
    contract.check_to_transformers(arch, tmp_path)


@pytest.mark.parametrize("arch", HF, ids=_ids(HF))
def test_from_transformers(arch, tmp_path):
    contract.check_from_transformers(arch, tmp_path)


@pytest.mark.parametrize("arch", GENERATES, ids=_ids(GENERATES))
def test_generation(arch):
    contract.check_generation(arch)


# ----------------------------------------------------------------------------- presets and sizing
@pytest.mark.parametrize("model_type, preset, parameters", [
    ("gpt2", "gpt2", 124_439_808), ("gpt2", "gpt2-medium", 354_823_168),          # the published checkpoints'
    ("llama", "tinyllama-1.1b", 1_100_048_384), ("llama", "llama-2-7b", 6_738_415_616),
    ("mixtral", "mixtral-8x7b", 46_702_792_704),
    ("transformer", "base", 63_082_496), ("transformer", "big", 214_245_376),      # the paper's 65M and 213M
])
def test_presets_have_the_published_sizes(model_type, preset, parameters):
    fam = family(model_type)
    with torch.device("meta"):                         # shapes only: no memory, no initialisation cost
        model = fam.default.build(fam.preset(preset))
    assert sum(p.numel() for p in model.parameters()) == parameters


SIZES = dict(vocab_size=50, context=24, d_model=48, num_heads=4, num_layers=2)
MODALITY_SIZES = {"text": dict(vocab_size=50, context=24), "image": dict(image_size=16, patch_size=4, in_channels=3),
                  "image-text": dict(image_size=16, patch_size=4, in_channels=3, vocab_size=50, context=24),
                  "audio": dict(num_mel_bins=16, frames=40, vocab_size=50, context=24)}


@pytest.mark.parametrize("fam", families(), ids=lambda f: f.model_type)
def test_every_family_sizes_a_config_for_tasks(fam):
    sizes = dict(MODALITY_SIZES[fam.modality], d_model=48, num_heads=4, num_layers=2)
    config = fam.build_config(**sizes)
    assert isinstance(config, fam.config_cls)
    model = fam.default.build(config)
    assert sum(p.numel() for p in model.parameters()) > 0
    assert fam.input_limits(config).keys() == MODALITY_SIZES[fam.modality].keys()
    with pytest.raises(ValueError, match=f"{fam.model_type}: unknown option\\(s\\) colour"):
        fam.build_config(**sizes, colour="red")


def test_sizing_defaults_and_family_options():
    gpt = family("gpt2").build_config(**SIZES, dropout=0.1, bos_token_id=3, eos_token_id=4)
    assert (gpt.n_positions, gpt.d_ff, gpt.dropout, gpt.eos_token_id) == (24, 4 * 48, 0.1, 4)
    llama = family("llama").build_config(**SIZES)
    assert (llama.max_position_embeddings, llama.d_ff, llama.num_kv_heads) == (24, 128, 4)   # 8/3 * 48 -> 128
    assert family("llama").build_config(**SIZES, d_ff=64).d_ff == 64
    assert set(family("mixtral").options) >= {"num_experts", "top_k", "router_aux_loss_coef"}
    mix = family("mixtral").build_config(**SIZES, num_experts=3, top_k=1, router_aux_loss_coef=0.1)
    assert (mix.num_experts, mix.top_k, mix.router_aux_loss_coef, mix.num_kv_heads) == (3, 1, 0.1, 4)
    t = family("transformer").build_config(**SIZES, tgt_vocab_size=60, tie_output=True)
    assert (t.src_vocab_size, t.tgt_vocab_size, t.num_decoder_layers, t.max_seq_len) == (50, 60, 2, 24)
    with pytest.raises(ValueError, match="unknown preset 'huge'; presets: tiny, gpt2"):
        family("gpt2").preset("huge")
    assert family("gpt2").preset("tiny", d_model=64).d_model == 64
