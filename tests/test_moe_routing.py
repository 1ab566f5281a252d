"""Pluggable routing of attnlab.nn.SparseMoE: the sigmoid, group-limited rule with its balancing
bias and a shared expert against transformers' DeepseekV3MoE, the input-weighted top-1 sigmoid
rule against Llama4TextMoe, and the rule's own selection against a brute-force reference.
Tolerances: FP32 (1e-5 of the values' scale) for whole blocks; exact equality for chosen experts."""
import itertools

import pytest
import torch

from attnlab.nn import GatedMLP, SigmoidTopK, SoftmaxTopK, SparseMoE
from _tolerance import FP32, assert_close_scaled  # noqa: E402  (tests/ is on sys.path under pytest)

E, FF = 16, 12


def _randomise(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.4 * torch.randn(p.shape, generator=g))
    return module


def test_group_limited_choice_equals_brute_force():
    """With 8 experts in 4 groups, 2 groups allowed and k = 3: the chosen set is the best k of s + b
    among the experts of the two groups whose two best s + b sum highest."""
    rule = SigmoidTopK(8, 3, n_group=4, topk_group=2, normalize=True, scale=2.5, correction_bias=True)
    g = torch.Generator().manual_seed(0)
    rule.e_score_correction_bias.copy_(0.3 * torch.randn(8, generator=g))
    logits = torch.randn(50, 8, generator=g)
    w, idx = rule(logits)
    s = logits.sigmoid()
    c = s + rule.e_score_correction_bias
    for n in range(50):
        groups = c[n].view(4, 2).topk(2, -1).values.sum(-1)
        allowed = set(itertools.chain(*[(2 * gi, 2 * gi + 1) for gi in groups.topk(2).indices.tolist()]))
        ranked = sorted(allowed, key=lambda e: -float(c[n, e]))[:3]
        assert set(idx[n].tolist()) == set(ranked), f"token {n}: chose {idx[n].tolist()}, want {ranked}"
        want = s[n, idx[n]] / s[n, idx[n]].sum() * 2.5           # weights: s, not s + b, normalised, scaled
        assert_close_scaled(w[n], want, 1e-6, f"token {n} weights")


def _experts_into(ref_experts, ours, layout):
    """Copy our per-expert GatedMLPs into transformers' stacked expert tensors."""
    for e, expert in enumerate(ours.experts):
        gate_up = torch.cat([expert.gate_proj.weight, expert.up_proj.weight], 0)      # (2F, E)
        if layout == "X,2F,E":
            ref_experts.gate_up_proj[e].copy_(gate_up)
            ref_experts.down_proj[e].copy_(expert.down_proj.weight)
        else:                                                                          # Llama 4: (X, E, 2F)
            ref_experts.gate_up_proj[e].copy_(gate_up.t())
            ref_experts.down_proj[e].copy_(expert.down_proj.weight.t())


@pytest.mark.parametrize("n_group,topk_group,norm", [(1, 1, True), (4, 2, True), (2, 1, False)])
def test_sigmoid_routing_with_shared_expert_equals_deepseek_v3_moe(n_group, topk_group, norm):
    transformers = pytest.importorskip("transformers")
    X, k = 8, 2
    cfg = transformers.DeepseekV3Config(hidden_size=E, moe_intermediate_size=FF, n_routed_experts=X,
                                        num_experts_per_tok=k, n_group=n_group, topk_group=topk_group,
                                        norm_topk_prob=norm, routed_scaling_factor=1.7, n_shared_experts=2,
                                        num_hidden_layers=1, first_k_dense_replace=0, vocab_size=8,
                                        num_attention_heads=2, num_key_value_heads=2)
    rule = SigmoidTopK(X, k, n_group=n_group, topk_group=topk_group, normalize=norm, scale=1.7, correction_bias=True)
    ours = _randomise(SparseMoE(E, FF, X, k, routing=rule, shared_expert=GatedMLP(E, 2 * FF))).eval()
    with torch.no_grad():
        rule.e_score_correction_bias.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(3))
    ref = transformers.DeepseekV3Model(cfg).layers[0].mlp.eval()       # DeepseekV3MoE, through the public class
    with torch.no_grad():
        ref.gate.weight.copy_(ours.gate.weight)
        ref.gate.e_score_correction_bias.copy_(rule.e_score_correction_bias)
        _experts_into(ref.experts, ours, "X,2F,E")
        ref.shared_experts.load_state_dict(ours.shared_expert.state_dict())
        x = torch.randn(3, 7, E, generator=torch.Generator().manual_seed(1))
        _, want_w, want_i = ref.gate(x)
        got_w, got_i = rule(ours.gate(x.reshape(-1, E)))
        assert torch.equal(got_i.sort(-1).values, want_i.sort(-1).values), "chosen experts differ from DeepSeek-V3's"
        assert_close_scaled(ours(x), ref(x), FP32, f"SparseMoE(SigmoidTopK) vs DeepseekV3MoE ({n_group}/{topk_group})")


def test_input_weighted_top1_equals_llama4_moe():
    transformers = pytest.importorskip("transformers")
    X = 4
    cfg = transformers.Llama4TextConfig(hidden_size=E, intermediate_size=FF, num_local_experts=X,
                                        num_experts_per_tok=1, hidden_act="silu", num_hidden_layers=1, vocab_size=8,
                                        num_attention_heads=2, num_key_value_heads=2, head_dim=8)
    ours = _randomise(SparseMoE(E, FF, X, 1, routing=SigmoidTopK(X, 1), shared_expert=GatedMLP(E, FF),
                                weights_on="inputs")).eval()
    ref = transformers.Llama4TextModel(cfg).layers[0].feed_forward.eval()    # Llama4TextMoe, via the public class
    with torch.no_grad():
        ref.router.weight.copy_(ours.gate.weight)
        _experts_into(ref.experts, ours, "X,E,2F")
        ref.shared_expert.load_state_dict(ours.shared_expert.state_dict())
        x = torch.randn(2, 9, E, generator=torch.Generator().manual_seed(2))
        want, _ = ref(x)
        got = ours(x)
        assert_close_scaled(got, want.view_as(got), FP32, "SparseMoE(inputs-weighted SigmoidTopK) vs Llama4TextMoe")
        # weighting the outputs instead is a different function for a non-linear expert: the test can fail
        ours.weights_on = "outputs"
        assert (ours(x) - got).abs().max() > 1e-3


def test_padding_reaches_no_routed_expert_but_the_shared_one():
    ours = _randomise(SparseMoE(E, FF, 4, 2, routing=SigmoidTopK(4, 2), shared_expert=GatedMLP(E, FF))).eval()
    x = torch.randn(2, 5, E)
    pad = torch.ones(2, 5, dtype=torch.bool)
    pad[0, :2] = False
    with torch.no_grad():
        y = ours(x, pad)
        assert_close_scaled(y[~pad], ours.shared_expert(x[~pad]), 1e-6, "padding: shared expert only")
        assert_close_scaled(y[pad], ours(x)[pad], FP32, "real tokens unchanged by the mask")


def test_routing_rules_refuse_bad_settings():
    with pytest.raises(ValueError, match="n_group dividing num_experts"):
        SigmoidTopK(8, 2, n_group=3)
    with pytest.raises(ValueError, match="top_k \\(5\\) must be between 1 and the experts of the topk_group"):
        SigmoidTopK(8, 5, n_group=4, topk_group=2)
    with pytest.raises(ValueError, match="routing rule's top_k \\(1\\) differs from top_k \\(2\\)"):
        SparseMoE(E, FF, 4, 2, routing=SoftmaxTopK(1))
    with pytest.raises(ValueError, match="weights_on must be"):
        SparseMoE(E, FF, 4, 2, weights_on="both")
    assert "e_score_correction_bias" not in SigmoidTopK(4, 1).state_dict()
    assert "e_score_correction_bias" in SigmoidTopK(4, 1, correction_bias=True).state_dict()
