"""Masked-LM heads scoring only the masked positions (``masked_positions=``, what ``attnlab train
mlm`` passes): the logits equal the full logits at those positions (fp32, 1e-5 relative to
scale), the other outputs are unchanged, and a bad selector gets one clear error."""
import pytest
import torch

import contract
from attnlab.models.registry import family
from _tolerance import FP32, assert_close_scaled

CASES = [("bert", "BertForMaskedLM"), ("bert", "BertForPreTraining"), ("albert", "AlbertForMaskedLM"),
         ("albert", "AlbertForPreTraining"), ("deberta-v2", "DebertaV2ForMaskedLM"), ("electra", "ElectraForMaskedLM")]


def _model(fam_name: str, arch: str):
    fam = family(fam_name)
    torch.manual_seed(0)
    model = fam.architecture(arch).build(fam.preset("tiny"))
    contract.randomize_(model)
    return model.eval()


@pytest.mark.parametrize("fam_name, arch", CASES)
def test_masked_positions_score_only_those_rows(fam_name, arch):
    model = _model(fam_name, arch)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    mask = torch.arange(9)[None, :] < torch.tensor([9, 5, 7])[:, None]
    ids = torch.randint(1, V, (3, 9), generator=g) * mask
    picked = (torch.rand(3, 9, generator=g) < 0.3) & mask
    picked[1, 2] = True                                          # at least one per row
    with torch.no_grad():
        full = model(ids, attention_mask=mask)
        some = model(ids, attention_mask=mask, masked_positions=picked)
    if isinstance(full, tuple):                                  # pre-training: the sentence logits too
        assert_close_scaled(some[1], full[1], FP32, f"{arch} sentence logits")
        full, some = full[0], some[0]
    assert some.shape == (int(picked.sum()), V)
    assert_close_scaled(some, full[picked], FP32, f"{arch} logits at the masked positions")


def test_a_bad_selector_is_named():
    model = _model("bert", "BertForMaskedLM")
    ids = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"masked_positions must be a \(batch, seq\) = \(2, 4\) bool tensor"):
        model(ids, masked_positions=torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"masked_positions must be a \(batch, seq\) = \(2, 4\) bool tensor"):
        model(ids, masked_positions=torch.ones(2, 5, dtype=torch.bool))
