"""Position modules: formulas, parity with Hugging Face references, pitfalls 7-10."""
import math

import pytest
import torch

from attnlab.nn import KVCache, MultiHeadAttention
from attnlab.nn.position import (ALiBi, LearnedPositionalEmbedding, PositionalEncoding, RotaryEmbedding,
                                 T5RelativePositionBias, alibi_slopes, relative_position_bucket, sinusoidal_table)
from _tolerance import FP32, assert_close_scaled, scaled_error  # noqa: E402  (tests/ is on sys.path under pytest)

transformers = pytest.importorskip("transformers")


def close(a, b, rtol=FP32, what=""):
    assert_close_scaled(a, b, rtol, what)


# --------------------------------------------------------------------------- absolute tables

@pytest.mark.parametrize("d_model", [16, 7])
def test_sinusoidal_table_matches_formula(d_model):
    table = sinusoidal_table(60, d_model)
    assert table.shape == (60, d_model) and table.dtype == torch.float32
    for pos in [0, 1, 5, 37, 59]:
        for j in range(d_model):
            i2 = j - j % 2                                       # the "2i" of the formula
            angle = pos / 10000 ** (i2 / d_model)
            want = math.sin(angle) if j % 2 == 0 else math.cos(angle)
            assert abs(table[pos, j].item() - want) <= 1e-6, f"PE({pos},{j}) off by more than 1e-6"


def test_positional_encoding_adds_rows_along_sequence_not_batch():
    torch.manual_seed(0)
    B, T, E = 3, 5, 8                                            # B != T so a batch-axis mix-up shows
    pe = PositionalEncoding(E, max_len=20, dropout=0.0)
    table = sinusoidal_table(20, E)
    x = torch.randn(B, T, E)
    out = pe(x)
    for b in range(B):
        close(out[b], x[b] + table[:T], 1e-6, f"batch row {b}: x[b] + pe[:T] (tol 1e-6)")
    shifted = pe(x, offset=4)
    for b in range(B):
        close(shifted[b], x[b] + table[4:4 + T], 1e-6, f"offset 4, batch row {b} (tol 1e-6)")
    close(pe(x, positions=torch.arange(4, 4 + T)), shifted, 0.0, "positions=arange(4, 9) equals offset=4 (exact)")
    per_row = torch.stack([torch.arange(T) + b for b in range(B)])  # (B, T)
    out_rows = pe(x, positions=per_row)
    for b in range(B):
        close(out_rows[b], x[b] + table[per_row[b]], 1e-6, f"(B, T) positions, row {b} (tol 1e-6)")


def test_learned_positional_embedding_offset_and_positions():
    torch.manual_seed(0)
    emb = LearnedPositionalEmbedding(12, 6)
    x = torch.randn(2, 4, 6)
    close(emb(x, offset=3), x + emb.weight[3:7], 0.0, "learned rows 3..6 added (exact)")
    pos = torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8]])
    close(emb(x, positions=pos), x + emb.weight[pos], 0.0, "learned (B, T) positions (exact)")


@pytest.mark.parametrize("make", [lambda: PositionalEncoding(8, max_len=10, dropout=0.0),
                                  lambda: LearnedPositionalEmbedding(10, 8)])
def test_too_long_input_raises_naming_both_numbers(make):
    module = make()
    module(torch.zeros(1, 10, 8))                                # exactly max_len is fine
    with pytest.raises(ValueError, match=r"11.*10"):
        module(torch.zeros(1, 11, 8))
    with pytest.raises(ValueError, match=r"11.*10"):
        module(torch.zeros(1, 5, 8), offset=6)
    with pytest.raises(ValueError, match="10"):
        module(torch.zeros(1, 2, 8), positions=torch.tensor([3, 10]))


# --------------------------------------------------------------------------- RoPE vs Hugging Face

def hf_llama_rope(rope_parameters, head_dim=16):
    """transformers' LlamaRotaryEmbedding, read through the public LlamaModel (one small layer)."""
    from transformers import LlamaConfig, LlamaModel
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                         max_position_embeddings=64, rope_parameters=rope_parameters,
                         num_hidden_layers=1, intermediate_size=8, vocab_size=8)
    return config, LlamaModel(config).rotary_emb


def rope_half_split(x, cos, sin):
    """RoPE in the half-split (GPT-NeoX / LLaMA) layout from its definition (Su et al. 2021, eq. 34):
    channel i pairs with i + D/2 and the pair turns by angle theta_i * position; cos and sin are the
    (B or 1, T, D) tables transformers' rotary embedding returns (each half the same), shared by the heads."""
    half = x.shape[-1] // 2
    assert torch.equal(cos[..., :half], cos[..., half:]) and torch.equal(sin[..., :half], sin[..., half:])
    c, s = cos[..., :half].unsqueeze(1), sin[..., :half].unsqueeze(1)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1)


def qk(B=2, H=4, G=2, T=7, D=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, T, D, generator=g).to(dtype), torch.randn(B, G, T, D, generator=g).to(dtype)


@pytest.mark.parametrize("scaling", [None, {"type": "linear", "factor": 2.0}])
def test_rope_half_split_matches_hf_llama(scaling):
    params = {"rope_type": "default", "rope_theta": 500.0}
    if scaling is not None:
        params = {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}
    _, hf = hf_llama_rope(params)
    ours = RotaryEmbedding(16, base=500.0, scaling=scaling)
    close(ours.inv_freq, hf.inv_freq, 0.0, "inverse frequencies equal HF's (exact)")
    q, k = qk()                                                   # GQA: 4 query heads, 2 kv heads
    positions = torch.tensor([[3, 4, 5, 6, 7, 8, 9], [0, 0, 1, 2, 3, 4, 40]])
    cos, sin = hf(q, positions)
    want_q, want_k = rope_half_split(q, cos, sin), rope_half_split(k, cos, sin)
    got_q, got_k = ours.transform(q, k, positions)
    close(got_q, want_q, FP32, "RoPE q vs HF LLaMA")
    close(got_k, want_k, FP32, "RoPE k vs HF LLaMA")
    interleaved, _ = RotaryEmbedding(16, base=500.0, scaling=scaling, interleaved=True).transform(q, k, positions)
    assert scaled_error(interleaved, want_q) > 100 * FP32, "the reference must tell the two layouts apart"


def test_rope_ntk_matches_hf_dynamic_at_equivalent_length():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    base, f, d = 500.0, 2.0, 16
    config, _ = hf_llama_rope({"rope_type": "dynamic", "factor": f, "rope_theta": base})
    # HF's dynamic NTK uses base * (f * L / L0 - (f - 1)) ** (d / (d - 2)); at L = L0 (2f - 1) / f
    # the bracket is f: the static NTK-aware base.
    hf_inv, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, None, seq_len=int(64 * (2 * f - 1) / f))
    independent = 1.0 / (base * f ** (d / (d - 2))) ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ours = RotaryEmbedding(d, base=base, scaling={"type": "ntk", "factor": f})
    close(ours.inv_freq, hf_inv, 1e-7, "NTK inverse frequencies vs HF dynamic (tol 1e-7)")
    close(ours.inv_freq.double(), independent, 1e-7, "NTK inverse frequencies vs formula (tol 1e-7)")
    q, k = qk()
    pos = torch.arange(20, 27)
    freqs = pos[:, None].float() * hf_inv
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos()[None], emb.sin()[None]
    want_q, want_k = rope_half_split(q, cos, sin), rope_half_split(k, cos, sin)
    got_q, got_k = ours.transform(q, k, pos)
    close(got_q, want_q, FP32, "NTK RoPE q")
    close(got_k, want_k, FP32, "NTK RoPE k")


# --------------------------------------------------------------------------- RoPE layouts (pitfall 7)

def complex_rope(x, positions, base=10000.0):
    """Meta's formulation: channel pairs as complex numbers times e^{i m theta}."""
    D = x.size(-1)
    theta = 1.0 / base ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    rot = torch.polar(torch.ones(len(positions), D // 2, dtype=torch.float64), positions.double()[:, None] * theta)
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], D // 2, 2))
    return torch.view_as_real(xc * rot).flatten(-2).to(x.dtype)


def test_rope_interleaved_matches_complex_formulation():
    q, k = qk()
    pos = torch.arange(10, 17)
    got_q, got_k = RotaryEmbedding(16, interleaved=True).transform(q, k, pos)
    close(got_q, complex_rope(q, pos), FP32, "interleaved q vs complex multiply")
    close(got_k, complex_rope(k, pos), FP32, "interleaved k vs complex multiply")


def to_half_split_rows(w, heads):
    """The checkpoint conversion (Meta -> HF): per head, rows (0, 1, 2, 3, ...) -> (0, 2, ..., 1, 3, ...)."""
    out_dim, in_dim = w.shape
    return w.view(heads, out_dim // heads // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def test_rope_interleaved_equals_half_split_after_permutation():
    torch.manual_seed(0)
    D, H, G, E, T = 8, 4, 2, 16, 6
    pos = torch.arange(T)
    x = torch.randn(1, T, D)
    perm = torch.cat((torch.arange(0, D, 2), torch.arange(1, D, 2)))
    inter, half = RotaryEmbedding(D, interleaved=True), RotaryEmbedding(D)
    a, _ = inter.transform(x[:, None], x[:, None], pos)
    b, _ = half.transform(x[:, None, :, perm], x[:, None, :, perm], pos)
    close(b, a[..., perm], FP32, "half-split of permuted channels = permuted interleaved")

    # the same through projection weights with grouped-query heads: scores must agree
    h = torch.randn(1, T, E)
    wq, wk = torch.randn(H * D, E), torch.randn(G * D, E)

    def scores(rope, wq, wk):
        q = (h @ wq.T).view(1, T, H, D).transpose(1, 2)
        k = (h @ wk.T).view(1, T, G, D).transpose(1, 2)
        q, k = rope.transform(q, k, pos)
        return q @ k.repeat_interleave(H // G, dim=1).transpose(-1, -2)

    meta = scores(inter, wq, wk)
    hf = scores(half, to_half_split_rows(wq, H), to_half_split_rows(wk, G))
    close(hf, meta, 1e-4, "scores: Meta layout vs converted HF layout (tol 1e-4, sums of 8 products)")
    wrong = scores(half, to_half_split_rows(wq, H), to_half_split_rows(wk, H))   # query-head count for k
    assert (wrong - meta).abs().max() > 1e-2, "permuting k with the query-head count should break GQA"


# --------------------------------------------------------------------------- RoPE precision, offsets

def test_rope_bf16_is_fp32_math_rounded_once():
    rope = RotaryEmbedding(16).to(torch.bfloat16)
    assert rope.inv_freq.dtype == torch.float32, "inverse frequencies must stay fp32 under module.to(bf16)"
    q, k = qk(dtype=torch.bfloat16)
    pos = torch.arange(1000, 1007)                                # large angles: bf16 math would be far off
    got_q, got_k = rope.transform(q, k, pos)
    want_q, want_k = RotaryEmbedding(16).transform(q.float(), k.float(), pos)
    assert got_q.dtype == torch.bfloat16 and got_k.dtype == torch.bfloat16
    assert rope._cos.dtype == torch.float32, "cached cos/sin must be fp32"
    assert torch.equal(got_q, want_q.to(torch.bfloat16)), "bf16 q must equal the fp32 result cast to bf16 (exact)"
    assert torch.equal(got_k, want_k.to(torch.bfloat16)), "bf16 k must equal the fp32 result cast to bf16 (exact)"


def test_rope_offset_slice_equals_full_sequence_and_per_row_positions():
    q, k = qk(T=12)
    rope = RotaryEmbedding(16)
    part_q, part_k = rope.transform(q[:, :, 5:], k[:, :, 5:], torch.arange(5, 12))   # cache of 5 tokens
    full_q, full_k = RotaryEmbedding(16).transform(q, k, torch.arange(12))          # fresh cache
    close(part_q, full_q[:, :, 5:], 0.0, "offset q = slice of full rotation (exact)")
    close(part_k, full_k[:, :, 5:], 0.0, "offset k = slice of full rotation (exact)")
    # (B, T) positions, as for a left-padded batch: each row as if rotated alone
    positions = torch.stack([torch.arange(12), torch.arange(12) + 30])
    rows_q, rows_k = rope.transform(q, k, positions)
    for b in range(2):
        alone_q, alone_k = rope.transform(q[b:b + 1], k[b:b + 1], positions[b])
        close(rows_q[b:b + 1], alone_q, 0.0, f"(B, T) positions, q row {b} (exact)")
        close(rows_k[b:b + 1], alone_k, 0.0, f"(B, T) positions, k row {b} (exact)")
    assert not torch.allclose(rows_q[1], full_q[1]), "row 1 must be rotated by its own positions"


def test_rope_partial_rotary_dim():
    q, k = qk()
    pos = torch.arange(7)
    got_q, got_k = RotaryEmbedding(16, rotary_dim=8).transform(q, k, pos)
    sub_q, sub_k = RotaryEmbedding(8).transform(q[..., :8], k[..., :8], pos)
    close(got_q[..., :8], sub_q, 0.0, "rotated part = 8-dim RoPE (exact)")
    close(got_k[..., 8:], k[..., 8:], 0.0, "pass-through channels untouched (exact)")
    with pytest.raises(ValueError):
        RotaryEmbedding(16, rotary_dim=7)


# --------------------------------------------------------------------------- T5 relative bias

def hf_t5_attention(is_decoder, **config):
    """transformers' T5Attention holding the relative-bias table (the first layer's self-attention),
    read through the public T5Model: the decoder's is causal (one-directional buckets)."""
    from transformers import T5Config, T5Model
    model = T5Model(T5Config(d_model=32, d_kv=8, num_heads=4, d_ff=16, num_layers=1, vocab_size=8, **config))
    return (model.decoder if is_decoder else model.encoder).block[0].layer[0].SelfAttention


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (16, 40)])
def test_t5_buckets_match_hf(bidirectional, num_buckets, max_distance):
    hf = hf_t5_attention(not bidirectional, relative_attention_num_buckets=num_buckets,
                         relative_attention_max_distance=max_distance)
    with torch.no_grad():                          # row b of the table holds b: the bias is the bucket itself
        hf.relative_attention_bias.weight.copy_(torch.arange(num_buckets)[:, None].expand(-1, 4))
    want = hf.compute_bias(301, 301)[0, 0].long()                 # keys minus queries: -300 .. 300
    rel = torch.arange(301)[None, :] - torch.arange(301)[:, None]
    got = relative_position_bucket(rel, bidirectional, num_buckets, max_distance)
    assert torch.equal(got, want), f"buckets differ at {rel[got != want].unique().tolist()}"


@pytest.mark.parametrize("is_decoder", [False, True])
def test_t5_bias_matches_hf_compute_bias(is_decoder):
    hf = hf_t5_attention(is_decoder, relative_attention_num_buckets=32, relative_attention_max_distance=128)
    ours = T5RelativePositionBias(4, 32, 128, bidirectional=not is_decoder)
    with torch.no_grad():
        ours.relative_attention_bias.weight.copy_(hf.relative_attention_bias.weight)
    T, past = 6, 150 if is_decoder else 0                         # decoder: queries after a cache of 150
    got = ours.position_bias(torch.arange(past, past + T), torch.arange(past + T))
    want = hf.compute_bias(T, past + T, past_seen_tokens=past)
    close(got, want, 0.0, "T5 bias vs HF compute_bias (exact: same embedding rows)")
    rows = torch.stack([torch.arange(past, past + T), torch.arange(past + 2, past + T + 2)])
    per_row = ours.position_bias(rows, torch.arange(past + T + 2))
    assert per_row.shape == (2, 4, T, past + T + 2)
    close(per_row[0, :, :, :past + T], want[0], 0.0, "(B, T) positions: row 0 (exact)")


# --------------------------------------------------------------------------- ALiBi

def bloom_slopes(num_heads):
    """transformers' ALiBi slopes, read through the public BloomModel."""
    from transformers import BloomConfig, BloomModel
    bloom = BloomModel(BloomConfig(hidden_size=2 * num_heads, n_head=num_heads, n_layer=1, vocab_size=8))
    alibi = bloom.build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), num_heads, torch.float32)  # (H, 1, 2)
    return alibi[:, 0, 1]                                         # slope * position 1


def test_alibi_slopes_power_of_two():
    assert torch.equal(alibi_slopes(8), torch.tensor([2.0 ** -i for i in range(1, 9)])), "8 heads: 2^-1..2^-8"


@pytest.mark.parametrize("num_heads", [6, 12, 20, 16])
def test_alibi_slopes_match_bloom(num_heads):
    close(alibi_slopes(num_heads), bloom_slopes(num_heads), 1e-7, f"{num_heads} heads vs Bloom slopes (tol 1e-7)")


def test_alibi_bias_sign_and_shape():
    alibi = ALiBi(6)
    T, S = 4, 9
    bias = alibi.position_bias(torch.arange(S - T, S), torch.arange(S))    # queries at positions 5..8
    assert bias.shape == (1, 6, T, S) and bias.dtype == torch.float32
    slopes = alibi_slopes(6)
    for h in range(6):
        assert bias[0, h, 3, 8].item() == 0.0, "a query's own key gets no bias"
        close(bias[0, h, 3, 2], -slopes[h] * 6, 1e-7, "key 6 behind the query gets -m*6 (tol 1e-7)")
    assert (bias[0, :, 3, :8] < 0).all(), "every earlier key is penalised"


# --------------------------------------------------------------------------- with MultiHeadAttention

POSITIONS = {
    "rope": lambda: RotaryEmbedding(8),
    "rope_interleaved_ntk": lambda: RotaryEmbedding(8, interleaved=True, scaling={"type": "ntk", "factor": 4.0}),
    "alibi": lambda: ALiBi(4),
    "t5": lambda: T5RelativePositionBias(4, num_buckets=8, max_distance=16, bidirectional=False),
}


@pytest.mark.parametrize("name", list(POSITIONS))
def test_cached_decoding_equals_full_causal_forward(name):
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 4, num_kv_heads=2, position=POSITIONS[name](), causal=True).eval()
    x = torch.randn(2, 11, 32)
    with torch.no_grad():
        full, _ = mha(x)
        cache = KVCache(capacity=2)                               # small capacity: growth is exercised
        steps = [mha(x[:, :4], cache=cache)[0]]                   # chunked prefill of 4 tokens
        steps += [mha(x[:, t:t + 1], cache=cache)[0] for t in range(4, 11)]
        cached = torch.cat(steps, dim=1)
        mha.position = None
        plain, _ = mha(x)
    close(cached, full, FP32, f"{name}: cached decoding vs full causal forward")
    assert (plain - full).abs().max() > 1e-3, f"{name}: the position module must change the output"
