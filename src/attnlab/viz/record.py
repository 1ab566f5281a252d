"""Record every attention call of a model while it runs: one entry per call, naming its layer.

    with record_attention(model) as rec:
        logits = model(ids)
    rec[0]                      # AttentionCall: module, part, layer, role, step, weights (B, H, T, S),
                                #                query_positions (T,), key_positions (S,), mask
    rec.select(layer=2)         # every call of layer 2
    rec.stack("self")           # (L, B, H, T, S): every self-attention layer, in layer order
    rec.weights(0, "cross")     # (B, H, T, S): layer 0's cross-attention, cached steps joined

Works for any model built from :class:`attnlab.nn.MultiHeadAttention`, whatever attention
kernel runs. The weights are those of ``scaled_dot_product_attention(..., return_weights=True)``:
softmax over the keys after masks and position biases, before dropout, zero rows for queries
with no allowed key. The weights are computed beside the layer's usual path, fused kernel or
not, so the model's outputs stay bit for bit as without recording, with one exception: a
classifier whose head reads the first position alone (BERT-like, ViT) normally runs its last
layer for that query only, and while recorded runs it for every query (the record wants every
row). Its outputs then equal bit for bit the same model's with that shortcut off, and differ
from the shortcut's by the rounding of a one-row against a many-row matrix product: at most
8 fp32 epsilons (8 x 1.19e-7) of the largest |output| (tests/test_explorer_record.py asserts
it for every such family; measured on random weights: 2.3). Outside the context nothing is
recorded: each attention module holds a listener only while the context is open, and checks
for it with one attribute test otherwise.

A layer is a pass through the model's layer stack, not a module: ALBERT runs one shared layer
N times and is recorded as N layers, as transformers reports it. The layer of a call comes from
the order an encoder's ``stack()`` runs its layers (that is where weights are shared), and
otherwise from the layer's index in its ``ModuleList`` ("decoder_layers.1.cross_attn" is
layer 1 of part "decoder_layers").
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..models.encoder import Encoder
from ..nn.attention import MultiHeadAttention
from ..nn.record import MixerCall, ReportsMixing

__all__ = ["AttentionCall", "AttentionRecord", "record_attention", "MixerEntry", "record_mixers"]

ROLES = ("self", "cross")


@dataclass(frozen=True, eq=False)
class AttentionCall:
    """One call of one attention module.

    module: its qualified name ("groups.0.0.self_attn"); part: the layer stack it belongs to
    ("encoder_layers", "decoder_layers", "layers"; "" for a lone layer); layer: the pass through
    that stack, from 0; role: "self" or "cross" (a module named ``cross...`` attends another
    sequence); step: how many times this layer had run before inside the context (one step per
    token of a cached decoding loop). weights: (B, H, T, S), detached. query_positions (T,) and
    key_positions (S,): each query's and key's index in its own sequence, cached tokens counted
    (what a labeller turns into tokens or patches). mask: boolean, broadcastable to (B, H, T, S),
    True where the query was allowed to attend the key (padding, causality and any given mask).
    """
    module: str
    part: str
    layer: int
    role: str
    step: int
    weights: Tensor
    query_positions: Tensor
    key_positions: Tensor
    mask: Tensor

    def __repr__(self) -> str:
        return (f"AttentionCall({self.module!r}, part={self.part!r}, layer={self.layer}, role={self.role!r}, "
                f"step={self.step}, weights={tuple(self.weights.shape)}, "
                f"queries={int(self.query_positions[0])}..{int(self.query_positions[-1])}, "
                f"keys=0..{self.key_positions.numel() - 1})")


class AttentionRecord(Sequence):
    """The calls of one :func:`record_attention` context, in the order they ran.

    ``modules`` names every attention module of the model (in model order), run or not.
    """

    def __init__(self, modules: list[str]):
        self.modules = modules
        self.calls: list[AttentionCall] = []

    def __getitem__(self, i):
        return self.calls[i]

    def __len__(self) -> int:
        return len(self.calls)

    def select(self, *, module: str | None = None, part: str | None = None, layer: int | None = None,
               role: str | None = None) -> list[AttentionCall]:
        """The calls matching every given field, in call order."""
        if role is not None:
            _check_role(role)
        return [c for c in self.calls if (module is None or c.module == module) and (part is None or c.part == part)
                and (layer is None or c.layer == layer) and (role is None or c.role == role)]

    def parts(self, role: str | None = None) -> list[str]:
        """The layer stacks that ran (with ``role``: an attention of that role), first run first."""
        return list(dict.fromkeys(c.part for c in self.select(role=role)))

    def layers(self, role: str = "self", *, part: str | None = None) -> list[int]:
        """The layer indices that ran an attention of ``role`` in ``part`` (see :meth:`stack`)."""
        part = self._part(role, part)
        return sorted({c.layer for c in self.select(part=part, role=role)})

    def weights(self, layer: int | str, role: str = "self", *, part: str | None = None) -> Tensor:
        """One layer's (B, H, T, S) weights: its calls joined along the queries.

        ``layer``: a layer index (of the one part that ran ``role``, or of ``part``), or a
        module's qualified name (a module shared by several layers must be asked by layer).
        Cached decoding runs a layer once per step with few queries and a growing S; the steps
        are padded with zeros on the right up to the longest S (keys a step could not see yet),
        so the result equals the weights of one full forward over the same tokens.
        """
        if isinstance(layer, str):
            calls, what = self.select(module=layer), f"module {layer!r}"
            served = sorted({c.layer for c in calls})
            if len(served) > 1:
                raise ValueError(f"record_attention: {what} ran as layers {served} (shared weights): "
                                 f"ask for one of them by index")
        else:
            part = self._part(role, part)
            calls, what = self.select(part=part, layer=layer, role=role), f"layer {layer} of {part!r} ({role})"
        if not calls:
            raise ValueError(f"record_attention: {what} recorded nothing")
        return _join(calls, what)

    def stack(self, role: str = "self", *, part: str | None = None) -> Tensor:
        """(L, B, H, T, S): :meth:`weights` of every layer that ran an attention of ``role``
        ("self" or "cross") in ``part`` (needed only when several parts ran one: an
        encoder-decoder's self-attention), in layer order."""
        part = self._part(role, part)
        return torch.stack([self.weights(layer, role, part=part) for layer in self.layers(role, part=part)])

    def _part(self, role: str, part: str | None) -> str:
        parts = self.parts(role)
        if not parts:
            raise ValueError(f"record_attention: no {role}-attention was recorded "
                             f"(modules: {', '.join(self.modules)})")
        if part is None:
            if len(parts) > 1:
                raise ValueError(f"record_attention: {role}-attention ran in several parts ({', '.join(parts)}): "
                                 f"choose one with part=")
            return parts[0]
        if part not in parts:
            raise ValueError(f"record_attention: no {role}-attention ran in part {part!r} "
                             f"(parts: {', '.join(parts)})")
        return part


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"record_attention: role must be one of {', '.join(ROLES)}, got {role!r}")


def _join(calls: list[AttentionCall], what: str) -> Tensor:
    """The calls' weights along the queries, each padded on the right to the longest S; the
    calls must continue each other (a second forward of the same layer starts a new sequence)."""
    for prev, call in zip(calls, calls[1:]):
        if call.query_positions[0] != prev.query_positions[-1] + 1 or call.weights.shape[0] != prev.weights.shape[0]:
            raise ValueError(f"record_attention: {what} ran {len(calls)} times on separate sequences; "
                             f"take one call from select() instead")
    S = max(c.weights.size(-1) for c in calls)
    return torch.cat([nn.functional.pad(c.weights, (0, S - c.weights.size(-1))) for c in calls], dim=-2)


class _Listener:
    """What one attention module calls while recorded: turns its weights, query start and mask
    into an :class:`AttentionCall` with the module's part, layer and role. A module serving
    several layers (a shared layer) serves them in turn: its k-th call is layer slots[k % n]."""

    def __init__(self, record: AttentionRecord, module: str, part: str, slots: list[int], role: str):
        self.record, self.module, self.part, self.slots, self.role = record, module, part, slots, role
        self.count = 0
        self.last_end: dict[int, int] = {}          # layer -> index after its previous call's last query

    def __call__(self, weights: Tensor, query_start: int | None, mask: Tensor) -> None:
        layer, step = self.slots[self.count % len(self.slots)], self.count // len(self.slots)
        self.count += 1
        T, S = weights.shape[-2:]
        start = self._start(layer, T) if query_start is None else query_start
        self.last_end[layer] = start + T
        device = weights.device
        self.record.calls.append(AttentionCall(
            self.module, self.part, layer, self.role, step, weights,
            torch.arange(start, start + T, device=device), torch.arange(S, device=device), mask))

    def _start(self, layer: int, T: int) -> int:
        """Where the queries of a call that could not say sit: those of the same layer's previous
        attention of the same queries (a decoder layer's self-attention runs just before its
        cross-attention, and its cache counts them), else right after this layer's previous call."""
        for call in reversed(self.record.calls):
            if call.part == self.part and call.layer == layer:
                if call.module != self.module and call.weights.size(-2) == T:
                    return int(call.query_positions[0])
                break
        return self.last_end.get(layer, 0)


def _layout(model: nn.Module, modules: list[tuple[str, MultiHeadAttention]]) -> dict[str, tuple[str, list[int]]]:
    """Module name -> (part, the layers it serves in run order)."""
    names = {id(m): name for name, m in model.named_modules()}
    shared: dict[str, list[int]] = {}
    for _, enc in model.named_modules():
        if isinstance(enc, Encoder):
            for i, layer in enumerate(enc.stack()):
                for m in layer.modules():
                    if isinstance(m, MultiHeadAttention):
                        shared.setdefault(names[id(m)], []).append(i)
    layout = {}
    for name, _ in modules:
        parts = name.split(".")
        at = next((j for j, p in enumerate(parts) if p.isdigit()), None)
        part, index = ("", 0) if at is None else (".".join(parts[:at]), int(parts[at]))
        layout[name] = (part, shared.get(name, [index]))
    return layout


@contextmanager
def record_attention(model: nn.Module) -> Iterator[AttentionRecord]:
    """Collect one :class:`AttentionCall` per call of every :class:`MultiHeadAttention` in
    ``model`` during the forward passes inside the ``with`` block; yields the
    :class:`AttentionRecord`.

    Module names are those of ``model.named_modules()``. A KV-cached decoding loop records one
    call per layer and step. Recording costs one extra attention-weights computation per call
    (without autograd) where the fused kernel ran; a checkpointed layer's recomputation in the
    backward pass is not recorded again.
    """
    modules = [(name, m) for name, m in model.named_modules() if isinstance(m, MultiHeadAttention)]
    if not modules:
        raise ValueError(f"record_attention: {type(model).__name__} has no attnlab MultiHeadAttention")
    if any(m.attention_record is not None for _, m in modules):
        raise RuntimeError("record_attention: this model is already being recorded")
    record = AttentionRecord([name for name, _ in modules])
    layout = _layout(model, modules)
    try:
        for name, m in modules:
            part, slots = layout[name]
            role = "cross" if "cross" in name.rsplit(".", 1)[-1] else "self"
            m.attention_record = _Listener(record, name, part, slots, role)
        yield record
    finally:
        for _, m in modules:
            m.attention_record = None


@dataclass(frozen=True, eq=False)
class MixerEntry:
    """One call of one reporting mixer (attnlab.nn.record): its qualified ``module`` name, the
    ``part`` (layer stack) and ``layer`` index its name places it in, and what it reported."""
    module: str
    part: str
    layer: int
    call: MixerCall


class _Entries:
    """What one mixer's report calls while recorded: a :class:`MixerEntry` with the mixer's part
    and layer (a module serving several layers, a shared layer, serves them in turn)."""

    def __init__(self, entries: list, module: str, part: str, slots: list[int]):
        self.entries, self.module, self.part, self.slots, self.count = entries, module, part, slots, 0

    def __call__(self, call: MixerCall) -> None:
        layer = self.slots[self.count % len(self.slots)]
        self.count += 1
        self.entries.append(MixerEntry(self.module, self.part, layer, call))


class _AttentionReport:
    """An attention module's listener that reports its calls as :class:`MixerCall` s (kind
    "attention": the softmax weights, (B, H, T, S), as the attention record has them)."""

    def __init__(self, report):
        self.report = report

    def __call__(self, weights: Tensor, query_start: int | None, mask: Tensor) -> None:
        self.report(MixerCall("attention", (), None, matrix=lambda: weights, kind="attention",
                              title="self-attention"))


@contextmanager
def record_mixers(model: nn.Module) -> Iterator[list[MixerEntry]]:
    """Collect a :class:`MixerEntry` per call of every mixer of ``model``, in call order: those
    that report through attnlab.nn.record (windowed attention, the scans, a new mixer of a family of
    its own) and every :class:`MultiHeadAttention`, whose calls come as kind "attention" (for its
    query positions and cached steps, :func:`record_attention`). A mixer inside another reporting
    one is left to its owner. Outputs are unchanged."""
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, (ReportsMixing, MultiHeadAttention))]
    owners = [name for name, m in found if isinstance(m, ReportsMixing)]
    outer = [(name, m) for name, m in found if not any(name.startswith(o + ".") for o in owners if o != name)]
    if not outer:
        raise ValueError(f"record_mixers: {type(model).__name__} has no mixer that reports what it computed")
    if any((m.attention_record if isinstance(m, MultiHeadAttention) else m.mixing_record) is not None
           for _, m in outer):
        raise RuntimeError("record_mixers: this model is already being recorded")
    entries: list[MixerEntry] = []
    layout = _layout(model, outer)
    try:
        for name, m in outer:
            report = _Entries(entries, name, *layout[name])
            if isinstance(m, MultiHeadAttention):
                m.attention_record = _AttentionReport(report)
            else:
                m.mixing_record = report
        yield entries
    finally:
        for _, m in outer:
            if isinstance(m, MultiHeadAttention):
                m.attention_record = None
            else:
                m.mixing_record = None
