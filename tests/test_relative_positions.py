"""Relative positions from true token positions: left padding, KV caches and the holes a
speculative decoder leaves, for ALiBi, the T5 bias, RoPE and a content-dependent bias
(DeBERTa-style) plugged in through AttentionPosition.

The model is a small causal LM assembled here from attnlab.nn blocks on the CausalLM base,
without learned positions, so every position signal comes from inside attention.
"""
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from attnlab.models import CausalLM
from attnlab.nn import (ALiBi, AttentionPosition, CausalLayer, LayerNorm, MultiHeadAttention, RotaryEmbedding,
                        T5RelativePositionBias)
from _tolerance import FP32, assert_close_scaled  # noqa: E402  (tests/ is on sys.path under pytest)

V, E, H, G, CTX = 40, 32, 4, 2, 64


class ContentPositionBias(AttentionPosition):
    """DeBERTa's disentangled terms (He et al. 2021, section 3.1) on clipped relative distances:
    c2p[i, j] = q_i . R[d(i, j)], p2c[i, j] = k_j . R[d(j, i)], scaled by 1/sqrt(D)."""

    def __init__(self, head_dim: int, span: int = 4):
        super().__init__()
        self.span = span
        self.table = nn.Parameter(torch.randn(2 * span + 1, head_dim))
        self.calls = []                                         # (q shape, k shape, q_pos, k_pos) per call

    def _index(self, frm: torch.Tensor, to: torch.Tensor, heads: int) -> torch.Tensor:
        """Table rows of the clipped distances to - frm: (B, heads, len(frm), len(to))."""
        idx = (to[..., None, :] - frm[..., :, None]).clamp(-self.span, self.span) + self.span
        idx = idx if idx.dim() == 3 else idx[None]
        return idx[:, None].expand(-1, heads, -1, -1)

    def bias(self, q, k, q_pos, k_pos):
        self.calls.append((q.shape, k.shape, q_pos.clone(), k_pos.clone()))
        B, Hq, T, D = q.shape
        S = k.size(-2)
        k = k.repeat_interleave(Hq // k.size(1), dim=1)         # (B, H, S, D)
        c2p = q @ self.table.T                                  # (B, H, T, 2s+1)
        p2c = k @ self.table.T                                  # (B, H, S, 2s+1)
        to_key = self._index(q_pos, k_pos, Hq).expand(B, Hq, T, S)
        to_query = self._index(k_pos, q_pos, Hq).expand(B, Hq, S, T)
        terms = c2p.gather(-1, to_key) + p2c.gather(-1, to_query).transpose(-1, -2)
        return terms / math.sqrt(D)


POSITIONS = {
    "alibi": lambda: ALiBi(H),
    "t5": lambda: T5RelativePositionBias(H, num_buckets=8, max_distance=16, bidirectional=False),
    "rope": lambda: RotaryEmbedding(E // H),
    "content": lambda: ContentPositionBias(E // H),
}


class TinyLM(CausalLM):
    init_std = 0.3                        # O(1) logits, so position mistakes show

    def __init__(self, position):
        super().__init__(SimpleNamespace(vocab_size=V, max_seq_len=CTX))
        shared = POSITIONS[position]()    # one module for every layer, as T5 shares its bias
        self.token_embedding = nn.Embedding(V, E)
        self.layers = nn.ModuleList(
            CausalLayer(E, H, 2 * E, 0.0, norm_first=True,
                        self_attn=MultiHeadAttention(E, H, num_kv_heads=G, position=shared, causal=True))
            for _ in range(2))
        self.norm = LayerNorm(E)
        self.lm_head = nn.Linear(E, V, bias=False)
        self.reset_parameters()


def close(got, want, what):
    assert_close_scaled(got, want, FP32, what)


def _batch(lengths, seed=0):
    """Left-padded prompts (junk ids in the padding) and their (B, L) mask."""
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    ids = torch.randint(0, V, (len(lengths), L), generator=g)
    mask = torch.arange(L)[None, :] >= (L - torch.tensor(lengths))[:, None]
    return ids, mask


@pytest.mark.parametrize("position", list(POSITIONS))
def test_left_padded_batch_equals_each_prompt_alone(position):
    torch.manual_seed(0)
    model = TinyLM(position).eval()
    lengths, steps = [7, 3, 5], 4
    ids, mask = _batch(lengths)
    new = torch.randint(0, V, (len(lengths), steps), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids, attention_mask=mask)                            # no cache
        cache = model.new_cache()
        prefill = model(ids, attention_mask=mask, cache=cache)
        grown, stepped = mask, []
        for t in range(steps):
            grown = torch.cat([grown, torch.ones(len(lengths), 1, dtype=torch.bool)], 1)
            stepped.append(model(new[:, t:t + 1], attention_mask=grown, cache=cache))
        stepped = torch.cat(stepped, 1)
        for b, n in enumerate(lengths):
            alone = model(torch.cat([ids[b:b + 1, -n:], new[b:b + 1]], 1))  # (1, n + steps, V)
            close(full[b, -n:], alone[0, :n], f"{position}: row {b} padded batch vs alone")
            close(prefill[b, -n:], alone[0, :n], f"{position}: row {b} cached prefill vs alone")
            close(stepped[b], alone[0, n:], f"{position}: row {b} cached steps vs alone")


def test_left_padding_check_fails_with_key_positions_from_slots(monkeypatch):
    """The old behaviour (keys at arange(S) while queries count real tokens) breaks the equality."""
    torch.manual_seed(0)
    model = TinyLM("alibi").eval()
    ids, mask = _batch([7, 3])
    keep = CausalLM._positions

    def slots_for_keys(self, *args):
        queries, _ = keep(self, *args)
        return queries, None
    with torch.no_grad():
        alone = model(ids[1:, -3:])
        monkeypatch.setattr(CausalLM, "_positions", slots_for_keys)
        wrong = model(ids, attention_mask=mask)
    assert (wrong[1, -3:] - alone[0]).abs().max() > 1e-3


@pytest.mark.parametrize("position", ["alibi", "t5", "content"])
def test_rejected_slots_are_holes_not_positions(position):
    """Speculative decoding leaves rejected drafts in the cache as False slots: the tokens after a
    hole must see the same distances as if it were not there."""
    torch.manual_seed(0)
    model = TinyLM(position).eval()
    seq = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(2))
    holed = torch.cat([seq[:, :3], torch.tensor([[7]]), seq[:, 3:]], 1)   # slot 3 is a rejected draft
    mask = torch.ones(1, 7, dtype=torch.bool)
    mask[0, 3] = False
    real = mask[0]
    with torch.no_grad():
        want = model(seq)
        close(model(holed, attention_mask=mask)[0, real], want[0], f"{position}: hole, no cache")
        cache = model.new_cache()
        model(holed[:, :2], attention_mask=mask[:, :2], cache=cache)
        verify = model(holed[:, 2:5], attention_mask=mask[:, :5], cache=cache)   # a verification chunk
        last = model(holed[:, 5:], attention_mask=mask, cache=cache)
    close(verify[0, [0, 2]], want[0, 2:4], f"{position}: hole inside a cached chunk")
    close(last[0], want[0, 4:], f"{position}: steps after the hole")


def test_content_bias_sees_q_k_and_true_positions():
    torch.manual_seed(0)
    model = TinyLM("content").eval()
    provider = model.layers[0].self_attn.position
    ids, mask = _batch([5, 2])
    with torch.no_grad():
        cache = model.new_cache()
        model(ids, attention_mask=mask, cache=cache)
        provider.calls.clear()
        model(ids[:, :1], attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.bool)], 1), cache=cache)
    q_shape, k_shape, q_pos, k_pos = provider.calls[0]
    assert q_shape == (2, H, 1, E // H) and k_shape == (2, G, 6, E // H), "q (B, H, T, D), every key (B, G, S, D)"
    assert q_pos.tolist() == [[5], [2]]
    assert k_pos.tolist() == [[0, 1, 2, 3, 4, 5], [0, 0, 0, 0, 1, 2]]   # padding clamps to 0 (masked anyway)


def test_key_positions_shape_is_checked():
    mha = MultiHeadAttention(E, H, position=ALiBi(H), causal=True)
    with pytest.raises(ValueError, match="key_positions"):
        mha(torch.randn(2, 5, E), key_positions=torch.arange(4))
    with pytest.raises(ValueError, match="positions"):
        mha(torch.randn(2, 5, E), positions=torch.arange(5.0))
