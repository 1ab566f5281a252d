"""ELECTRA against tiny random transformers models through attnlab.from_pretrained /
save_pretrained, on padded two-segment batches: the discriminator, the generator, the bare
encoder and the classifier, with embeddings narrower than the encoder (a projection) and as
wide (none); padding invariance and the shared checks."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnlab  # noqa: E402
from attnlab.models.electra import (ElectraConfig, ElectraForMaskedLM, ElectraForPreTraining,  # noqa: E402
                                    ElectraForSequenceClassification, ElectraModel)
from _encoders import check_padding_invariance, padded_two_segment_batch  # noqa: E402  (tests/ is on sys.path)
from _tolerance import FP32, assert_close_scaled  # noqa: E402
from contract import randomize_  # noqa: E402

V, CTX = 99, 40


def _batch(seed: int):
    return padded_two_segment_batch(V, seed=seed)


def _hf(name: str, embedding_size: int, path):
    config = transformers.ElectraConfig(vocab_size=V, embedding_size=embedding_size, hidden_size=32,
                                        num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                                        max_position_embeddings=CTX, type_vocab_size=3, hidden_act="gelu",
                                        id2label={0: "no", 1: "maybe", 2: "yes"}, pad_token_id=0)
    torch.manual_seed(0)
    hf = getattr(transformers, name)(config)
    randomize_(hf)
    hf.eval().save_pretrained(path)
    return hf


OUTPUT = {"ElectraModel": "last_hidden_state", "ElectraForPreTraining": "logits", "ElectraForMaskedLM": "logits",
          "ElectraForSequenceClassification": "logits"}
CLASSES = {"ElectraModel": ElectraModel, "ElectraForPreTraining": ElectraForPreTraining,
           "ElectraForMaskedLM": ElectraForMaskedLM,
           "ElectraForSequenceClassification": ElectraForSequenceClassification}


@pytest.mark.parametrize("embedding_size", [16, 32])
@pytest.mark.parametrize("name", list(OUTPUT))
def test_electra_equals_transformers_on_a_padded_two_segment_batch(name, embedding_size, tmp_path):
    hf = _hf(name, embedding_size, tmp_path)
    ours = attnlab.from_pretrained(tmp_path)
    assert type(ours) is CLASSES[name] and ours.config.embedding_size == embedding_size
    projected = hasattr(hf.base_model, "embeddings_project")
    assert (ours.embeddings.project is not None) == projected == (embedding_size != 32)
    ids, mask, types = _batch(seed=11)
    with torch.no_grad():
        got = ours(ids, attention_mask=mask, token_type_ids=types)
        want = getattr(hf(ids, attention_mask=mask.long(), token_type_ids=types), OUTPUT[name])
    shapes = {"ElectraModel": (3, 12, 32), "ElectraForPreTraining": (3, 12), "ElectraForMaskedLM": (3, 12, V),
              "ElectraForSequenceClassification": (3, 3)}
    assert got.shape == shapes[name]
    if name == "ElectraForSequenceClassification":
        assert_close_scaled(got, want, FP32, f"{name} class logits")
    else:
        assert_close_scaled(got[mask], want[mask], FP32, f"{name} (real tokens)")
    if name == "ElectraForMaskedLM":
        assert ours.mlm_head.decoder.weight is ours.embeddings.token.weight, "the generator's head is tied"


def test_discriminator_round_trips_to_transformers_with_every_key(tmp_path):
    hf = _hf("ElectraForPreTraining", 16, tmp_path / "hf")
    attnlab.from_pretrained(tmp_path / "hf").save_pretrained(tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["model_type"] == "electra" and config["embedding_size"] == 16
    back, info = transformers.ElectraForPreTraining.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not any(info.values()), info
    ids, mask, types = _batch(seed=12)
    with torch.no_grad():
        assert_close_scaled(back.eval()(ids, attention_mask=mask.long(), token_type_ids=types).logits[mask],
                            hf(ids, attention_mask=mask.long(), token_type_ids=types).logits[mask], FP32,
                            "discriminator after attnlab save -> transformers load")


@pytest.mark.parametrize("train", [False, True])
def test_padding_does_not_change_the_discriminator(train):
    torch.manual_seed(0)
    model = ElectraForPreTraining(ElectraConfig(vocab_size=V, embedding_size=16, d_model=32, num_heads=4, num_layers=2,
                                                d_ff=48, max_position_embeddings=CTX, type_vocab_size=3, dropout=0.0,
                                                attention_dropout=0.0))
    randomize_(model)
    check_padding_invariance(model.train(train), V, [12, 7, 3], "ElectraForPreTraining", types=2)


def test_electra_checks_its_inputs_and_config():
    model = ElectraModel(ElectraConfig(vocab_size=V, num_layers=1, max_position_embeddings=CTX))
    with pytest.raises(ValueError, match=rf"a sequence of {CTX + 1} tokens is longer than max_position_embeddings"):
        model(torch.ones(1, CTX + 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"attention_mask must be \(batch, seq\)"):
        model(torch.ones(2, 3, dtype=torch.long), attention_mask=torch.ones(3, 2))
    with pytest.raises(ValueError, match="embedding_size must be positive"):
        ElectraConfig(embedding_size=0)
    assert ElectraConfig(d_model=64, num_heads=4, embedding_size=None).embedding_size == 64
