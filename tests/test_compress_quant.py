"""Group-wise 4-/8-bit weight-only quantisation (attnlab.compress): llama.cpp's round-to-nearest
reproduced byte for byte (SmolLM2's own Q4_1 file, and the gguf package's quantisers), error
bounds, the quantised Linear's kernels, GPTQ against its formula and against RTN, HQQ, and a
quantised model written as GGUF that transformers reads with the same logits."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attnlab
from attnlab.compress import QuantLinear, dequantize, gptq, hqq, quantize_model, quantize_rtn, save_quantized_gguf
from attnlab.compress.quant import PACKED_MAX_ROWS
from attnlab.gguf import decode_blocks, encode_blocks
from attnlab.models.llama import Llama, LlamaConfig

sys.path.insert(0, str(Path(__file__).parent))
from _smollm import GGUF  # noqa: E402
from _tolerance import FP32, FP32_OP, assert_close_scaled  # noqa: E402


def _file_tensors(names):
    import gguf
    reader = gguf.GGUFReader(GGUF)
    return [(t.name, t.tensor_type.name, int(t.shape[0]), np.asarray(t.data)) for t in reader.tensors
            if any(t.name.startswith(n) for n in names)]


def test_rtn_reproduces_smollm2_q4_1_bytes():
    """Dequantise the file's Q4_1 (and its Q8_0 token table) to fp32, quantise again with our RTN:
    the blocks are the file's bytes exactly (three layers' seven matrices, and the table)."""
    import gguf
    checked = 0
    for name, qtype, k, raw in _file_tensors(("blk.0.", "blk.15.", "blk.29.", "token_embd")):
        if qtype not in ("Q4_1", "Q8_0"):
            continue
        raw = raw.reshape(raw.shape[0], -1)
        w = torch.from_numpy(gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, qtype))
                             .reshape(raw.shape[0], k).astype(np.float32))
        codes, d, m = quantize_rtn(w, qtype.lower(), 32)
        assert np.array_equal(encode_blocks(codes, d, m, qtype), raw), name
        assert torch.equal(dequantize(codes, d, m), w), name                    # and our dequantisation is gguf's
        back = decode_blocks(raw, qtype, k)
        assert all(torch.equal(a, b) for a, b in zip(back, (codes, d, m))), name
        checked += 1
    assert checked == 22


def _awkward(n=64, k=256, seed=0):
    torch.manual_seed(seed)
    w = torch.randn(n, k) * torch.rand(n, 1) * 0.1
    w[0, :32] = 0                                       # an all-zero block: d = 0
    w[1, 5] = -w[1].abs().max() - 1
    w[1, 6] = -w[1, 5]                                  # equal magnitudes: the first one sets Q4_0's sign
    w[2, 40:72] = 0.25                                  # a constant block: max = min
    return w


@pytest.mark.parametrize("layout", ["q4_0", "q4_1", "q8_0"])
def test_rtn_equals_gguf_package_quantizer(layout):
    """The gguf package's NumPy ports of llama.cpp's reference quantisers, byte for byte."""
    import gguf
    w = _awkward()
    ref = gguf.quants.quantize(w.numpy(), getattr(gguf.GGMLQuantizationType, layout.upper()))
    assert np.array_equal(encode_blocks(*quantize_rtn(w, layout, 32), layout.upper()), ref)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("layout", ["q4_0", "q4_1", "q8_0"])
def test_rtn_error_bounds(layout, group):
    """|w - dequant| <= d/2 per group (Q4_1, Q8_0, up to fp16's rounding of d and m); Q4_0's grid
    stops at +7 d on the side opposite its largest value, so there the bound is d."""
    w = _awkward(k=256)
    codes, d, m = quantize_rtn(w, layout, group)
    err = (w - dequantize(codes, d, m)).abs().reshape(w.size(0), -1, group)
    step = d.float().abs()[..., None]
    bound = (1.0 if layout == "q4_0" else 0.5) * step + 2e-3 * w.abs().reshape(err.shape).amax(-1, keepdim=True)
    assert bool((err <= bound).all())
    assert int(codes.max()) <= (15 if layout != "q8_0" else 255)
    rel = float((w - dequantize(codes, d, m)).norm() / w.norm())
    assert rel < (0.15 if layout != "q8_0" else 0.008), rel         # measured 0.06-0.12 and 0.004-0.006


@pytest.mark.parametrize("layout,group", [("q4_1", 32), ("q4_0", 128), ("q8_0", 32), ("q8_0", 96)])
def test_quant_linear_paths(layout, group):
    """Every forward path against F.linear on the dequantised weight: the dequantising path to fp32
    rounding; the packed CPU kernels (bf16 activations, bf16 scales) to 2e-2 of scale."""
    torch.manual_seed(0)
    lin = nn.Linear(96 if group == 96 else 256, 48)
    q = QuantLinear.from_linear(lin, layout, group)
    want_w = dequantize(*quantize_rtn(lin.weight, layout, group))
    assert torch.equal(q.weight, want_w)
    x = torch.randn(3, 5, lin.in_features)
    want = F.linear(x, want_w, lin.bias)
    assert_close_scaled(q(x), want, FP32_OP, "dequantising path (15 rows)")
    one = x[:1, :1]
    assert_close_scaled(q(one), F.linear(one, want_w, lin.bias), 2e-2, "few-row path")
    want_path = "int4" if layout != "q8_0" else "int8" if group == lin.in_features else None
    assert q._packed_path(one.reshape(1, -1)) == want_path, \
        "4 bits decode through torch's int4 kernel, 8 bits with one group per row through the int8 one"
    state = q.state_dict()
    back = QuantLinear(lin.in_features, 48, True, layout, group)
    back.load_state_dict(state)
    assert torch.equal(back(x), q(x))
    assert state["qweight"].numel() == 48 * lin.in_features // (2 if layout != "q8_0" else 1)


def test_int8_packed_path_for_one_group_per_row():
    torch.manual_seed(0)
    lin = nn.Linear(128, 40)
    q = QuantLinear.from_linear(lin, "q8_0", 128)
    x = torch.randn(1, 128)
    assert q._packed_path(x) == "int8"
    assert_close_scaled(q(x), F.linear(x, q.weight, lin.bias), 2e-2, "int8 packed kernel")
    assert q._packed_path(torch.randn(PACKED_MAX_ROWS + 1, 128)) is None


def _obs_reference(w, H, layout, group, damp=0.01):
    """GPTQ as the paper's OBS formula, unblocked and without Cholesky: after column i is rounded,
    W[:, F] -= (w_i - q_i) / [Hinv]_ii * Hinv[i, F], then Gaussian elimination removes i from Hinv."""
    W, k = w.double().clone(), w.size(1)
    H = H.double() + damp * torch.diagonal(H.double()).mean() * torch.eye(k, dtype=torch.float64)
    Hinv = torch.linalg.inv(H)
    codes = torch.empty(w.shape, dtype=torch.uint8)
    for i in range(k):
        if i % group == 0:
            _, d, m = quantize_rtn(W[:, i:i + group], layout, group)
            d, m = d[:, 0].double(), m[:, 0].double()
        q = torch.clamp(torch.round((W[:, i] - m) / d), 0, 15 if layout != "q8_0" else 255)
        codes[:, i] = q.to(torch.uint8)
        err = W[:, i] - (d * q + m)
        W[:, i + 1:] -= torch.outer(err / Hinv[i, i], Hinv[i, i + 1:])
        Hinv = Hinv - torch.outer(Hinv[:, i], Hinv[i, :]) / Hinv[i, i]
    return codes


@pytest.mark.parametrize("block", [4, 128])
@pytest.mark.parametrize("layout", ["q4_1", "q4_0"])
def test_gptq_update_equals_the_formula(layout, block):
    """On a hand-sized layer (5 x 12, groups of 4), GPTQ's Cholesky form with lazy block updates
    chooses the same codes as the explicit OBS update (float64 both)."""
    torch.manual_seed(0)
    w = torch.randn(5, 12)
    x = torch.randn(40, 12) @ torch.randn(12, 12)           # correlated inputs
    H = x.t() @ x
    codes, d, m = gptq(w, H, layout, 4, block_size=block, dtype=torch.float64)
    assert torch.equal(codes, _obs_reference(w, H, layout, 4))
    rtn = quantize_rtn(w, layout, 4)[0]
    assert not torch.equal(codes, rtn), "the updates must change some codes"


@pytest.mark.parametrize("layout", ["q4_1", "q4_0", "q8_0"])
def test_gptq_layer_error_at_most_rtn(layout):
    """GPTQ minimises the layer's output error on the calibration inputs: ||X W^T - X Q^T|| is
    below round-to-nearest's, on held-out inputs of the same distribution too."""
    torch.manual_seed(0)
    mix = torch.randn(128, 128) / 8
    x, x_test = torch.randn(512, 128) @ mix, torch.randn(256, 128) @ mix
    w = torch.randn(64, 128) * 0.05
    q_g = dequantize(*gptq(w, x.t() @ x, layout, 32))
    q_r = dequantize(*quantize_rtn(w, layout, 32))
    for inputs in (x, x_test):
        e_g, e_r = (inputs @ (w - q_g).t()).norm(), (inputs @ (w - q_r).t()).norm()
        assert e_g <= e_r, (layout, float(e_g), float(e_r))
    assert (x @ (w - q_g).t()).norm() < 0.8 * (x @ (w - q_r).t()).norm()


def test_hqq_lowers_the_lp_error_and_refuses_symmetric():
    """HQQ starts from RTN's offset and keeps the best one its iterations find: its l_0.7 error is at
    most RTN's (up to fp16's rounding of the offset), lower on heavy-tailed weights."""
    torch.manual_seed(0)
    w = torch.distributions.StudentT(3.0).sample((64, 256)) * 0.02
    lp = lambda q: float((w - dequantize(*q)).abs().pow(0.7).mean())   # noqa: E731
    assert lp(hqq(w, "q4_1", 64)) < lp(quantize_rtn(w, "q4_1", 64))
    with pytest.raises(ValueError, match="asymmetric"):
        hqq(w, "q4_0", 64)


def _llama(tied):
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=300, d_model=64, num_heads=4, num_kv_heads=2, num_layers=2, d_ff=128,
                              max_position_embeddings=64, rope_theta=500.0, tie_word_embeddings=tied)).eval()
    return model


@pytest.mark.parametrize("method,symmetric,tied", [("gptq", False, True), ("rtn", True, False), ("hqq", False, False)])
def test_quantised_gguf_read_by_transformers(tmp_path, method, symmetric, tied):
    """A quantised model written as GGUF Q4_1 / Q4_0 (its very codes): transformers and attnlab read
    the same weights (1e-5 of scale), and they are the in-memory quantised model's (1e-5 of scale)."""
    from transformers import AutoModelForCausalLM
    from attnlab.compress import calibration_stats
    model = _llama(tied)
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    stats = calibration_stats(model, [torch.randint(0, 300, (4, 32), generator=torch.Generator().manual_seed(2))])
    with torch.no_grad():
        fp = model(ids)
    quantize_model(model, 4, 32, method, symmetric=symmetric, calibration=stats)
    path = save_quantized_gguf(model, tmp_path / "q.gguf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    back = attnlab.from_pretrained(path)
    with torch.no_grad():
        ours, theirs, mem = back(ids), hf(ids).logits, model(ids)
    assert_close_scaled(ours, theirs, FP32, "attnlab vs transformers reading the quantised file")
    assert_close_scaled(ours, mem, FP32, "the file vs the quantised model in memory")
    assert not torch.equal(mem, fp)
    import gguf
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert ("Q4_0" if symmetric else "Q4_1") in kinds and "Q8_0" in kinds
    assert hf.config.tie_word_embeddings == tied


def test_bad_input():
    with pytest.raises(ValueError, match="group size 48 does not divide"):
        quantize_rtn(torch.randn(4, 64), "q4_1", 48)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        quantize_model(_llama(False), bits=3)
    with pytest.raises(ValueError, match="gptq needs calibration"):
        quantize_model(_llama(False), method="gptq")
    m = quantize_model(_llama(False), bits=4, group_size=64)
    with pytest.raises(ValueError, match="already quantised"):
        quantize_model(m)
    with pytest.raises(ValueError, match="GGUF blocks hold 32 values"):
        save_quantized_gguf(m, "/tmp/never.gguf")


def test_group_size_none_is_one_group_per_row():
    """group_size=None: per-channel scales, each layer's own width (64 and 128 here); at 8 bits
    a decoding step runs torch's int8 kernel; the weights are RTN's with that group."""
    model = _llama(False)
    want = {n: quantize_rtn(lin.weight, "q8_0", lin.in_features) for n, lin in
            ((n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head")}
    quantize_model(model, 8, None)
    for n, (codes, d, m) in want.items():
        q = model.get_submodule(n)
        assert q.group_size == q.in_features and torch.equal(q.codes(), codes) and torch.equal(q.scales, d)
        assert q._packed_path(torch.randn(1, q.in_features)) == "int8"
    assert {model.get_submodule(n).in_features for n in want} == {64, 128}
    assert model.lm_head.group_size == 32
