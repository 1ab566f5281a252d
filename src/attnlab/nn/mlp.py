"""Position-wise feed-forward blocks: the classic FFN, the gated MLP (SwiGLU/GeGLU) and a
sparse mixture of experts with its load-balancing loss.

Shapes: (B, T, E) -> (B, T, E), with E = d_model and F = d_ff the hidden width;
N = B*T flattened tokens, X = number of experts, k = experts per token.
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
from torch import Tensor, nn

from .checkpoint import recomputing
from .inplace import activate_in_place, hooked, may_overwrite
from .linear import StackedLinear, fused_activation

__all__ = ["FeedForward", "GatedMLP", "SparseMoE", "SoftmaxTopK", "SigmoidTopK", "load_balancing_loss",
           "expert_counts", "make_activation", "ACTIVATIONS", "QuickGELU"]

ACTIVATIONS = ("relu", "silu", "gelu", "gelu_tanh", "quick_gelu")


class QuickGELU(nn.Module):
    """x * sigmoid(1.702 x): the sigmoid approximation of GELU that OpenAI's CLIP was trained with."""

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.sigmoid(1.702 * x)


def _activation(owner: str, name: str, valid: tuple[str, ...]) -> nn.Module:
    if name not in valid:
        raise ValueError(f"{owner}: unknown activation {name!r}; valid activations are {', '.join(valid)}")
    return {"relu": nn.ReLU, "silu": nn.SiLU, "gelu": nn.GELU,
            "gelu_tanh": partial(nn.GELU, approximate="tanh"), "quick_gelu": QuickGELU}[name]()


def make_activation(name: str) -> nn.Module:
    """An activation module by name: "relu", "silu", "gelu" (exact, with erf) or "gelu_tanh"
    (GPT-2's tanh approximation); for heads that apply one outside a feed-forward block."""
    return _activation("make_activation", name, ACTIVATIONS)


def _check_sizes(owner: str, d_model: int, d_ff: int, dropout: float) -> None:
    if d_model <= 0 or d_ff <= 0:
        raise ValueError(f"{owner}: d_model ({d_model}) and d_ff ({d_ff}) must be positive")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"{owner}: dropout must be in [0, 1), got {dropout}")


def _check_input(owner: str, x: Tensor, d_model: int) -> None:
    if x.size(-1) != d_model:
        raise ValueError(f"{owner}: input last dim {x.size(-1)} != d_model {d_model} (shape {tuple(x.shape)})")


class FeedForward(nn.Module):
    r"""FFN(x) = act(x W_1 + b_1) W_2 + b_2, applied to every position alone.

    Vaswani et al. 2017, section 3.3 (ReLU); GELU as in BERT/GPT-2 ("gelu_tanh" is GPT-2's
    tanh approximation). Dropout sits after the activation, where
    ``torch.nn.TransformerEncoderLayer`` puts it (linear1 -> act -> dropout -> linear2); the
    residual dropout belongs to the block. ``linear1`` (E -> F) and ``linear2`` (F -> E)
    map 1:1 onto that layer's weights.

    Shapes: (..., E) -> (..., E).
    """

    ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "quick_gelu")
    returns_new_tensor = True           # the caller may overwrite the output (attnlab.nn.inplace)

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.0, activation: str = "relu",
                 bias: bool = True):
        super().__init__()
        _check_sizes("FeedForward", d_model, d_ff, dropout)
        self.d_model, self.d_ff = d_model, d_ff
        self.act = _activation("FeedForward", activation, self.ACTIVATIONS)
        self.linear1 = nn.Linear(d_model, d_ff, bias=bias)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        _check_input("FeedForward", x, self.d_model)
        fused = fused_activation(self, self.linear1, self.act, x)    # the activation inside oneDNN's product
        if fused is not None:
            return self.linear2(self.dropout(fused))
        h = self.linear1(x)
        # in inference the activation overwrites the hidden tensor (attnlab.nn.inplace): same values
        act = activate_in_place(self.act, h) if may_overwrite(self, h, self.linear1) else None
        return self.linear2(self.dropout(self.act(h) if act is None else act))


class GatedMLP(nn.Module):
    r"""GatedMLP(x) = (act(x W_gate) * (x W_up)) W_down   (GLU variants, Shazeer 2020).

    act = SiLU gives SwiGLU (LLaMA, Mixtral experts), GELU gives GeGLU (exact or
    "gelu_tanh"). Submodules ``gate_proj``, ``up_proj`` (E -> F) and ``down_proj`` (F -> E),
    named as in Hugging Face's LlamaMLP. Dropout, if any, acts on the gated hidden (..., F).

    Shapes: (..., E) -> (..., E).
    """

    ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
    returns_new_tensor = True

    def __init__(self, d_model: int, d_ff: int, activation: str = "silu", bias: bool = False,
                 dropout: float = 0.0):
        super().__init__()
        _check_sizes("GatedMLP", d_model, d_ff, dropout)
        self.d_model, self.d_ff = d_model, d_ff
        self.act = _activation("GatedMLP", activation, self.ACTIVATIONS)
        self.gate_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def stack_projections(self) -> None:
        """Compute gate and up in one product from then on (:class:`~attnlab.nn.linear.StackedLinear`:
        the parameters become views of one stacked weight, the state dict does not change).
        :func:`~attnlab.nn.optimize_for_inference` calls it; idempotent."""
        layers, stacked = (self.gate_proj, self.up_proj), self.__dict__.get("_stacked_gate_up")
        if stacked is not None and stacked.layers == layers and stacked.intact():
            return
        try:
            self.__dict__["_stacked_gate_up"] = StackedLinear(layers)
        except (TypeError, ValueError):         # not plain Linear layers: keep two products
            self.__dict__.pop("_stacked_gate_up", None)

    def forward(self, x: Tensor) -> Tensor:
        _check_input("GatedMLP", x, self.d_model)
        stacked = self.__dict__.get("_stacked_gate_up")
        if stacked is not None and stacked.usable(x, self.gate_proj, self.up_proj) and not hooked(self):
            gate, up = stacked.stack(x)         # views of one fresh product: overwritten in place
            act = activate_in_place(self.act, gate)
            return self.down_proj(self.dropout(self.act(gate) * up if act is None else act.mul_(up)))
        fused = fused_activation(self, self.gate_proj, self.act, x)
        if fused is not None:
            return self.down_proj(self.dropout(fused.mul_(self.up_proj(x))))
        gate, up = self.gate_proj(x), self.up_proj(x)
        act = activate_in_place(self.act, gate) if may_overwrite(self, gate, self.gate_proj) else None
        return self.down_proj(self.dropout(self.act(gate) * up if act is None else act.mul_(up)))


# --------------------------------------------------------------------------- mixture of experts

def _route(router_logits: Tensor, top_k: int) -> tuple[Tensor, Tensor, Tensor]:
    """(N, X) logits -> fp32 probabilities (N, X), renormalised top-k weights (N, k), indices (N, k)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    top_w, top_i = torch.topk(probs, top_k, dim=-1)
    return probs, top_w / top_w.sum(dim=-1, keepdim=True), top_i


class SoftmaxTopK(nn.Module):
    r"""Routing rule of Mixtral (Jiang et al. 2024, section 2.1): p = softmax(logits) in fp32, the k
    most probable experts, their probabilities renormalised to sum to 1. No state of its own.

    ``forward(router_logits (N, X)) -> (weights (N, k) fp32, experts (N, k))``."""

    def __init__(self, top_k: int):
        super().__init__()
        self.top_k = top_k

    def forward(self, router_logits: Tensor) -> tuple[Tensor, Tensor]:
        _, top_w, top_i = _route(router_logits, self.top_k)
        return top_w, top_i

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}"


class SigmoidTopK(nn.Module):
    r"""Sigmoid routing with group-limited selection and a balancing bias (Liu et al. 2024,
    arXiv:2412.19437, section 2.1.2; with its defaults, a plain top-k of sigmoid scores).

    s = sigmoid(logits) in fp32. The experts are chosen on s + b, where b
    (``e_score_correction_bias``, X) is a bias that training nudges to balance the load without an
    auxiliary loss; it steers the choice only, never the weights. With ``n_group`` > 1 the X experts
    form n_group equal groups, each scored by the sum of its two best s + b, and only the
    ``topk_group`` best groups may be chosen from (a token reaches a bounded number of devices).
    The weights are s of the k chosen experts, divided by their sum if ``normalize``, then
    multiplied by ``scale`` (the paper's routed scaling factor).

    ``correction_bias``: keep b as a (persistent) buffer; False for a router without one.
    ``forward(router_logits (N, X)) -> (weights (N, k) fp32, experts (N, k))``."""

    def __init__(self, num_experts: int, top_k: int, *, n_group: int = 1, topk_group: int = 1,
                 normalize: bool = False, scale: float = 1.0, correction_bias: bool = False):
        super().__init__()
        if n_group <= 0 or num_experts % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(f"SigmoidTopK: need n_group dividing num_experts ({num_experts}) and 1 <= topk_group "
                             f"<= n_group, got n_group={n_group}, topk_group={topk_group}")
        if n_group > 1 and num_experts // n_group < 2:
            raise ValueError(f"SigmoidTopK: each of the {n_group} groups needs two experts to be scored")
        if not 1 <= top_k <= num_experts * topk_group // n_group:
            raise ValueError(f"SigmoidTopK: top_k ({top_k}) must be between 1 and the experts of the topk_group "
                             f"groups ({num_experts * topk_group // n_group})")
        self.num_experts, self.top_k, self.n_group, self.topk_group = num_experts, top_k, n_group, topk_group
        self.normalize, self.scale = normalize, scale
        if correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))
        else:
            self.e_score_correction_bias = None

    def forward(self, router_logits: Tensor) -> tuple[Tensor, Tensor]:
        scores = router_logits.float().sigmoid()                                        # (N, X)
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias.float()
        if self.n_group > 1:
            N, G = choice.size(0), self.n_group
            grouped = choice.view(N, G, -1)
            best = grouped.topk(2, dim=-1).values.sum(-1)                               # (N, G)
            keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(self.topk_group, dim=-1).indices,
                                                                     True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(N, -1)
        top_i = choice.topk(self.top_k, dim=-1).indices
        top_w = scores.gather(1, top_i)
        if self.normalize:
            top_w = top_w / (top_w.sum(-1, keepdim=True) + 1e-20)
        return top_w * self.scale, top_i

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, n_group={self.n_group}, "
                f"topk_group={self.topk_group}, normalize={self.normalize}, scale={self.scale}")


def _flat_mask(owner: str, padding_mask: Tensor | None, rows: int) -> Tensor | None:
    if padding_mask is None:
        return None
    if padding_mask.numel() != rows:
        raise ValueError(f"{owner}: padding_mask of shape {tuple(padding_mask.shape)} does not cover "
                         f"the {rows} routed tokens")
    return padding_mask.reshape(-1).bool()


class SparseMoE(nn.Module):
    r"""Sparse mixture of experts: y = sum_{e in TopK} g_e(x) * Expert_e(x)  [+ Shared(x)].

    The router ``gate`` (a bias-free Linear, E -> X) scores the X experts; a routing rule turns
    the scores into each token's k experts and their weights g. The default rule is Mixtral's
    (:class:`SoftmaxTopK`: softmax in fp32, top-k renormalised; Jiang et al. 2024, section 2.1;
    Shazeer et al. 2017); :class:`SigmoidTopK` scores with sigmoids instead. Every expert is a
    SwiGLU :class:`GatedMLP`. Tokens are dispatched per expert (gather, run, scatter-add), so the
    cost is k expert passes per token, never X.

    Args:
        num_experts: X; top_k: k (1 <= k <= X).
        router_jitter: in training, multiply the router input by U(1 - j, 1 + j) noise
            (Switch Transformer's jitter, Fedus et al. 2021); 0 disables it.
        routing: the rule, a module ``(router_logits (N, X)) -> (weights (N, k), experts (N, k))``
            with a ``top_k`` equal to ``top_k``; default ``SoftmaxTopK(top_k)``.
        shared_expert: a module every token goes through besides its routed experts, added to y
            (shared experts, Dai et al. 2024, arXiv:2401.06066); None: none.
        weights_on: "outputs": g_e * Expert_e(x) (Mixtral); "inputs": Expert_e(g_e * x), the
            expert's input scaled instead (a different function for a non-linear expert).

    ``forward(x (B, T, E), padding_mask (B, T) bool, True = real token, optional) -> y (B, T, E)``.
    Padding tokens are not sent to any expert and get y = 0 (the shared expert sees them).
    The routing of the last forward stays on the module for the load-balancing loss:
    ``router_logits`` (B*T, X), with the graph when gradients are on, and ``router_mask`` (B*T,)
    bool or None (padding included in the logits, excluded by the mask). A checkpointed layer's
    recomputation does not overwrite them, and copies of the module do not carry them. Weights:
    ``gate`` (X, E) router, ``experts[e].{gate,up,down}_proj``, ``shared_expert.*``.
    """

    returns_new_tensor = True

    def __init__(self, d_model: int, d_ff: int, num_experts: int, top_k: int = 2,
                 activation: str = "silu", router_jitter: float = 0.0, *, routing: nn.Module | None = None,
                 shared_expert: nn.Module | None = None, weights_on: str = "outputs"):
        super().__init__()
        _check_sizes("SparseMoE", d_model, d_ff, 0.0)
        if num_experts <= 0:
            raise ValueError(f"SparseMoE: num_experts must be positive, got {num_experts}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"SparseMoE: top_k ({top_k}) must be between 1 and num_experts ({num_experts})")
        if router_jitter < 0:
            raise ValueError(f"SparseMoE: router_jitter must be >= 0, got {router_jitter}")
        if routing is not None and getattr(routing, "top_k", None) != top_k:
            raise ValueError(f"SparseMoE: the routing rule's top_k ({getattr(routing, 'top_k', None)}) differs from "
                             f"top_k ({top_k})")
        if weights_on not in ("outputs", "inputs"):
            raise ValueError(f"SparseMoE: weights_on must be 'outputs' or 'inputs', got {weights_on!r}")
        self.d_model, self.d_ff, self.num_experts, self.top_k = d_model, d_ff, num_experts, top_k
        self.router_jitter, self.weights_on = router_jitter, weights_on
        self.gate = nn.Linear(d_model, num_experts, bias=False)
        self.routing = SoftmaxTopK(top_k) if routing is None else routing
        self.experts = nn.ModuleList(GatedMLP(d_model, d_ff, activation) for _ in range(num_experts))
        self.shared_expert = shared_expert
        self.router_logits: Tensor | None = None
        self.router_mask: Tensor | None = None

    def __getstate__(self):                  # copy.deepcopy / pickle: a record with a graph is not state
        state = dict(super().__getstate__())
        state["router_logits"] = state["router_mask"] = None
        return state

    def forward(self, x: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        _check_input("SparseMoE", x, self.d_model)
        if x.dim() != 3:
            raise ValueError(f"SparseMoE: input must be (batch, seq, d_model), got shape {tuple(x.shape)}")
        B, T, E = x.shape
        flat = x.reshape(B * T, E)                                        # (N, E)
        keep = _flat_mask("SparseMoE", padding_mask, B * T)
        router_in = flat
        if self.training and self.router_jitter > 0:
            j = self.router_jitter
            router_in = flat * torch.empty_like(flat).uniform_(1.0 - j, 1.0 + j)
        router_logits = self.gate(router_in)                              # (N, X)
        if not recomputing():
            self.router_logits, self.router_mask = router_logits, keep
        top_w, top_i = self.routing(router_logits)                        # (N, k) each

        # Sort the N*k (token, expert) assignments by expert; padding goes to a dummy bin X.
        if keep is not None:
            top_i = top_i.masked_fill(~keep[:, None], self.num_experts)
        flat_e = top_i.reshape(-1)
        order = torch.argsort(flat_e, stable=True)
        tokens = order // self.top_k                                      # token of each assignment
        weights = top_w.reshape(-1)[order]
        counts = torch.bincount(flat_e, minlength=self.num_experts + 1).tolist()  # one host sync

        y = torch.zeros_like(flat)
        start = 0
        for e in range(self.num_experts):
            n = counts[e]
            if n:
                idx = tokens[start:start + n]
                w = weights[start:start + n, None]
                if self.weights_on == "inputs":
                    out = self.experts[e](flat.index_select(0, idx) * w.to(flat.dtype))
                else:
                    out = self.experts[e](flat.index_select(0, idx)) * w
                y.index_add_(0, idx, out.to(y.dtype))
            start += n
        if self.shared_expert is not None:
            y = y + self.shared_expert(flat)
        return y.view(B, T, E)


def _as_rows(owner: str, router_logits: Tensor | Sequence[Tensor], padding_mask: Tensor | None,
             num_experts: int | None, top_k: int) -> tuple[Tensor, Tensor | None]:
    """Concatenate per-layer (N, X) logits into (L*N, X) and repeat the flat mask per layer."""
    layers = [router_logits] if isinstance(router_logits, Tensor) else list(router_logits)
    if not layers or any(t.dim() != 2 or t.shape != layers[0].shape for t in layers):
        raise ValueError(f"{owner}: router_logits must be one (tokens, num_experts) tensor or a "
                         f"sequence of equal-shaped ones, got {[tuple(t.shape) for t in layers]}")
    X = layers[0].size(-1)
    if num_experts is not None and X != num_experts:
        raise ValueError(f"{owner}: router_logits have {X} experts, num_experts is {num_experts}")
    if not 1 <= top_k <= X:
        raise ValueError(f"{owner}: top_k ({top_k}) must be between 1 and num_experts ({X})")
    keep = _flat_mask(owner, padding_mask, layers[0].size(0))
    if keep is not None:
        keep = keep.to(layers[0].device).repeat(len(layers))
    return torch.cat(layers, dim=0), keep


def expert_counts(router_logits: Tensor | Sequence[Tensor], top_k: int,
                  padding_mask: Tensor | None = None) -> Tensor:
    """Tokens routed to each expert: (X,) int64, each token counted once per top-k choice.

    ``router_logits``: (N, X) from :class:`SparseMoE` (or a sequence of them, one per layer,
    summed); ``padding_mask``: (B, T) or (N,) bool, True = real token; padding is not counted.
    """
    logits, keep = _as_rows("expert_counts", router_logits, padding_mask, None, top_k)
    _, _, top_i = _route(logits, top_k)
    if keep is not None:
        top_i = top_i[keep]
    return torch.bincount(top_i.reshape(-1), minlength=logits.size(-1))


def load_balancing_loss(router_logits: Tensor | Sequence[Tensor], num_experts: int, top_k: int,
                        padding_mask: Tensor | None = None) -> Tensor:
    r"""Switch/Mixtral auxiliary loss: L = X * sum_e f_e * P_e.

    f_e = share of the N*k top-k assignments that go to expert e (sums to 1 over experts, so
    perfectly uniform routing gives L = 1 for any k), P_e = mean router probability of expert
    e over tokens (Fedus et al. 2021, eqs. 4-6). Padding tokens are excluded from both.
    Hugging Face's ``load_balancing_loss_func`` does not divide f by k; its value is k * L.

    ``router_logits``: (N, X), or a sequence of them (one per MoE layer, pooled);
    ``padding_mask``: (B, T) or (N,) bool, True = real token. Returns a scalar fp32 tensor.
    """
    logits, keep = _as_rows("load_balancing_loss", router_logits, padding_mask, num_experts, top_k)
    probs, _, top_i = _route(logits, top_k)                              # (R, X), (R, k)
    chosen = torch.zeros_like(probs).scatter_(1, top_i, 1.0)             # (R, X) one-hot of top-k
    if keep is not None:
        w = keep.to(probs.dtype)[:, None]
        chosen, probs = chosen * w, probs * w
        tokens = w.sum().clamp(min=1.0)
    else:
        tokens = torch.tensor(float(probs.size(0)), device=probs.device).clamp(min=1.0)
    f = chosen.sum(0) / (tokens * top_k)
    P = probs.sum(0) / tokens
    return num_experts * torch.sum(f * P)
