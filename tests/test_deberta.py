"""DeBERTa-v2/v3 against tiny random transformers models, through the converter users call
(attnlab.from_pretrained / save_pretrained): the log-bucketed relative positions, the
disentangled attention under v3-like and v2-like configs, the heads, padding, errors; and the
``scale=`` of MultiHeadAttention that the disentangled attention needs.

Tolerance: every parity check is fp32 with assert_close_scaled at FP32 = 1e-5 relative to the
values' scale, on the real (unpadded) tokens; the bucket function is compared exactly."""
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnlab  # noqa: E402
import contract  # noqa: E402
from attnlab.models.deberta import (DebertaV2Config, DebertaV2ForMaskedLM,  # noqa: E402
                                    DebertaV2ForSequenceClassification, DebertaV2Model, config_from_hf,
                                    log_bucket_position)
from attnlab.nn import MultiHeadAttention, scaled_dot_product_attention  # noqa: E402
from _encoders import (check_in_transformers, check_input_errors, check_padding_invariance, close_on_real,  # noqa: E402
                       compare, hf_pair, padded_batch)  # noqa: E402
from _tolerance import FP32_OP, assert_close_scaled  # noqa: E402

V = 99
SMALL = dict(vocab_size=V, hidden_size=32, num_attention_heads=4, intermediate_size=40, num_hidden_layers=2,
             max_position_embeddings=160, hidden_act="gelu")
V3 = dict(relative_attention=True, position_buckets=256, max_relative_positions=-1, pos_att_type="p2c|c2p",
          share_att_key=True, norm_rel_ebd="layer_norm", position_biased_input=False, type_vocab_size=0)
CONFIGS = {
    # DeBERTa-v3: 256 buckets; a 150-token row puts distances beyond 128 into the log-spaced buckets
    "v3": (V3, [150, 40, 9, 1]),
    "v3-8-buckets": ({**V3, "position_buckets": 8, "max_relative_positions": 64}, [37, 12, 5]),
    # DeBERTa-v2-like: absolute positions too, token types, separate position projections, no table
    # norm, a factorised embedding, no buckets (clipped at +-max_relative_positions), one term only
    "v2-absolute-c2p": (dict(relative_attention=True, position_biased_input=True, type_vocab_size=2,
                             share_att_key=False, pos_att_type=["c2p"], max_relative_positions=6, embedding_size=24,
                             norm_rel_ebd="none"), [20, 7, 13]),
    "v2-separate-p2c|c2p": (dict(relative_attention=True, position_biased_input=True, share_att_key=False,
                                 pos_att_type="c2p|p2c", position_buckets=16, max_relative_positions=40), [30, 3]),
    "no-relative": (dict(relative_attention=False, pos_att_type=["p2c", "c2p"], position_biased_input=True),
                    [12, 6]),
}


def _hf_config(name, **extra):
    return transformers.DebertaV2Config(**{**SMALL, **CONFIGS[name][0], **extra})


def _run_hf(hf, ids, mask, types):
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=mask.long(), token_type_ids=types)


# ----------------------------------------------------------------------------- building blocks
@pytest.mark.parametrize("buckets, max_position", [(256, 512), (8, 64), (16, 40), (6, 7)])
def test_log_buckets_equal_the_reference_exactly(buckets, max_position):
    # transformers' buckets of query - key for 601 positions (-600 .. 600), read through the public
    # DebertaV2Model's encoder, which the attention layers ask for them
    hf = transformers.DebertaV2Model(transformers.DebertaV2Config(**SMALL, relative_attention=True,
                                                                  position_buckets=buckets,
                                                                  max_relative_positions=max_position))
    want = hf.encoder.get_rel_pos(torch.zeros(1, 601, SMALL["hidden_size"]))[0]
    relative = torch.arange(601)[:, None] - torch.arange(601)[None, :]
    got = log_bucket_position(relative, buckets, max_position)
    assert want.dtype == torch.long and torch.equal(got, want)
    near = relative.abs() <= buckets // 2                           # |r| <= buckets / 2 keeps its own bucket
    assert torch.equal(got[near], relative[near])


def test_attention_scale_argument():
    """MultiHeadAttention(scale=s) scores with s instead of 1/sqrt(D), on the fused and the
    explicit (weights) path; the default stays 1/sqrt(D)."""
    torch.manual_seed(0)
    E, H = 32, 4
    x = torch.randn(2, 7, E)
    mha = MultiHeadAttention(E, H, scale=1 / math.sqrt(3 * E // H)).eval()
    q, k, v = (proj(x).view(2, 7, H, E // H).transpose(1, 2) for proj in (mha.q_proj, mha.k_proj, mha.v_proj))
    weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(3 * E // H), -1)
    want = mha.out_proj((weights @ v).transpose(1, 2).reshape(2, 7, E))
    with torch.no_grad():
        fused, _ = mha(x)
        explicit, got_weights = mha(x, return_weights=True)
    assert_close_scaled(fused, want, FP32_OP, "fused path with scale")
    assert_close_scaled(explicit, want, FP32_OP, "explicit path with scale")
    assert_close_scaled(got_weights, weights, FP32_OP, "weights with scale")
    mha.scale = None
    with torch.no_grad():
        default, _ = mha(x)
    out, _ = scaled_dot_product_attention(q, k, v)
    assert_close_scaled(default, mha.out_proj(out.transpose(1, 2).reshape(2, 7, E)), FP32_OP, "default scale")
    assert (default - fused).abs().max() > 1e-4, "the scale must change the output"


# ----------------------------------------------------------------------------- parity with transformers
@pytest.mark.parametrize("name", list(CONFIGS))
def test_deberta_model_matches_transformers_with_padding(name, tmp_path):
    hf, ours = hf_pair(transformers.DebertaV2Model, _hf_config(name), tmp_path)
    assert type(ours) is DebertaV2Model
    lengths = CONFIGS[name][1]
    ids, mask, types = padded_batch(V, lengths, types=ours.config.type_vocab_size)
    want = _run_hf(hf, ids, mask, types).last_hidden_state
    with torch.no_grad():
        got = ours(ids, mask, types)
    close_on_real(got, want, mask, f"DebertaV2Model {name}")


@pytest.mark.parametrize("hf_cls", [transformers.DebertaV2ForMaskedLM, transformers.DebertaV2ForSequenceClassification])
@pytest.mark.parametrize("name", ["v3-8-buckets", "v2-absolute-c2p"])
def test_heads_match_transformers_with_padding(hf_cls, name, tmp_path):
    hf, ours = hf_pair(hf_cls, _hf_config(name, num_labels=3), tmp_path)
    lengths = CONFIGS[name][1]
    ids, mask, types = padded_batch(V, lengths, types=ours.config.type_vocab_size)
    want = _run_hf(hf, ids, mask, types).logits
    with torch.no_grad():
        got = ours(ids, mask, types)
    assert got.shape in ((len(lengths), max(lengths), V), (len(lengths), 3))
    compare(got, want, mask, f"{hf_cls.__name__} {name}")


@pytest.mark.parametrize("cls", [DebertaV2Model, DebertaV2ForMaskedLM, DebertaV2ForSequenceClassification])
@pytest.mark.parametrize("name", ["v3", "v2-absolute-c2p"])
def test_saved_directory_loads_in_transformers_without_key_problems(cls, name, tmp_path):
    config = config_from_hf(_hf_config(name).to_dict())
    torch.manual_seed(0)
    check_in_transformers(cls(config), tmp_path, CONFIGS[name][1], types=config.type_vocab_size)


def test_non_legacy_head_and_a_config_naming_no_architecture_load(tmp_path):
    """Microsoft's DeBERTa-v3 checkpoints: config.json names no architecture, the weights sit under
    "deberta." beside the non-legacy masked-LM head ("lm_predictions.lm_head.*", transformers'
    legacy=False) and a replaced-token head ("mask_predictions.*"). The masked-LM model reads that
    head under its other names (logits equal transformers'), saves the legacy names that
    transformers loads by default, and a config without architectures gives the bare encoder
    with the heads left out, as transformers' DebertaV2Model.from_pretrained does."""
    import json
    from safetensors.torch import load_file, save_file
    hf, ours = hf_pair(transformers.DebertaV2ForMaskedLM, _hf_config("v3-8-buckets", legacy=False), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    assert any(k.startswith("lm_predictions.lm_head.") for k in tensors)
    ids, mask, types = padded_batch(V, CONFIGS["v3-8-buckets"][1])
    want = _run_hf(hf, ids, mask, types)
    with torch.no_grad():
        compare(ours(ids, mask, types), want.logits, mask, "non-legacy DebertaV2ForMaskedLM")
    check_in_transformers(ours, tmp_path / "saved", CONFIGS["v3-8-buckets"][1])    # legacy names, no key problem

    tensors["mask_predictions.classifier.weight"] = torch.randn(1, 32)              # the v3 discriminator's head
    save_file(tensors, tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    del config["architectures"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.warns(UserWarning, match="left out the tensors under lm_predictions, mask_predictions"):
        base = attnlab.from_pretrained(tmp_path)
    assert type(base) is DebertaV2Model
    with torch.no_grad():
        close_on_real(base(ids, mask, types), hf.deberta(input_ids=ids, attention_mask=mask.long()).last_hidden_state,
                      mask, "DebertaV2Model from a checkpoint with heads")


# ----------------------------------------------------------------------------- padding, errors
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", ["v3-8-buckets", "v2-absolute-c2p"])
def test_padding_changes_no_real_token(name, train):
    config = config_from_hf(_hf_config(name, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0).to_dict())
    torch.manual_seed(0)
    model = DebertaV2ForSequenceClassification(config)
    contract.randomize_(model)
    model.train(train)                        # no dropout: train mode is deterministic
    check_padding_invariance(model, V, CONFIGS[name][1], f"{name} ({'train' if train else 'eval'})",
                             types=config.type_vocab_size)


def test_position_terms_change_the_output():
    """The disentangled terms are live: zeroing the relative table's projection inputs changes the
    output, and a model's output depends on token order even with no absolute positions."""
    torch.manual_seed(0)
    model = DebertaV2Model(DebertaV2Config(**attnlab.models.family("deberta-v2").presets["tiny"])).eval()
    contract.randomize_(model)
    ids = torch.randint(0, V, (1, 12))
    with torch.no_grad():
        out = model(ids)
        flipped = model(ids.flip(1)).flip(1)
        assert (out - flipped).abs().max() > 1e-3, "without positions the encoder would be order-blind"
        model.relative.weight.zero_()
        model.relative.norm.bias.zero_()
        assert (model(ids) - out).abs().max() > 1e-3


def test_bad_inputs_get_one_clear_error():
    model = DebertaV2Model(DebertaV2Config(**attnlab.models.family("deberta-v2").presets["tiny"])).eval()
    check_input_errors(model)
    with pytest.raises(ValueError, match=r"token_type_ids holds 0, outside \[0, type_vocab_size=0\)"):
        model(torch.zeros(2, 5, dtype=torch.long), None, torch.zeros(2, 5, dtype=torch.long))


def test_unsupported_configs_are_refused_by_name():
    with pytest.raises(ValueError, match="convolution layer"):
        config_from_hf({"conv_kernel_size": 3})
    with pytest.raises(ValueError, match="attention_head_size"):
        config_from_hf({"hidden_size": 32, "num_attention_heads": 4, "attention_head_size": 16})
    with pytest.raises(ValueError, match="pos_att_type may hold"):
        DebertaV2Config(pos_att_type=("p2p",))
    with pytest.raises(ValueError, match="needs at least one of pos_att_type"):
        DebertaV2Config(pos_att_type=())


@pytest.mark.parametrize("preset, parameters", [("deberta-v3-xsmall", 70_682_112), ("deberta-v3-small", 141_304_320),
                                                ("deberta-v3-base", 183_831_552), ("deberta-v3-large", 434_012_160)])
def test_presets_have_the_published_sizes(preset, parameters):
    """Microsoft's DeBERTa-v3 sizes (the 128k-token embedding is most of the smaller ones), as
    transformers' DebertaV2Model counts them for the same config."""
    fam = attnlab.models.family("deberta-v2")
    with torch.device("meta"):
        model = fam.default.build(fam.preset(preset))
    assert sum(p.numel() for p in model.parameters()) == parameters


def test_copies_read_their_own_table_and_projections(tmp_path):
    """The position terms hold the model's relative table and their attention's projections by
    reference (not as submodules): a deepcopy must read its own, and loading weights must reach them."""
    import copy
    config = DebertaV2Config(**attnlab.models.family("deberta-v2").presets["tiny"])
    torch.manual_seed(0)
    model = DebertaV2Model(config).eval()
    contract.randomize_(model)
    twin = copy.deepcopy(model)
    position = twin.layers[1].self_attn.position
    assert position._table[0] is twin.relative and position._attention[0] is twin.layers[1].self_attn
    ids = torch.randint(0, config.vocab_size, (2, 9))
    with torch.no_grad():
        before = model(ids)
        twin.relative.weight.mul_(3.0)
        twin.layers[1].self_attn.k_proj.weight.mul_(2.0)
        assert torch.equal(model(ids), before), "changing the copy changed the original"
        assert (twin(ids) - before).abs().max() > 1e-3
    attnlab.save_pretrained(twin, tmp_path)
    with torch.no_grad():
        assert torch.equal(attnlab.from_pretrained(tmp_path)(ids), twin(ids))
