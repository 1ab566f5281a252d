"""Parity tests for attnlab.nn.norm and attnlab.nn.mlp against torch and Hugging Face."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnlab.nn import (DyT, FeedForward, GatedMLP, LayerNorm, RMSNorm, SparseMoE, expert_counts,
                        load_balancing_loss, make_norm)

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaModel, MixtralConfig, MixtralForCausalLM, MixtralModel  # noqa: E402

from _tolerance import FP32, FP32_OP, assert_close_scaled  # noqa: E402  (tests/ is on sys.path under pytest)

E, FF = 16, 40


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _llama_layer(**config) -> LlamaModel:
    """A one-layer LlamaModel: its final ``.norm`` is LlamaRMSNorm and ``.layers[0].mlp`` is LlamaMLP,
    read through the public class so that a private class moving between versions breaks nothing."""
    base = dict(hidden_size=E, intermediate_size=FF, num_attention_heads=2, num_key_value_heads=2,
                num_hidden_layers=1, vocab_size=8)
    return LlamaModel(LlamaConfig(**{**base, **config}))


def _llama_rmsnorm(eps: float = 1e-6) -> nn.Module:
    return _llama_layer(rms_norm_eps=eps).norm


def _randomise(module: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.5)
    return module


def _max_err(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


# --------------------------------------------------------------------------- norms

@pytest.mark.parametrize("bias", [True, False])
def test_layernorm_matches_torch_fp32(bias):
    ours, ref = _randomise(LayerNorm(E, bias=bias)), nn.LayerNorm(E, bias=bias)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(3, 5, E) * 3 + 1
    assert_close_scaled(ours(x), ref(x), FP32_OP, "LayerNorm vs torch.nn.LayerNorm fp32")


def test_layernorm_bf16_is_torchs_and_within_one_rounding_of_fp32():
    """On a bf16 input LayerNorm is torch.nn.LayerNorm bit for bit (the module transformers' bf16
    models run), with bf16 and with fp32 parameters, and within one bf16 rounding (2^-8 of the
    value) of the norm computed in fp32 and cast back; under autocast it is that fp32 norm cast
    back, bit for bit."""
    ours = _randomise(LayerNorm(E))
    ref = torch.nn.LayerNorm(E)
    ref.load_state_dict(ours.state_dict())
    x = (torch.randn(4, 7, E) * 2 + 5).to(torch.bfloat16)
    y = ours(x)
    assert y.dtype == torch.bfloat16, f"LayerNorm bf16 output dtype {y.dtype}, expected bfloat16"
    assert torch.equal(y, ref(x)), f"LayerNorm bf16 != torch.nn.LayerNorm (tolerance 0), err {_max_err(y, ref(x))}"
    fp32 = F.layer_norm(x.float(), (E,), ours.weight, ours.bias, 1e-5)
    assert ((y.float() - fp32).abs() <= fp32.abs() * 2 ** -8 + 1e-6).all(), _max_err(y, fp32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = ours(x)
    assert auto.dtype == torch.bfloat16 and torch.equal(auto, fp32.to(torch.bfloat16)), "under autocast"
    assert torch.equal(ours.to(torch.bfloat16)(x), ref.to(torch.bfloat16)(x)), "bf16 parameters"


def test_rmsnorm_matches_hf_and_torch_fp32():
    ours = _randomise(RMSNorm(E, eps=1e-6))
    hf = _llama_rmsnorm(eps=1e-6)
    hf.load_state_dict(ours.state_dict())
    tnorm = nn.RMSNorm(E, eps=1e-6)
    tnorm.load_state_dict(ours.state_dict())
    x = torch.randn(2, 9, E) * 4
    y = ours(x)
    assert torch.equal(y, hf(x)), f"RMSNorm vs LlamaRMSNorm fp32 not bit-identical, err {_max_err(y, hf(x))}"
    assert_close_scaled(y, tnorm(x), FP32_OP, "RMSNorm vs torch.nn.RMSNorm fp32")


def test_rmsnorm_bf16_bit_identical_to_hf():
    ours = _randomise(RMSNorm(E)).to(torch.bfloat16)
    hf = _llama_rmsnorm().to(torch.bfloat16)
    hf.load_state_dict(ours.state_dict())
    x = (torch.randn(3, 11, E) * 10).to(torch.bfloat16)
    y, want = ours(x), hf(x)
    assert y.dtype == want.dtype == torch.bfloat16, f"dtypes {y.dtype} vs {want.dtype}"
    assert torch.equal(y, want), f"RMSNorm bf16 vs LlamaRMSNorm not bit-identical (tolerance 0), err {_max_err(y, want)}"
    # A module with fp32 weights on bf16 input follows HF too (promotes to fp32).
    ours32, hf32 = _randomise(RMSNorm(E)), _llama_rmsnorm()
    hf32.load_state_dict(ours32.state_dict())
    assert torch.equal(ours32(x), hf32(x)), "RMSNorm fp32 weights / bf16 input differs from LlamaRMSNorm (tolerance 0)"


def test_dyt_formula_and_gradients():
    m = DyT(E, alpha_init=0.7)
    with torch.no_grad():
        m.weight.normal_()
        m.bias.normal_()
    x = torch.randn(2, 3, E) * 3
    want = m.weight * torch.tanh(0.7 * x) + m.bias
    assert_close_scaled(m(x), want, FP32_OP, "DyT vs weight*tanh(alpha*x)+bias")
    assert m.alpha.numel() == 1, f"DyT alpha must be one scalar, has {m.alpha.numel()} elements"
    m(x).pow(2).sum().backward()
    for name in ("alpha", "weight", "bias"):
        g = getattr(m, name).grad
        assert g is not None and g.abs().sum() > 0, f"DyT: no gradient reached {name}"


def test_make_norm():
    assert isinstance(make_norm("layernorm", E), LayerNorm)
    r = make_norm("rmsnorm", E, eps=1e-5)
    assert isinstance(r, RMSNorm) and r.eps == 1e-5, f"make_norm rmsnorm gave {r!r}"
    assert isinstance(make_norm("dyt", E), DyT)
    with pytest.raises(ValueError, match="layernorm, rmsnorm, dyt"):
        make_norm("batchnorm", E)


# --------------------------------------------------------------------------- dense MLPs

@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_feedforward_matches_transformer_encoder_layer(activation):
    ours = FeedForward(E, FF, dropout=0.1, activation=activation).eval()
    ref = nn.TransformerEncoderLayer(E, nhead=2, dim_feedforward=FF, dropout=0.1,
                                     activation=activation, batch_first=True).eval()
    ref.linear1.load_state_dict(ours.linear1.state_dict())
    ref.linear2.load_state_dict(ours.linear2.state_dict())
    x = torch.randn(2, 6, E)
    want = ref.linear2(ref.dropout(ref.activation(ref.linear1(x))))
    assert_close_scaled(ours(x), want, FP32_OP, f"FeedForward({activation}) vs TransformerEncoderLayer FFN")


def test_feedforward_gelu_tanh_and_dropout_placement():
    ours = FeedForward(E, FF, activation="gelu_tanh")
    x = torch.randn(2, 6, E)
    want = ours.linear2(F.gelu(ours.linear1(x), approximate="tanh"))
    assert_close_scaled(ours(x), want, FP32_OP, "FeedForward(gelu_tanh)")
    # dropout 0.999 in training zeroes (nearly) the whole hidden: output collapses to the bias b2.
    drop = FeedForward(E, FF, dropout=0.999).train()
    drop.linear2.load_state_dict(ours.linear2.state_dict())
    torch.manual_seed(1)
    y = drop(x)
    frac = (y - drop.linear2.bias).abs().lt(1e-6).float().mean().item()
    assert frac > 0.5, f"dropout is not on the hidden before linear2 ({frac:.2f} of outputs equal b2)"


@pytest.mark.parametrize("activation,hf_act", [("silu", "silu"), ("gelu", "gelu"),
                                                ("gelu_tanh", "gelu_pytorch_tanh")])
def test_gated_mlp_matches_llama_mlp(activation, hf_act):
    ref = _llama_layer(hidden_act=hf_act, mlp_bias=False).layers[0].mlp
    ours = _randomise(GatedMLP(E, FF, activation=activation))
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(3, 5, E)
    assert_close_scaled(ours(x), ref(x), FP32_OP, f"GatedMLP({activation}) vs LlamaMLP")


# --------------------------------------------------------------------------- mixture of experts

def _mixtral_config(num_experts=4, top_k=2, num_layers=1):
    return MixtralConfig(hidden_size=E, intermediate_size=FF, num_local_experts=num_experts,
                         num_experts_per_tok=top_k, hidden_act="silu", num_attention_heads=2,
                         num_key_value_heads=2, num_hidden_layers=num_layers, vocab_size=32)


def _mixtral_pair(num_experts=4, top_k=2):
    # MixtralSparseMoeBlock, read through the public MixtralModel
    ref = MixtralModel(_mixtral_config(num_experts, top_k)).layers[0].mlp.eval()
    ours = _randomise(SparseMoE(E, FF, num_experts, top_k=top_k)).eval()
    with torch.no_grad():
        ref.gate.weight.copy_(ours.gate.weight)
        for e, expert in enumerate(ours.experts):      # gate_up_proj (X, 2F, E): gate rows then up rows
            ref.experts.gate_up_proj[e].copy_(torch.cat([expert.gate_proj.weight, expert.up_proj.weight], 0))
            ref.experts.down_proj[e].copy_(expert.down_proj.weight)
    return ours, ref


@pytest.mark.parametrize("num_experts,top_k", [(4, 2), (8, 2), (5, 1), (3, 3)])
def test_sparse_moe_matches_mixtral(num_experts, top_k):
    ours, ref = _mixtral_pair(num_experts, top_k)
    x = torch.randn(3, 7, E)
    y = ours(x)
    logits = ours.router_logits
    want = ref(x.clone())
    want_logits, _, _ = ref.gate(x.reshape(-1, E))
    assert logits.shape == (21, num_experts), f"router logits shape {tuple(logits.shape)}"
    assert_close_scaled(logits, want_logits, FP32_OP, "router logits vs Mixtral")
    assert_close_scaled(y, want, FP32, f"SparseMoE vs MixtralSparseMoeBlock (X={num_experts}, k={top_k})")


def test_sparse_moe_padding_and_gradients():
    ours, _ = _mixtral_pair()
    x = torch.randn(2, 6, E, requires_grad=True)
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2], dtype=torch.bool)
    y_full = ours(x)
    y = ours(x, padding_mask=mask)
    assert ours.router_logits.shape == (12, 4) and torch.equal(ours.router_mask, mask.flatten())
    assert_close_scaled(y[mask], y_full[mask], FP32_OP, "padding changed real-token outputs")
    assert torch.equal(y[~mask], torch.zeros_like(y[~mask])), "padding tokens must get zero output"
    y.sum().backward()
    assert x.grad[~mask].abs().sum() == 0, "padding tokens must get no gradient"
    for name, p in ours.named_parameters():
        assert p.grad is not None, f"no gradient for {name}"


def _hf_router_loss(num_experts, top_k, batch, length, num_layers=1, mask=None):
    """transformers' load-balancing loss through its public output: MixtralForCausalLM run with
    output_router_logits=True returns every layer's router logits (batch * length, X) and the
    aux_loss computed from them (masked by attention_mask; unscaled, before router_aux_loss_coef)."""
    model = MixtralForCausalLM(_mixtral_config(num_experts, top_k, num_layers)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):       # router logits of order 2 (unit-RMS input, sqrt(E) * 0.5):
                p.normal_(0.0, 0.5)                 # routing far from uniform, as randn * 2 logits
        ids = torch.randint(0, 32, (batch, length))
        out = model(ids, attention_mask=None if mask is None else mask.long(), output_router_logits=True)
    logits = list(out.router_logits)
    assert len(logits) == num_layers and logits[0].shape == (batch * length, num_experts)
    assert logits[0].std() > 1.0, "router logits too uniform for the comparison to mean anything"
    return logits, out.aux_loss


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_load_balancing_loss_matches_hf_over_k(top_k):
    X = 6
    (logits,), hf = _hf_router_loss(X, top_k, batch=4, length=9)
    ours = load_balancing_loss(logits, X, top_k)
    hf = hf / top_k                                 # HF does not normalise f by k (pitfall 20)
    assert_close_scaled(ours, hf, FP32_OP, f"load_balancing_loss vs HF/k (k={top_k})")


def test_load_balancing_loss_padding_matches_hf():
    X, k = 5, 2
    mask = torch.ones(3, 8, dtype=torch.bool)
    mask[1, 5:] = False
    mask[2, 2:] = False
    layers, hf = _hf_router_loss(X, k, batch=3, length=8, num_layers=3, mask=mask)
    ours = load_balancing_loss(layers, X, k, padding_mask=mask)
    assert_close_scaled(ours, hf / k, FP32_OP, "masked load_balancing_loss vs HF/k")
    # Padding rows must not matter at all: garbage in them leaves the loss unchanged.
    noisy = [t.clone() for t in layers]
    for t in noisy:
        t[~mask.reshape(-1)] = torch.randn(int((~mask).sum()), X) * 50
    assert_close_scaled(load_balancing_loss(noisy, X, k, padding_mask=mask), ours, FP32_OP, "padding rows changed the loss")
    unmasked = load_balancing_loss(layers, X, k)
    assert abs(unmasked.item() - ours.item()) > 1e-4, "the mask had no effect on the loss"


def test_load_balancing_loss_uniform_routing_is_one():
    # 4 experts, k=2, 12 tokens whose top-2 pairs cycle over all 6 pairs (each expert chosen
    # 6 times out of 24 assignments, f_e = 1/4) with nearly uniform probabilities (P_e ~ 1/4).
    X, k = 4, 2
    pairs = [(0, 1), (2, 3), (0, 2), (1, 3), (0, 3), (1, 2)] * 2
    logits = torch.zeros(len(pairs), X)
    for row, (a, b) in enumerate(pairs):
        logits[row, a] = logits[row, b] = 1e-4
    loss = load_balancing_loss(logits, X, k)
    assert abs(loss.item() - 1.0) <= 1e-4, f"uniform routing must give loss 1.0 (tol 1e-4), got {loss.item()}"
    counts = expert_counts(logits, k)
    assert counts.tolist() == [6, 6, 6, 6], f"expert_counts on uniform routing: {counts.tolist()}"


def test_expert_counts_with_padding():
    logits = torch.tensor([[5.0, 1.0, 0.0], [0.0, 5.0, 1.0], [1.0, 0.0, 5.0], [5.0, 4.0, 0.0]])
    mask = torch.tensor([[True, True], [True, False]])
    assert expert_counts(logits, 1).tolist() == [2, 1, 1]
    assert expert_counts(logits, 1, padding_mask=mask).tolist() == [1, 1, 1]
    assert expert_counts(logits, 2, padding_mask=mask).tolist() == [2, 2, 2]


# --------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("build,pattern", [
    (lambda: FeedForward(E, 0), "d_ff"),
    (lambda: FeedForward(E, FF, activation="swish"), "valid activations are relu, gelu, gelu_tanh"),
    (lambda: GatedMLP(E, -1), "d_ff"),
    (lambda: GatedMLP(E, FF, activation="relu"), "valid activations are silu, gelu, gelu_tanh"),
    (lambda: SparseMoE(E, FF, num_experts=2, top_k=3), "top_k"),
    (lambda: SparseMoE(E, FF, num_experts=0), "num_experts"),
    (lambda: LayerNorm(0), "width"),
    (lambda: load_balancing_loss(torch.randn(4, 3), num_experts=4, top_k=1), "num_experts"),
    (lambda: load_balancing_loss(torch.randn(4, 3), 3, top_k=4), "top_k"),
    (lambda: load_balancing_loss(torch.randn(4, 3), 3, 1, torch.ones(5, dtype=torch.bool)), "padding_mask"),
])
def test_bad_arguments_raise(build, pattern):
    with pytest.raises(ValueError, match=pattern):
        build()


@pytest.mark.parametrize("module", [FeedForward(E, FF), GatedMLP(E, FF), SparseMoE(E, FF, 4),
                                    LayerNorm(E), RMSNorm(E), DyT(E)], ids=lambda m: type(m).__name__)
def test_wrong_width_raises(module):
    with pytest.raises(ValueError, match=f"{E + 1}"):
        module(torch.randn(2, 3, E + 1))
