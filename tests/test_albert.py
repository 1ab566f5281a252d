"""ALBERT against tiny random transformers models, through the converter users call
(attnlab.from_pretrained / save_pretrained): hidden states, both pretraining heads, the
masked-LM and classifier heads, shared layer groups, padding, the label names, errors.

Tolerance: every parity check is fp32 with assert_close_scaled at FP32 = 1e-5 relative to the
values' scale (max |got - want| <= 1e-5 * max |want|), on the real (unpadded) tokens."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnlab  # noqa: E402
import contract  # noqa: E402
from attnlab.models.albert import (AlbertConfig, AlbertForMaskedLM, AlbertForPreTraining,  # noqa: E402
                                   AlbertForSequenceClassification, AlbertModel, config_from_hf)
from _encoders import (check_in_transformers, check_input_errors, check_padding_invariance, close_on_real,  # noqa: E402
                       compare, hf_pair, padded_batch)  # noqa: E402
from _tolerance import FP32, assert_close_scaled  # noqa: E402

V = 99
SMALL = dict(vocab_size=V, embedding_size=16, hidden_size=32, num_attention_heads=4, intermediate_size=40,
             num_hidden_layers=3, max_position_embeddings=48, type_vocab_size=2)
LENGTHS = [11, 4, 8, 1]        # right padding up to 11; one row of a single token


def _hf_config(**extra):
    return transformers.AlbertConfig(**{**SMALL, **extra})


def _run_hf(hf, ids, mask, types):
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=mask.long(), token_type_ids=types)


@pytest.mark.parametrize("extra", [{}, {"num_hidden_groups": 2, "inner_group_num": 2, "num_hidden_layers": 4},
                                   {"hidden_act": "gelu", "num_hidden_groups": 3}],
                         ids=["one-shared-layer", "two-groups-of-two", "gelu-three-groups"])
def test_albert_model_matches_transformers_with_padding(extra, tmp_path):
    hf, ours = hf_pair(transformers.AlbertModel, _hf_config(**extra), tmp_path)
    assert type(ours) is AlbertModel
    ids, mask, types = padded_batch(V, LENGTHS, types=2)
    want = _run_hf(hf, ids, mask, types).last_hidden_state
    with torch.no_grad():
        got = ours(ids, mask, types)
    close_on_real(got, want, mask, f"AlbertModel {extra}")


def test_pretraining_heads_match_transformers_with_padding(tmp_path):
    hf, ours = hf_pair(transformers.AlbertForPreTraining, _hf_config(), tmp_path)
    assert type(ours) is AlbertForPreTraining
    ids, mask, types = padded_batch(V, LENGTHS, types=2)
    want = _run_hf(hf, ids, mask, types)
    with torch.no_grad():
        tokens, order = ours(ids, mask, types)
    assert tokens.shape == (len(LENGTHS), max(LENGTHS), V) and order.shape == (len(LENGTHS), 2)
    close_on_real(tokens, want.prediction_logits, mask, "masked-LM logits")
    assert_close_scaled(order, want.sop_logits, FP32, "sentence-order logits")


@pytest.mark.parametrize("hf_cls", [transformers.AlbertForMaskedLM, transformers.AlbertForSequenceClassification])
def test_masked_lm_and_classifier_match_transformers(hf_cls, tmp_path):
    hf, ours = hf_pair(hf_cls, _hf_config(num_labels=5), tmp_path)
    ids, mask, types = padded_batch(V, LENGTHS, types=2)
    want = _run_hf(hf, ids, mask, types).logits
    with torch.no_grad():
        got = ours(ids, mask, types)
    assert got.shape in ((len(LENGTHS), max(LENGTHS), V), (len(LENGTHS), 5))
    compare(got, want, mask, hf_cls.__name__)


@pytest.mark.parametrize("cls", [AlbertModel, AlbertForPreTraining, AlbertForMaskedLM, AlbertForSequenceClassification])
def test_saved_directory_loads_in_transformers_without_key_problems(cls, tmp_path):
    config = AlbertConfig(**{**attnlab.models.family("albert").presets["tiny"], "num_hidden_groups": 2,
                             "inner_group_num": 2, "num_layers": 4})
    torch.manual_seed(0)
    check_in_transformers(cls(config), tmp_path, LENGTHS, types=2)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("cls", [AlbertModel, AlbertForPreTraining])
def test_padding_changes_no_real_token(cls, train):
    torch.manual_seed(0)
    model = cls(AlbertConfig(**attnlab.models.family("albert").presets["tiny"]))
    contract.randomize_(model)
    model.train(train)                 # the tiny preset has no dropout: train mode is deterministic
    check_padding_invariance(model, model.config.vocab_size, LENGTHS, cls.__name__, types=2)


def test_one_layer_of_weights_serves_every_pass():
    """Parameters do not grow with depth; the layer count changes the output (the shared layer
    really runs num_layers times)."""
    preset = attnlab.models.family("albert").presets["tiny"]
    sizes = {n: sum(p.numel() for p in AlbertModel(AlbertConfig(**{**preset, "num_layers": n})).parameters())
             for n in (1, 3, 12)}
    assert len(set(sizes.values())) == 1, sizes
    torch.manual_seed(0)
    three = AlbertModel(AlbertConfig(**{**preset, "num_layers": 3})).eval()
    four = AlbertModel(AlbertConfig(**{**preset, "num_layers": 4})).eval()
    four.load_state_dict(three.state_dict())
    ids = torch.randint(0, preset["vocab_size"], (2, 6))
    with torch.no_grad():
        assert (three(ids) - four(ids)).abs().max() > 1e-4


def test_label_names_round_trip_both_ways(tmp_path):
    names = {0: "negative", 1: "neutral", 2: "positive"}
    config = AlbertConfig(**{**attnlab.models.family("albert").presets["tiny"], "num_labels": 3, "id2label": names})
    attnlab.save_pretrained(AlbertForSequenceClassification(config), tmp_path / "ours")
    raw = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert raw["label2id"] == {"negative": 0, "neutral": 1, "positive": 2}
    hf = transformers.AlbertForSequenceClassification.from_pretrained(tmp_path / "ours")
    assert hf.config.id2label == names
    hf.save_pretrained(tmp_path / "theirs")
    assert attnlab.from_pretrained(tmp_path / "theirs").config.id2label == names
    assert attnlab.from_pretrained(tmp_path / "ours").config == config
    # transformers' placeholder names are no names
    assert config_from_hf({"id2label": {"0": "LABEL_0", "1": "LABEL_1"}}).id2label is None


def test_bad_inputs_get_one_clear_error():
    model = AlbertModel(AlbertConfig(**attnlab.models.family("albert").presets["tiny"])).eval()
    check_input_errors(model)
    with pytest.raises(ValueError, match=r"token_type_ids holds 2, outside \[0, type_vocab_size=2\)"):
        model(torch.zeros(2, 5, dtype=torch.long), None, torch.full((2, 5), 2))
    with pytest.raises(ValueError, match=r"token_type_ids must be a non-empty integer tensor of shape \(2, 5\)"):
        model(torch.zeros(2, 5, dtype=torch.long), None, torch.zeros(2, 3, dtype=torch.long))


def test_unsupported_configs_are_refused_by_name():
    with pytest.raises(ValueError, match="hidden_act 'swish' is not supported"):
        config_from_hf({"hidden_act": "swish"})
    with pytest.raises(ValueError, match="untied"):
        config_from_hf({"tie_word_embeddings": False})
    with pytest.raises(ValueError, match="3 layer groups for 2 layers"):
        AlbertConfig(num_layers=2, num_hidden_groups=3)
    with pytest.raises(ValueError, match="not divisible"):
        AlbertConfig(d_model=30, num_heads=4)


@pytest.mark.parametrize("preset, parameters", [("albert-base-v2", 11_683_584), ("albert-large-v2", 17_683_968),
                                                ("albert-xlarge-v2", 58_724_864), ("albert-xxlarge-v2", 222_595_584)])
def test_presets_have_the_published_sizes(preset, parameters):
    """The paper's 12M / 18M / 60M / 235M (table 1 rounds, and counts slightly differently), exactly
    as transformers' AlbertModel counts them for the same config (our pooler, kept but not
    trained, is buffers: counted with them)."""
    fam = attnlab.models.family("albert")
    with torch.device("meta"):
        model = fam.default.build(fam.preset(preset))
    floats = [*model.parameters(), *(b for b in model.buffers() if b.is_floating_point())]
    assert sum(t.numel() for t in floats) == parameters
