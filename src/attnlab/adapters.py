"""LoRA adapters on any registered model: choose layers, freeze the rest, save and load PEFT's layout, merge.

    add_lora(model, ["q", "v"], rank=8, alpha=16)     # adapters on the q and v projections; all else frozen
    save_adapter(model, "adapter/")                   # adapter_config.json + adapter_model.safetensors
    load_adapter(model, "adapter/")                   # an adapter PEFT (or attnlab) saved, onto the base model
    merge_lora(model)                                 # W + (alpha / r) B A; plain nn.Linear layers again

Names. A layer is named as the model's Hugging Face checkpoint names its weight, through the
family's registered weight map (our ``layers.0.self_attn.q_proj.weight`` is LlamaForCausalLM's
``model.layers.0.self_attn.q_proj.weight``; GPT-2's fused ``qkv_proj`` is ``transformer.h.0.attn.c_attn``),
so PEFT's ``target_modules`` select the same layers here as in PEFT: a target matches a layer whose
name is the target or ends with ``.`` + target. The short targets q, k, v, o, gate, up, down stand
for q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj where, read as PEFT reads them,
they select nothing (Mixtral's router is called ``gate``: there ``gate`` is the router, as in PEFT). A layer whose weight the map
fuses with or splits from others has no PEFT name and gets no adapter; an attnlab-native family
(no Hugging Face map) is named by our own module names.

PEFT's files: ``adapter_config.json`` (peft_type LORA, r, lora_alpha, lora_dropout, target_modules,
...) and ``adapter_model.safetensors`` with ``base_model.model.<layer name>.lora_A.weight`` (r, in)
and ``.lora_B.weight`` (out, r). A layer stored with RoPE's interleaved rows (Meta's layout) has
B's rows permuted as its weight's are; GPT-2's Conv1D keeps A and B as a Linear would (PEFT's
fan_in_fan_out transposes only the base weight).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from .models.convert import IDENTITY, TRANSPOSE, PermuteRope
from .models.registry import architecture_of
from .nn.lora import LoRALinear

__all__ = ["SHORT_TARGETS", "AdapterLayer", "adaptable_layers", "resolve_targets", "add_lora", "lora_layers",
           "lora_state_dict", "save_adapter", "load_adapter", "merge_lora", "lora_summary", "ADAPTER_CONFIG",
           "ADAPTER_WEIGHTS"]

SHORT_TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
                 "down": "down_proj"}
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_FIELD = re.compile(r"\{(\w+)\}")


@dataclass(frozen=True)
class AdapterLayer:
    """A Linear layer that can take an adapter: our module name, its checkpoint name, whether B's
    rows go through the weight map's RoPE permutation on the way to the checkpoint."""
    ours: str
    name: str
    op: object = IDENTITY


def _match(template: str, key: str) -> dict | None:
    parts = _FIELD.split(template)
    body = "".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>[^.]+)" for i, p in enumerate(parts))
    m = re.fullmatch(body, key)
    return None if m is None else m.groupdict()


def _checkpoint_name(rules, config, key: str) -> tuple[str, object] | None:
    """(the checkpoint key, the rule's op) of our tensor ``key`` where one rule maps it alone and
    by an op LoRA can follow; None otherwise (fused, split or stacked tensors)."""
    for rule in rules:
        if rule.when is not None and not rule.when(config):
            continue
        if len(rule.ours) != 1 or len(rule.theirs) != 1:
            if any(_match(t, key) is not None for t in rule.ours):
                return None
            continue
        fields = _match(rule.ours[0], key)
        if fields is None:
            continue
        if rule.stack is not None or not (rule.op in (IDENTITY, TRANSPOSE) or isinstance(rule.op, PermuteRope)):
            return None
        return rule.theirs[0].format(**fields), rule.op
    return None


def adaptable_layers(model: nn.Module) -> list[AdapterLayer]:
    """Every Linear layer of ``model`` that can take an adapter, with its checkpoint name (see the
    module docstring). Layers whose weight is tied to another tensor are left out: merging into a
    tied head would change the embedding too."""
    rules = architecture_of(model).weight_map
    every = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    shared = every - {n for n, _ in model.named_parameters()}
    tied_ids = {id(p) for n, p in model.named_parameters(remove_duplicate=False) if n in shared}
    found = []
    for ours, module in model.named_modules():
        if not isinstance(module, nn.Linear) or not ours or id(module.weight) in tied_ids:
            continue
        if rules is None:
            found.append(AdapterLayer(ours, ours))
            continue
        hit = _checkpoint_name(rules, model.config, f"{ours}.weight")
        if hit is not None and hit[0].endswith(".weight"):
            found.append(AdapterLayer(ours, hit[0].removesuffix(".weight"),
                                      hit[1] if isinstance(hit[1], PermuteRope) else IDENTITY))
    return found


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def resolve_targets(model: nn.Module, targets) -> tuple[list[AdapterLayer], list[str] | str]:
    """(the layers ``targets`` select, the targets in PEFT's terms). ``targets``: names as PEFT's
    list (short names allowed, see the module docstring), or one string: a regular expression the
    whole layer name must match (PEFT's meaning of a string). ValueError naming a target that
    selects nothing, with the layer names there are."""
    layers = adaptable_layers(model)
    if isinstance(targets, str):
        chosen = [a for a in layers if re.fullmatch(targets, a.name)]
        if not chosen:
            raise ValueError(f"LoRA: target pattern {targets!r} matches no layer of {type(model).__name__}")
        return chosen, targets
    if not targets:
        raise ValueError("LoRA: no target layers given")

    def select(t: str) -> list[AdapterLayer]:
        return [a for a in layers if a.name == t or a.name.endswith("." + t)]

    chosen, wanted = [], []
    for given in targets:
        # as PEFT reads the name first (Mixtral's router is "gate"); the short form only where that selects nothing
        t = given if select(given) or given not in SHORT_TARGETS else SHORT_TARGETS[given]
        hits = select(t)
        wanted.append(t)
        if not hits:
            names = ", ".join(dict.fromkeys(_leaf(a.name) for a in layers))
            raise ValueError(f"LoRA: target {given!r} matches no Linear layer of {type(model).__name__}; its "
                             f"layers: {names}")
        chosen += [a for a in hits if a not in chosen]
    order = {a.ours: i for i, a in enumerate(layers)}
    return sorted(chosen, key=lambda a: order[a.ours]), list(dict.fromkeys(wanted))


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def add_lora(model: nn.Module, targets, rank: int, alpha: float, dropout: float = 0.0) -> nn.Module:
    """Put a :class:`~attnlab.nn.lora.LoRALinear` adapter on every layer ``targets`` selects
    (:func:`resolve_targets`) and freeze every other parameter; returns ``model``. The adapters'
    A are drawn from torch's global generator (seed it first for a reproducible start)."""
    if lora_layers(model):
        raise ValueError(f"LoRA: {type(model).__name__} already has adapters; merge or rebuild it first")
    chosen, _ = resolve_targets(model, targets)
    for p in model.parameters():
        p.requires_grad_(False)
    for a in chosen:
        _set_module(model, a.ours, LoRALinear.wrap(model.get_submodule(a.ours), rank, alpha, dropout))
    return model


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """Our module name -> each adapted layer of ``model``."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def lora_summary(model: nn.Module) -> dict:
    """The adapters' settings (r, lora_alpha, lora_dropout, target_modules as PEFT names them) and sizes."""
    layers = lora_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no LoRA adapters")
    settings = {(m.rank, m.alpha, m.dropout) for m in layers.values()}
    if len(settings) != 1:
        raise ValueError(f"LoRA: the adapters of {type(model).__name__} differ in rank, alpha or dropout; PEFT's "
                         "layout holds one setting")
    (r, alpha, dropout), = settings
    names = {a.ours: a.name for a in adaptable_layers(model)}
    targets = sorted({_leaf(names.get(n, n)) for n in layers})
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return {"r": r, "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": targets, "layers": len(layers),
            "trainable": trainable, "total": total}


def lora_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The adapters' tensors in PEFT's checkpoint names (``base_model.model.<layer>.lora_A.weight``)."""
    names = {a.ours: a for a in adaptable_layers(model)}
    out = {}
    for ours, m in lora_layers(model).items():
        a = names.get(ours, AdapterLayer(ours, ours))
        b = m.lora_B.weight.detach()
        if isinstance(a.op, PermuteRope):
            (b,) = a.op.to_hf([b], model.config)
        out[f"{_PEFT_PREFIX}{a.name}.lora_A.weight"] = m.lora_A.weight.detach().contiguous()
        out[f"{_PEFT_PREFIX}{a.name}.lora_B.weight"] = b.contiguous()
    return out


def save_adapter(model: nn.Module, directory, base_model: str | None = None) -> Path:
    """Write ``model``'s adapters as PEFT does (adapter_config.json, adapter_model.safetensors)."""
    from safetensors.torch import save_file
    s = lora_summary(model)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": s["r"], "lora_alpha": s["lora_alpha"],
              "lora_dropout": s["lora_dropout"], "target_modules": s["target_modules"], "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
              "modules_to_save": None, "inference_mode": True, "base_model_name_or_path": base_model,
              "rank_pattern": {}, "alpha_pattern": {}}
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    save_file(lora_state_dict(model), str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return out


def _read_adapter_config(path: Path) -> dict:
    file = path / ADAPTER_CONFIG
    if not file.is_file():
        raise ValueError(f"{path}: no {ADAPTER_CONFIG}; not a LoRA adapter directory")
    try:
        c = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e.msg}, line {e.lineno})") from None
    if c.get("peft_type") != "LORA":
        raise ValueError(f"{file}: peft_type {c.get('peft_type')!r}; only LORA adapters are supported")
    unsupported = [k for k in ("use_rslora", "use_dora") if c.get(k)] + \
        [k for k in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform") if c.get(k)]
    if c.get("bias", "none") != "none":
        unsupported.append(f"bias={c['bias']!r}")
    if unsupported:
        raise ValueError(f"{file}: {', '.join(unsupported)} not supported (plain LoRA only)")
    return c


def load_adapter(model: nn.Module, directory) -> nn.Module:
    """Put the adapters saved in ``directory`` (by PEFT or :func:`save_adapter`) on ``model``, the
    base model they were trained on; strict: every adapted layer needs its A and B, and a tensor
    with no layer is an error."""
    from safetensors.torch import load_file
    path = Path(directory)
    c = _read_adapter_config(path)
    weights = path / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise ValueError(f"{path}: no {ADAPTER_WEIGHTS}")
    add_lora(model, c["target_modules"], int(c["r"]), float(c["lora_alpha"]), float(c.get("lora_dropout") or 0.0))
    tensors = load_file(str(weights))
    by_name = {a.name: a for a in adaptable_layers(model)}
    layers = lora_layers(model)
    seen = set()
    with torch.no_grad():
        for key, t in tensors.items():
            m = re.fullmatch(re.escape(_PEFT_PREFIX) + r"(.+)\.(lora_[AB])(?:\.[^.]+)?\.weight", key)
            a = by_name.get(m.group(1)) if m else None
            if a is None or a.ours not in layers:
                raise ValueError(f"{weights}: tensor {key} belongs to no adapted layer of {type(model).__name__}")
            part = m.group(2)
            if part == "lora_B" and isinstance(a.op, PermuteRope):
                (t,) = a.op.from_hf([t], model.config)
            target = getattr(layers[a.ours], part).weight
            if target.shape != t.shape:
                raise ValueError(f"{weights}: {key} has shape {tuple(t.shape)}, the layer's {part} "
                                 f"{tuple(target.shape)}")
            target.copy_(t)
            seen.add((a.ours, part))
    absent = [f"{n}.{p}" for n in layers for p in ("lora_A", "lora_B") if (n, p) not in seen]
    if absent:
        raise ValueError(f"{weights}: no tensors for {', '.join(absent[:4])}{' ...' if len(absent) > 4 else ''}")
    return model


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its layer's weight (W + (alpha / r) B A) and put plain ``nn.Linear``
    layers back; every parameter trainable again. Returns ``model``."""
    for name, m in lora_layers(model).items():
        _set_module(model, name, m.merge())
    for p in model.parameters():
        p.requires_grad_(True)
    return model
