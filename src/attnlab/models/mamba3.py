"""Mamba-3: a language model of Mamba-3 layers, no attention, no positions and no convolution
(Lahoti et al. 2026, "Mamba-3: Improved Sequence Modeling using State Space Principles").

    ids -> token embedding
        -> N x [x = x + Mixer(RMSNorm(x)); x = x + GatedMLP(RMSNorm(x)) if d_intermediate]
        -> final RMSNorm -> lm_head (tied to the embedding by default) -> logits

    Mixer(x):  z, u, B, C, Δ_raw, A_raw, λ_raw, φ = in_proj(x)    no convolution on u
               Δ = softplus(Δ_raw + dt_bias)   A = min(-softplus(A_raw), -A_floor)   λ = sigmoid(λ_raw)
               B, C = RMSNorm(B) + B_bias, RMSNorm(C) + C_bias     per head and rank
               θ_t = θ_{t-1} + π tanh(φ_t) Δ_t                       per head, on rope_fraction of n
               B_t, C_t = rotate(B_t, θ_t), rotate(C_t, θ_t)          the complex state, as rotations
               X = u (SISO) or u * mimo_x per rank (MIMO)
               Y = mamba3_scan(C, B, X, A Δ, λ Δ, (1 - λ) Δ) + D X    (attnlab.nn.mamba3_scan)
               out_proj(sum_r Y_r * SiLU(z * mimo_z_r) * mimo_o_r)     (SISO: Y * SiLU(z))

The three changes from Mamba-2 are switchable in the config: ``trapezoidal`` (False: λ = 1,
Mamba-2's step), ``rope_fraction`` (0: a real state, no rotations; 0.5 or 1.0: that fraction of
the state dimension rotates in pairs (0, 1), (2, 3), ...) and ``is_mimo`` with ``mimo_rank``.
A rotation by the accumulated θ of both B_s and C_t makes C_t·B_s depend on θ_t - θ_s: the
state of a complex diagonal SSM, exp(i θ) per pair, realised with real numbers (section 3.2).

The mixer's parameters have the names, shapes and in_proj layout of the authors' ``Mamba3``
module (mamba_ssm/modules/mamba3.py, with trapezoidal on and rotations on): in_proj's rows in the
order z, x, B, C, Δ, A, λ, angles, B and C as (rank, groups, n). Their MIMO kernels pair entry i
with i + n/2 rather than i + 1, which is the same model with B's and C's rows permuted.

Decoding keeps per layer the angle θ (b, h, angles), the state (b, h, p, n) fp32 and the last
position's B and X (the trapezoid's previous end), in an :class:`attnlab.nn.cache.RecurrentState`:
constant memory per token. At a slot whose ``attention_mask`` is False all four carry over.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.checkpoint import checkpoint
from ..nn.mamba3_scan import empty_state, mamba3_blocks, mamba3_scan, mamba3_step, rotate_pairs
from ..nn.mlp import GatedMLP
from ..nn.norm import RMSNorm
from ..nn.record import MixerCall, ReportsMixing
from .recurrent import RecurrentLM
from .registry import FamilyOption, register_family

__all__ = ["Mamba3Config", "Mamba3Mixer", "Mamba3", "MAMBA3"]

STATE_TENSORS = 4            # per layer: angle, state, previous B, previous X


@dataclass
class Mamba3Config:
    vocab_size: int = 50280
    d_model: int = 768
    num_layers: int = 24
    d_state: int = 128
    expand: int = 2
    headdim: int = 64
    ngroups: int = 1
    rope_fraction: float = 0.5            # 0 (no rotations), 0.5 or 1.0
    trapezoidal: bool = True
    is_mimo: bool = False
    mimo_rank: int = 4
    dt_min: float = 1e-3
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    A_floor: float = 1e-4
    chunk_size: int = 64                  # the authors suggest 64 / mimo_rank for MIMO
    d_intermediate: int = 0               # the gated MLP's width after each mixer; 0: none
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "num_layers", "d_state", "expand", "headdim", "ngroups", "mimo_rank",
                     "chunk_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Mamba3Config: {name} must be positive, got {getattr(self, name)}")
        if self.d_intermediate < 0:
            raise ValueError(f"Mamba3Config: d_intermediate must be 0 (no MLP) or positive, got {self.d_intermediate}")
        if self.rope_fraction not in (0, 0.5, 1.0):
            raise ValueError(f"Mamba3Config: rope_fraction must be 0 (no rotations), 0.5 or 1.0, got "
                             f"{self.rope_fraction}")
        if self.rope_fraction and self.num_rope_angles == 0:
            raise ValueError(f"Mamba3Config: d_state {self.d_state} is too small to rotate {self.rope_fraction} of it "
                             f"in pairs; use a larger d_state or rope_fraction 0")
        if self.d_inner % self.headdim:
            raise ValueError(f"Mamba3Config: expand * d_model = {self.d_inner} is not a multiple of headdim "
                             f"{self.headdim}")
        if self.nheads % self.ngroups:
            raise ValueError(f"Mamba3Config: the {self.nheads} heads do not split into ngroups {self.ngroups}")

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @property
    def nheads(self) -> int:
        return self.d_inner // self.headdim

    @property
    def rank(self) -> int:
        return self.mimo_rank if self.is_mimo else 1

    @property
    def num_rope_angles(self) -> int:
        """Angles per head: one per rotated pair of the state dimension."""
        return int(self.d_state * self.rope_fraction) // 2


class Mamba3Mixer(ReportsMixing, nn.Module):
    """One Mamba-3 layer (the module docstring's Mixer): (b, l, E) -> (b, l, E).

    ``forward(x, real=None, state=None) -> (out, (θ (b, h, angles), s (b, h, p, n), B_prev (b, r,
    h, n), X_prev (b, r, h, p)), all fp32)``. ``real`` (b, l) marks real tokens: Δ and the input are
    0 at the others, which leaves the state as it was when they all precede a row's real tokens
    from an empty state; one position at a time (l == 1) the state carries over exactly."""

    def __init__(self, c: Mamba3Config):
        super().__init__()
        self.c = c
        H, R, N, P = c.nheads, c.rank, c.d_state, c.headdim
        bc = R * c.ngroups * N
        self.widths = [c.d_inner, c.d_inner, bc, bc, H, H, H if c.trapezoidal else 0, c.num_rope_angles]
        self.in_proj = nn.Linear(c.d_model, sum(self.widths), bias=False)
        self.dt_bias = nn.Parameter(torch.empty(H))
        self.B_bias = nn.Parameter(torch.ones(H, R, N))
        self.C_bias = nn.Parameter(torch.ones(H, R, N))
        self.B_norm = RMSNorm(N, eps=1e-5)
        self.C_norm = RMSNorm(N, eps=1e-5)
        if c.is_mimo:
            self.mimo_x = nn.Parameter(torch.full((H, R, P), 1.0 / R))
            self.mimo_z = nn.Parameter(torch.ones(H, R, P))
            self.mimo_o = nn.Parameter(torch.full((H, R, P), 1.0 / R))
        self.D = nn.Parameter(torch.ones(H))
        self.out_proj = nn.Linear(c.d_inner, c.d_model, bias=False)
        self.reset_ssm()

    def no_weight_decay(self) -> tuple[str, ...]:
        """The step's bias and the skip set the dynamics: decay would pull the steps towards
        softplus(0) and the skip towards 0, values that are not neutral for them. B's and C's
        (h, r, n) biases decay like the projections they extend, as the authors train them."""
        return ("dt_bias", "D")

    def reset_ssm(self) -> None:
        """The authors' initialisation: dt_bias the inverse softplus of steps log-uniform in
        [dt_min, dt_max] (at least dt_init_floor), B and C biases 1, D 1, MIMO projections 1 / r, 1, 1 / r."""
        c, H, R = self.c, self.c.nheads, self.c.rank
        with torch.no_grad():
            dt = torch.exp(torch.rand(H) * (math.log(c.dt_max) - math.log(c.dt_min)) + math.log(c.dt_min))
            dt = dt.clamp(min=c.dt_init_floor)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            for p in (self.B_bias, self.C_bias, self.D):
                p.fill_(1.0)
            if c.is_mimo:
                self.mimo_x.fill_(1.0 / R)
                self.mimo_z.fill_(1.0)
                self.mimo_o.fill_(1.0 / R)

    def _inputs(self, x: Tensor, real: Tensor | None, theta0: Tensor | None):
        """The scan's inputs (C, B, X, a, gamma, beta) and the gate, with the angles θ (b, l, h, k)."""
        c, (b, l, _) = self.c, x.shape
        H, R, G, N, P = c.nheads, c.rank, c.ngroups, c.d_state, c.headdim
        z, u, B, C, dt, A, lam, phi = self.in_proj(x).split(self.widths, dim=-1)
        dt = F.softplus((dt + self.dt_bias).float())
        if real is not None:
            keep = real[..., None].float()
            dt, u = dt * keep, u * keep.to(u.dtype)
        A = (-F.softplus(A.float())).clamp(max=-c.A_floor)
        lam = torch.sigmoid(lam.float()) if c.trapezoidal else torch.ones_like(dt)
        # groups serve heads in blocks: heads [g * H / G, (g + 1) * H / G) read group g (the bias's
        # broadcast makes the copy per head)
        B, C = ((norm(t.view(b, l, R, G, 1, N)) + bias.transpose(0, 1).reshape(R, G, H // G, N)).flatten(3, 4)
                for norm, t, bias in ((self.B_norm, B, self.B_bias), (self.C_norm, C, self.C_bias)))
        step = math.pi * torch.tanh(phi.float())[:, :, None, :] * dt[..., None]       # (b, l, h, k)
        theta = step.cumsum(1) if theta0 is None else theta0[:, None] + step.cumsum(1)
        theta = theta - 2 * math.pi * torch.floor(theta / (2 * math.pi))
        B, C = rotate_pairs(B.float(), theta[:, :, None]), rotate_pairs(C.float(), theta[:, :, None])
        X = u.view(b, l, 1, H, P)
        if c.is_mimo:
            X = X * self.mimo_x.transpose(0, 1)
        return (C, B, X, A * dt, lam * dt, (1 - lam) * dt), z.view(b, l, 1, H, P), theta

    def forward(self, x: Tensor, real: Tensor | None = None, state=None):
        c, (b, l, _) = self.c, x.shape
        (C, B, X, a, gamma, beta), z, theta = self._inputs(x, real, None if state is None else state[0])
        if l == 1 and state is not None:
            Y, inner = mamba3_step(state[1:], C[:, 0], B[:, 0], X[:, 0], a[:, 0], gamma[:, 0], beta[:, 0])
            Y = Y[:, None]
            new = (theta[:, 0], *inner)
            if real is not None:                  # a hole: every part of the state carries over
                new = tuple(torch.where(real.view(b, *[1] * (n.dim() - 1)), n, o) for n, o in zip(new, state))
        else:
            inner = None if state is None else state[1:]
            Y, inner = mamba3_scan(C, B, X, a, gamma, beta, inner, chunk=c.chunk_size)
            new = (theta[:, -1], *inner)
            self.report(lambda: _scan_call((C, B, X, a, gamma, beta), Y, state is not None))
        Y = Y + self.D[:, None] * X
        if c.is_mimo:
            y = (Y * F.silu(z * self.mimo_z.transpose(0, 1)) * self.mimo_o.transpose(0, 1)).sum(2)
        else:
            y = Y[:, :, 0] * F.silu(z[:, :, 0])
        return self.out_proj(y.reshape(b, l, c.d_inner).to(x.dtype)), new

    def empty(self, b: int, like: Tensor) -> tuple[Tensor, ...]:
        c = self.c
        theta = torch.zeros(b, c.nheads, c.num_rope_angles, device=like.device)
        return (theta, *empty_state(b, c.rank, c.nheads, c.headdim, c.d_state, like))


def _scan_call(inputs: tuple, Y: Tensor, carried: bool) -> MixerCall:
    """What a recorder sees of one scan (attnlab.nn.record): its inputs (C, B, X, a, γ, β), its Y
    (before the D skip) and its map, ``mamba3_blocks`` (b, H, T, R, T, R): one R x R block per
    (t, s), so a MIMO scan (R > 1) has no single signed number per entry and draws the blocks'
    Frobenius norms, which bound how far an input of unit norm at s moves the outputs at t."""
    R = inputs[1].size(2)

    def blocks() -> Tensor:
        if carried:
            raise ValueError("implicit attention: the mamba3 scan ran from a carried state; record a whole "
                             "sequence from the start (no cache)")
        return mamba3_blocks(*inputs)

    def matrix() -> Tensor:
        if R != 1:
            raise ValueError(f"implicit attention: a MIMO Mamba-3 (rank {R}) maps its inputs to its outputs by an "
                             f"{R}x{R} block per (t, s), not one number; use call_blocks, or call_magnitude "
                             f"for the blocks' Frobenius norms")
        return blocks()[:, :, :, 0, :, 0]

    what = f"‖rank {R}×{R} block‖_F" if R > 1 else "|C·B × decay × step|"
    return MixerCall("mamba3", inputs, Y, matrix=matrix, blocks=blocks, title=f"implicit attention {what}",
                     magnitude=lambda: torch.linalg.matrix_norm(blocks().transpose(3, 4)))


class Mamba3Layer(nn.Module):
    """x + Mixer(RMSNorm(x)), then x + GatedMLP(RMSNorm(x)) when the config has an MLP."""

    def __init__(self, c: Mamba3Config):
        super().__init__()
        self.norm = RMSNorm(c.d_model, c.rms_norm_eps)
        self.mixer = Mamba3Mixer(c)
        if c.d_intermediate:
            self.mlp_norm = RMSNorm(c.d_model, c.rms_norm_eps)
            self.mlp = GatedMLP(c.d_model, c.d_intermediate)

    def forward(self, x: Tensor, real: Tensor | None = None, state=None):
        out, state = self.mixer(self.norm(x), real, state)
        x = x + out
        if hasattr(self, "mlp"):
            x = x + self.mlp(self.mlp_norm(x))
        return x, state


class Mamba3(RecurrentLM):
    """Mamba-3 language model. ``forward(input_ids (b, l), attention_mask=None (b, cached + l),
    positions=None, cache=None) -> logits (b, l, V)``; ``positions`` are accepted and unused (the
    order lives in the recurrence and its rotations)."""

    init_std = 0.02
    state_per_layer = STATE_TENSORS

    def __init__(self, config: Mamba3Config):
        super().__init__()
        self.config, c = config, config
        self.gradient_checkpointing = False
        self.token_embedding = nn.Embedding(c.vocab_size, c.d_model)
        self.layers = nn.ModuleList(Mamba3Layer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.d_model, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.reset_parameters()
        if c.tie_word_embeddings:
            self.lm_head.weight = self.token_embedding.weight

    def reset_parameters(self) -> None:
        """Matrices N(0, 0.02) (a small embedding keeps the tied logits small); the projections
        writing into the residual stream scaled by 1 / sqrt(the number of them), as every layer adds
        to one stream; the SSM's own parameters as the authors (:meth:`Mamba3Mixer.reset_ssm`)."""
        writers = [m for layer in self.layers for m in (layer.mixer.out_proj, getattr(layer, "mlp", None)) if m]
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, self.init_std)
        for m in writers:
            w = m.weight if isinstance(m, nn.Linear) else m.down_proj.weight
            nn.init.normal_(w, 0.0, self.init_std / math.sqrt(len(writers)))
        for layer in self.layers:
            layer.mixer.reset_ssm()

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.token_embedding(input_ids)

    def run_layers(self, x: Tensor, real: Tensor | None, states: list) -> tuple[Tensor, list]:
        new = []
        for layer, state in zip(self.layers, states):
            if state is None and x.size(1) == 1 and not self.training:
                state = layer.mixer.empty(x.size(0), x)      # one position steps from an empty state
            x, state = checkpoint(layer, x, real, None) if self.checkpointing(state) else layer(x, real, state)
            new.append(state)
        return x, new


# ----------------------------------------------------------------------------- registration
def build_config(*, vocab_size: int, context: int, d_model: int, num_heads: int, num_layers: int,
                 d_ff: int | None = None, dropout: float = 0.0, d_state: int = 32, expand: int = 2,
                 headdim: int = 16, rope_fraction: float = 0.5, trapezoidal: bool = True, mimo_rank: int = 0,
                 bos_token_id: int | None = None, eos_token_id: int | None = None) -> Mamba3Config:
    """A Mamba-3 sized for training. ``d_ff`` adds the gated MLP after each mixer (none by default);
    ``mimo_rank`` > 0 makes it MIMO of that rank. It has no dropout and no limit on the length:
    ``num_heads`` and ``context`` do not shape it (its heads are expand * d_model / headdim)."""
    if dropout:
        raise ValueError("mamba3: a Mamba-3 has no dropout; leave dropout unset")
    return Mamba3Config(vocab_size=vocab_size, d_model=d_model, num_layers=num_layers, d_state=d_state,
                        expand=expand, headdim=headdim, rope_fraction=rope_fraction, trapezoidal=trapezoidal,
                        is_mimo=mimo_rank > 0, mimo_rank=mimo_rank or 4, d_intermediate=d_ff or 0,
                        chunk_size=max(1, 64 // max(mimo_rank, 1)), bos_token_id=bos_token_id,
                        eos_token_id=eos_token_id)


def _positive(v) -> str | None:
    return None if v > 0 else "must be positive"


def _fraction(v) -> str | None:
    return None if v in (0, 0.5, 1.0) else "must be 0, 0.5 or 1"


def _rank(v) -> str | None:
    return None if v >= 0 else "must be 0 (SISO) or positive"


PRESETS = {
    "tiny": dict(vocab_size=96, d_model=32, num_layers=2, d_state=8, expand=2, headdim=16, chunk_size=8),
    "tiny-mimo": dict(vocab_size=96, d_model=32, num_layers=2, d_state=8, expand=2, headdim=16, is_mimo=True,
                      mimo_rank=2, chunk_size=4, d_intermediate=48),
}
_OPTIONS = (
    FamilyOption("d_state", int, "state size per head (N)", ("lm",), check=_positive),
    FamilyOption("expand", int, "inner width as a multiple of d_model", ("lm",), check=_positive),
    FamilyOption("headdim", int, "channels per head (P)", ("lm",), check=_positive),
    FamilyOption("rope_fraction", float, "share of the state rotated by data-dependent angles: 0, 0.5 or 1",
                 ("lm",), check=_fraction),
    FamilyOption("trapezoidal", bool, "the exponential-trapezoidal step (--no-trapezoidal: Mamba-2's)", ("lm",)),
    FamilyOption("mimo_rank", int, "MIMO rank (0: SISO)", ("lm",), check=_rank),
)
MAMBA3 = register_family("mamba3", Mamba3Config, presets=PRESETS, build_config=build_config, options=_OPTIONS,
                         limits=lambda c: {"vocab_size": c.vocab_size, "context": None},
                         token_ids={"bos_token_id": "bos", "eos_token_id": "eos"})
MAMBA3.register("Mamba3ForCausalLM", Mamba3, kind="causal-lm")
