"""Pruning masks (attnlab.compress.prune) against their formulas.

- magnitude: the layer's ``sparsity`` fraction of smallest |W_ij| is removed (one comparison group:
  the whole matrix);
- Wanda (Sun et al. 2024): S_ij = |W_ij| * ||X_j||_2, the ``sparsity`` fraction of lowest S in each
  output row is removed;
- N:M: in each group of M consecutive inputs of a row, the N highest scores are kept.

A 2 x 8 layer whose masks were worked out by hand (in the comments), then random layers against a
reference written another way (k-th smallest values as thresholds, top-k per group), then whole
models: the statistics the calibration pass collects against the inputs each layer really saw.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from attnlab.compress import calibration_stats, linear_layers, prune_mask, prune_model, quantize_model, sparsity_of
from attnlab.models.llama import Llama, LlamaConfig

W = torch.tensor([[0.10, -0.80, 0.30, 0.05, -0.60, 0.22, 0.90, -0.40],
                  [-0.50, 0.70, -0.45, 0.35, 0.55, -0.95, 0.65, 0.60]])
NORMS = torch.tensor([1.0, 0.1, 2.0, 4.0, 0.5, 1.0, 0.25, 3.0])       # ||X_j||_2 of the 8 inputs


def _mask(*rows):
    return torch.tensor(rows, dtype=torch.bool)


def test_magnitude_mask_by_hand():
    # |W| over the whole layer, the 8 lowest of 16: .05 .10 .22 .30 .40 (row 0: c3 c0 c5 c2 c7) and
    # .35 .45 .50 (row 1: c3 c2 c0). Row 0 loses five, row 1 three: the layer is the group.
    assert torch.equal(prune_mask(W, 0.5, "magnitude"), _mask([0, 1, 0, 0, 1, 0, 1, 0], [0, 1, 0, 0, 1, 1, 1, 1]))


def test_wanda_mask_by_hand():
    # S row 0 = .10 .08 .60 .20 .30 .22 .225 1.2 -> lowest four c1 c0 c3 c5
    # S row 1 = .50 .07 .90 1.4 .275 .95 .1625 1.8 -> lowest four c1 c6 c4 c0
    want = _mask([0, 0, 1, 0, 1, 0, 1, 1], [0, 0, 1, 1, 0, 1, 0, 1])
    assert torch.equal(prune_mask(W, 0.5, "wanda", NORMS), want)
    # the norms come from calibration inputs: two tokens whose columns are 0.6 n_j and 0.8 n_j
    x = torch.stack([0.6 * NORMS, 0.8 * NORMS])
    assert torch.equal(prune_mask(W, 0.5, "wanda", x.norm(dim=0)), want)
    # 25 %: two of eight per row (c1 c0; c1 c6)
    assert torch.equal(prune_mask(W, 0.25, "wanda", NORMS), _mask([0, 0, 1, 1, 1, 1, 1, 1], [1, 0, 1, 1, 1, 1, 0, 1]))


def test_n_of_m_masks_by_hand():
    # 2:4 keeps the two highest of each group of four consecutive inputs
    # |W|: [.1 .8 .3 .05][.6 .22 .9 .4] -> c1 c2, c4 c6;  [.5 .7 .45 .35][.55 .95 .65 .6] -> c0 c1, c5 c6
    assert torch.equal(prune_mask(W, method="magnitude", pattern=(2, 4)),
                       _mask([0, 1, 1, 0, 1, 0, 1, 0], [1, 1, 0, 0, 0, 1, 1, 0]))
    # S: [.1 .08 .6 .2][.3 .22 .225 1.2] -> c2 c3, c4 c7;  [.5 .07 .9 1.4][.275 .95 .1625 1.8] -> c2 c3, c5 c7
    assert torch.equal(prune_mask(W, method="wanda", input_norms=NORMS, pattern=(2, 4)),
                       _mask([0, 0, 1, 1, 1, 0, 0, 1], [0, 0, 1, 1, 0, 1, 0, 1]))
    # N:M counts the weights kept: 1:4 keeps one of four (the largest), 3:4 drops only the smallest
    assert torch.equal(prune_mask(W, pattern=(1, 4)), _mask([0, 1, 0, 0, 0, 0, 1, 0], [0, 1, 0, 0, 0, 1, 0, 0]))
    assert torch.equal(prune_mask(W, pattern=(3, 4)), _mask([1, 1, 1, 0, 1, 0, 1, 1], [1, 1, 1, 0, 0, 1, 1, 1]))


def test_ties_remove_the_earlier_weight():
    w = torch.tensor([[1.0, 1.0, 1.0, 1.0, 2.0, 2.0]])
    assert torch.equal(prune_mask(w, 0.5), _mask([0, 0, 0, 1, 1, 1]))
    assert torch.equal(prune_mask(w[:, :4], pattern=(2, 4)), _mask([0, 0, 1, 1]))


@pytest.mark.parametrize("sparsity", [0.3, 0.5, 0.7])
def test_random_layers_against_thresholds(sparsity):
    """The same masks written another way: keep what lies above the k-th smallest score (of the
    layer for magnitude, of the row for Wanda), and the top-N of each group for N:M."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 64, generator=g)
    norms = torch.rand(64, generator=g) * 10
    k_layer = int(round(sparsity * w.numel()))
    thr = w.abs().flatten().kthvalue(k_layer).values
    assert torch.equal(prune_mask(w, sparsity, "magnitude"), w.abs() > thr)
    s = w.abs() * norms
    k_row = int(round(sparsity * 64))
    assert torch.equal(prune_mask(w, sparsity, "wanda", norms), s > s.kthvalue(k_row, dim=1, keepdim=True).values)
    top = s.reshape(24, 16, 4).topk(2, dim=-1).indices
    want = torch.zeros(24, 16, 4, dtype=torch.bool).scatter_(-1, top, True).reshape(24, 64)
    got = prune_mask(w, method="wanda", input_norms=norms, pattern=(2, 4))
    assert torch.equal(got, want)
    assert int(got.reshape(24, 16, 4).sum(-1).min()) == int(got.reshape(24, 16, 4).sum(-1).max()) == 2


def test_bad_input():
    with pytest.raises(ValueError, match=r"sparsity must be in \[0, 1\)"):
        prune_mask(W, 1.5)
    with pytest.raises(ValueError, match="wanda needs the 8 input-feature norms"):
        prune_mask(W, 0.5, "wanda")
    with pytest.raises(ValueError, match="wanda needs the 8 input-feature norms"):
        prune_mask(W, 0.5, "wanda", torch.ones(7))
    with pytest.raises(ValueError, match="one of magnitude, wanda"):
        prune_mask(W, 0.5, "random")
    for pattern in [(0, 4), (4, 4), (2, 3)]:
        with pytest.raises(ValueError, match="must have 0 < N < M and M dividing"):
            prune_mask(W, pattern=pattern)


def _llama():
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=300, d_model=64, num_heads=4, num_kv_heads=2, num_layers=2, d_ff=128,
                             max_position_embeddings=64, rope_theta=500.0, tie_word_embeddings=False)).eval()


def _inputs_seen(model, batches):
    """Per Linear, every input row it received (recorded by forward hooks, independently of
    calibration_stats' sharing of one statistic between layers fed the same tensor)."""
    seen = {name: [] for name in linear_layers(model)}
    handles = [lin.register_forward_hook(lambda m, a, o, name=name: seen[name].append(a[0].reshape(-1, a[0].size(-1))))
               for name, (_, _, lin) in linear_layers(model).items()]
    with torch.no_grad():
        for ids in batches:
            model(ids)
    for h in handles:
        h.remove()
    return {name: torch.cat(xs).double() for name, xs in seen.items()}


def test_calibration_stats_are_the_inputs_gram_matrices():
    model = _llama()
    batches = [torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    xs = _inputs_seen(model, batches)
    full, diag = calibration_stats(model, batches), calibration_stats(model, batches, full=False)
    assert set(full) == set(xs) and "lm_head" not in full
    for name, x in xs.items():
        torch.testing.assert_close(full[name], x.t() @ x, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(diag[name], x.square().sum(0), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("method,pattern", [("magnitude", None), ("wanda", None), ("wanda", (2, 4))])
def test_prune_model_masks_every_layer_by_the_formula(method, pattern):
    """prune_model: each Linear but the head holds W * prune_mask(W, norms of its own inputs);
    the head and the embedding are untouched; half of the weights are zero."""
    model = _llama()
    batches = [torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(3))]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    norms = {name: x.norm(dim=0).float() for name, x in _inputs_seen(model, batches).items()}
    stats = calibration_stats(model, batches, full=pattern is None) if method == "wanda" else None
    prune_model(model, 0.5, method, pattern=pattern, calibration=stats)
    layers = linear_layers(model)
    for name, (_, _, lin) in layers.items():
        w0 = before[f"{name}.weight"]
        want = w0 * prune_mask(w0, 0.5, method, norms[name] if method == "wanda" else None, pattern)
        assert torch.equal(lin.weight, want), name
    assert torch.equal(model.lm_head.weight, before["lm_head.weight"])
    emb = next(k for k in before if "embed" in k)
    assert torch.equal(model.state_dict()[emb], before[emb])
    assert sparsity_of(model) == 0.5


def test_wanda_keeps_the_layer_output_closer_than_magnitude():
    """With a few input features much larger than the rest (as in LLMs' activations), Wanda's mask
    changes the layer's output on those inputs less than magnitude's: ||X W^T - X (M*W)^T||."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=g) * torch.where(torch.rand(64, generator=g) < 0.1, 20.0, 1.0)
    w = torch.randn(32, 64, generator=g)
    err = {m: (x @ (w * ~prune_mask(w, 0.5, m, x.norm(dim=0))).t()).norm() for m in ("magnitude", "wanda")}
    assert err["wanda"] < 0.7 * err["magnitude"], err


def test_prune_model_refusals():
    with pytest.raises(ValueError, match="wanda needs calibration"):
        prune_model(_llama(), 0.5, "wanda")
    with pytest.raises(ValueError, match="the model is quantised"):
        prune_model(quantize_model(_llama(), 4, 32), 0.5)
    layer = nn.Linear(8, 2)
    with pytest.raises(ValueError, match="sparsity must be"):
        prune_mask(layer.weight, -0.1)
