"""The model registry: families keyed by ``model_type``, architectures keyed by name.

A **family** is one kind of network with one config dataclass: GPT-2 ("gpt2"), LLaMA ("llama"),
the 2017 encoder-decoder ("transformer"). It owns the config translators to and from a
Hugging Face config.json, the weight rules of the base network (HF names relative to the base),
named presets, and a sizing builder that training tasks call. An **architecture** is one model
class built on the family: a bare base (GPT2Model) or the base with a head (GPT2LMHeadModel),
with its head's weight rules, where the base's keys sit in its checkpoints (``prefix``) and a
``kind`` saying what its forward does, so that tasks and commands dispatch on it::

    GPT2 = register_family("gpt2", GPTConfig, base_rules=..., config_from_hf=..., config_to_hf=...,
                           presets={"tiny": {...}}, build_config=build_config)
    GPT2.register("GPT2LMHeadModel", GPT, kind="causal-lm", prefix="transformer.", head_rules=[...])
    GPT2.register("GPT2Model", GPTModel, kind="base")

A task builds a model by model_type::

    fam = family("gpt2")
    model = fam.for_kind("causal-lm").build(fam.build_config(vocab_size=V, context=T, d_model=E,
                                                             num_heads=H, num_layers=N))

Model files register themselves when imported, and the ``attnlab.models`` package imports
every module in it, so a lookup (which can only run once that package is imported) sees them
all. A family without Hugging Face translators is attnlab-native: its directories hold
config.json with our own field names and our own state-dict keys.
"""
from __future__ import annotations

import inspect
import re
import warnings
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable

from torch import nn

from .convert import Rule, with_prefix
from .objective import Objective, classification, masked_lm, replaced_token

__all__ = ["KINDS", "Kind", "register_kind", "MODALITIES", "Modality", "MODEL_SIZES", "UNIFORM_SIZES", "input_limits",
           "Architecture", "Family", "FamilyOption", "TOKEN_ROLES", "register_family", "family", "families",
           "architecture_of", "architectures", "training_loss", "Objective", "default_family"]

# Input modalities: the main input a model of the modality takes (transformers' keyword name), the
# sizes a family's sizing builder takes for it (besides MODEL_SIZES) and the input limits a family
# states for its configs (:meth:`Family.input_limits`), and the processor that turns user data into
# that input (attnlab.processors: a tokenizer for text, an image processor for images).
@dataclass(frozen=True)
class Modality:
    name: str
    main_input: str
    sizes: tuple[str, ...]          # the builder's arguments for this modality
    limits: tuple[str, ...]         # what Family.input_limits(config) returns for this modality
    processor: str                  # the processor kind (attnlab.processors)


MODALITIES = {
    "text": Modality("text", "input_ids", ("vocab_size", "context"), ("vocab_size", "context"), "tokenizer"),
    "image": Modality("image", "pixel_values", ("image_size", "patch_size", "in_channels"),
                      ("image_size", "patch_size", "in_channels"), "image"),
    # images and texts side by side (a contrastive model): both processors, both sets of sizes
    "image-text": Modality("image-text", "pixel_values", ("image_size", "patch_size", "in_channels", "vocab_size",
                                                          "context"),
                           ("image_size", "patch_size", "in_channels", "vocab_size", "context"), "image+tokenizer"),
    # sound in, text out (speech recognition): log-mel frames (num_mel_bins bands, at most
    # ``frames`` of them per input) read by the encoder, a vocabulary and context for the decoder
    "audio": Modality("audio", "input_features", ("num_mel_bins", "frames", "vocab_size", "context"),
                      ("num_mel_bins", "frames", "vocab_size", "context"), "audio+tokenizer"),
}
# the model's own sizes, the same for every modality
MODEL_SIZES = ("d_model", "num_heads", "num_layers", "d_ff", "dropout")
# the arguments a text family's sizing builder takes (families add keyword options after them)
UNIFORM_SIZES = MODALITIES["text"].sizes + MODEL_SIZES


@dataclass(frozen=True)
class Kind:
    """What a model of one kind does, declared once: tasks, commands and the contract tests read it.

    ``example(config, limits, batch, length, seed)`` gives example inputs by transformers' keyword
    names, main input first, in the order ``forward`` takes them positionally (``limits``: the
    family's :meth:`Family.input_limits`); ``shapes(config, inputs)`` the output shape, or a tuple of
    shapes for a tuple of outputs. ``outputs``: the fields of a transformers output that equal ours,
    in order (an entry that is a tuple of names: whichever of them the output has, as families name
    the same output differently). ``command``: the attnlab command that uses such a model.
    ``objective(model, batch, forward) -> Objective``: its training loss (:mod:`.objective`),
    which a model class refines with a ``loss`` method of its own; None: the kind trains by no
    task's objective."""
    name: str
    modality: str
    does: str
    example: Callable[..., dict]
    shapes: Callable[..., tuple]
    outputs: tuple = ("logits",)
    command: str | None = None
    objective: Callable[..., Objective] | None = None

    @property
    def main_input(self) -> str:
        return MODALITIES[self.modality].main_input


KINDS: dict[str, Kind] = {}


def register_kind(name: str, *, modality: str, does: str, example: Callable[..., dict], shapes: Callable[..., tuple],
                  outputs: tuple = ("logits",), command: str | None = None,
                  objective: Callable[..., Objective] | None = None) -> Kind:
    """Declare a kind of model (see :class:`Kind`): a family of a new modality or with a new head
    adds its kinds here, from its own file, before registering architectures of them."""
    if modality not in MODALITIES:
        raise ValueError(f"register_kind({name!r}): unknown modality {modality!r}; modalities: {', '.join(MODALITIES)}")
    if name in KINDS:
        raise ValueError(f"register_kind: kind {name!r} is already registered")
    KINDS[name] = kind = Kind(name, modality, does, example, shapes, tuple(outputs), command, objective)
    return kind


def _ids(high: int, shape, seed: int):
    import torch
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def _randn(shape, seed: int):
    import torch
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _tokens(config, limits, B, T, seed):
    return {"input_ids": _ids(limits["vocab_size"], (B, T), seed)}


def _pixels(config, limits, B, T, seed):
    import torch
    size, channels = limits["image_size"], limits["in_channels"]
    return {"pixel_values": torch.randn(B, channels, size, size, generator=torch.Generator().manual_seed(seed))}


def _batch(inputs) -> int:
    return next(iter(inputs.values())).size(0)


def _length(inputs) -> int:
    return next(iter(inputs.values())).size(1)


register_kind("causal-lm", modality="text", command="attnlab generate", example=_tokens,
              does="forward(input_ids (B, T)) -> next-token logits (B, T, V); model.generate continues a prompt",
              shapes=lambda c, x: (_batch(x), _length(x), c.vocab_size))
register_kind("seq2seq", modality="text", command="attnlab translate",
              does="forward(src (B, S), tgt (B, T)) -> logits (B, T, V); encode / decode / new_cache for decoding",
              example=lambda c, lim, B, T, seed: {"input_ids": _ids(c.src_vocab_size, (B, T), seed),
                                                  "decoder_input_ids": _ids(c.tgt_vocab_size, (B, T - 3), seed + 1)},
              shapes=lambda c, x: (_batch(x), x["decoder_input_ids"].size(1), c.tgt_vocab_size))
register_kind("base", modality="text", command="attnlab embed", example=_tokens, outputs=("last_hidden_state",),
              does="forward(input_ids (B, T)) -> the last hidden state (B, T, E) (a bare model, no head)",
              shapes=lambda c, x: (_batch(x), _length(x), c.d_model))
register_kind("masked-lm", modality="text", example=_tokens, objective=masked_lm,
              does="forward(input_ids (B, T)) -> logits (B, T, V) for every position",
              shapes=lambda c, x: (_batch(x), _length(x), c.vocab_size))
register_kind("classifier", modality="text", command="attnlab classify", example=_tokens,
              objective=classification,
              does="forward(input_ids (B, T)) -> class logits (B, C)", shapes=lambda c, x: (_batch(x), c.num_labels))
register_kind("pretraining", modality="text", example=_tokens, objective=masked_lm,
              does="forward(input_ids (B, T)) -> (token logits (B, T, V), sentence logits (B, 2)): masked-LM "
                   "plus next-sentence (BERT) or sentence-order (ALBERT) prediction",
              outputs=("prediction_logits", ("seq_relationship_logits", "sop_logits")),
              shapes=lambda c, x: ((_batch(x), _length(x), c.vocab_size), (_batch(x), 2)))
register_kind("replaced-token", modality="text", example=_tokens, objective=replaced_token,
              does="forward(input_ids (B, T)) -> (B, T) logits that each token was replaced (ELECTRA's discriminator)",
              shapes=lambda c, x: (_batch(x), _length(x)))
register_kind("speech-to-text", modality="audio", command="attnlab transcribe",
              does="forward(input_features (B, M, F), decoder_input_ids (B, T)) -> logits (B, T, V); encode / decode / "
                   "new_cache for decoding",
              example=lambda c, lim, B, T, seed: {
                  "input_features": _randn((B, lim["num_mel_bins"], lim["frames"]), seed),
                  "decoder_input_ids": _ids(lim["vocab_size"], (B, T - 3), seed + 1)},
              shapes=lambda c, x: (_batch(x), x["decoder_input_ids"].size(1), c.vocab_size))
register_kind("image-classifier", modality="image", command="attnlab classify", example=_pixels,
              objective=classification,
              does="forward(pixel_values (B, C, H, W)) -> class logits (B, num_labels)",
              shapes=lambda c, x: (_batch(x), c.num_labels))


@dataclass(frozen=True, eq=False)
class Architecture:
    """One model class of a family (see the module docstring). ``build(config)`` makes a model."""
    family: "Family"
    name: str                          # HF class name written to / read from config.json "architectures"
    model_cls: type
    kind: str
    prefix: str = ""                   # where the base's keys sit in this architecture's checkpoints
    head_rules: tuple[Rule, ...] = ()
    ignore_on_load: tuple[str, ...] = ()
    factory: Callable[[Any], nn.Module] | None = None    # default model_cls(config)
    # (regex, replacement) renames of checkpoint keys before the weight map: another writer's
    # names for the same tensors (loading only; saving writes the weight map's names)
    aliases: tuple[tuple[str, str], ...] = ()

    @property
    def model_type(self) -> str:
        return self.family.model_type

    @property
    def config_cls(self) -> type:
        return self.family.config_cls

    @property
    def weight_map(self) -> tuple[Rule, ...] | None:
        """Our keys <-> this architecture's checkpoint keys (what saving writes); None for a
        native family, whose checkpoints use our keys."""
        if self.family.base_rules is None:
            return None
        return tuple(with_prefix(self.family.base_rules, self.prefix)) + self.head_rules

    @property
    def load_rules(self) -> tuple[Rule, ...] | None:
        """The weight map, then the base's keys without the prefix: a checkpoint saved from the
        bare base (the Hub's original gpt2 weights, whose config.json names GPT2LMHeadModel)
        loads into the model with a head when the head needs no weights of its own (it is tied),
        as transformers' own loader allows. Rules are tried in order, so saving keeps the prefix."""
        rules = self.weight_map
        if rules is None or not self.prefix:
            return rules
        return rules + tuple(self.family.base_rules)

    @property
    def skip_on_load(self) -> tuple[str, ...]:
        return self.family.ignore_on_load + self.ignore_on_load

    def checkpoint_keys(self, tensors: dict) -> dict:
        """A checkpoint's tensors under the names this architecture's weight map reads:
        :attr:`aliases` applied and, for a bare base model (kind "base") given a checkpoint saved
        with a head (its keys under another architecture's prefix, such as "deberta." in
        Microsoft's DeBERTa-v3 checkpoints, whose config.json names no architecture), the prefix
        removed and the head's tensors left out with a warning naming them, as transformers'
        loader does."""
        for pattern, replacement in self.aliases:
            tensors = {re.sub(pattern, replacement, k): v for k, v in tensors.items()}
        if self.kind != "base" or self.prefix:
            return tensors
        for prefix in dict.fromkeys(a.prefix for a in self.family.architectures.values() if a.prefix):
            if any(k.startswith(prefix) for k in tensors):
                left = sorted({k.split(".")[0] for k in tensors if not k.startswith(prefix)})
                if left:
                    warnings.warn(f"{self.name}: loading the base model from a checkpoint with a head: "
                                  f"left out the tensors under {', '.join(left)}", stacklevel=3)
                return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        return tensors

    def build(self, config) -> nn.Module:
        if not isinstance(config, self.config_cls):
            raise TypeError(f"{self.name} is built from a {self.config_cls.__name__}, got {type(config).__name__}")
        return (self.factory or self.model_cls)(config)

    def __repr__(self) -> str:
        return f"Architecture({self.model_type}/{self.name}, {self.model_cls.__name__}, kind={self.kind!r})"


@dataclass(eq=False)
class Family:
    """A model family (see the module docstring); created by :func:`register_family`."""
    model_type: str
    config_cls: type
    base_rules: tuple[Rule, ...] | None = None
    config_from_hf: Callable[[dict], Any] | None = None
    config_to_hf: Callable[[Any], dict] | None = None
    presets: dict[str, dict] = field(default_factory=dict)
    builder: Callable[..., Any] | None = None
    ignore_on_load: tuple[str, ...] = ()
    architectures: dict[str, Architecture] = field(default_factory=dict)
    # the family's own training recipe, which tasks apply where no flag is given: "optimizer"
    # ("adamw" | "adafactor"), its peak "lr" and "weight_decay"
    training: dict = field(default_factory=dict)
    modality: str = "text"
    limits: Callable[[Any], dict] | None = None      # config -> its modality's input limits
    # config -> why transformers cannot run it (a setting attnlab adds to the family), or None
    hf_unsupported: Callable[[Any], str | None] | None = None
    # what the family states for the training tasks and the exporter (see register_family)
    training_options: tuple["FamilyOption", ...] = ()
    task_defaults: dict[str, dict] = field(default_factory=dict)
    token_ids: dict[str, str] = field(default_factory=dict)
    special_tokens: dict[str, str] = field(default_factory=dict)

    @property
    def hf(self) -> bool:
        """Whether the family maps to Hugging Face transformers (else: attnlab-native)."""
        return self.config_from_hf is not None

    # ------------------------------------------------------------------ architectures
    def register(self, name: str, model_cls: type, *, kind: str, prefix: str = "", head_rules=(),
                 ignore_on_load: tuple[str, ...] = (), factory: Callable | None = None,
                 aliases: tuple[tuple[str, str], ...] = (), default: bool = False) -> Architecture:
        """Add an architecture; the first one registered is the family's default (what a
        config.json without "architectures" loads as). ``default``: the family is the one a task
        trains for ``kind`` when none is named (:func:`default_family`); one family per kind."""
        where = f"{self.model_type}/{name}"
        if kind not in KINDS:
            raise ValueError(f"{where}: unknown kind {kind!r}; kinds: {', '.join(KINDS)}")
        if KINDS[kind].modality != self.modality:
            raise ValueError(f"{where}: kind {kind!r} takes {KINDS[kind].modality} input, the family's modality is "
                             f"{self.modality!r} (register_family(..., modality=...))")
        if isinstance(ignore_on_load, str):
            raise ValueError(f"{where}: ignore_on_load must be a tuple of patterns, not a string")
        if self.base_rules is None and (prefix or head_rules):
            raise ValueError(f"{where}: a native family (no base rules) takes no prefix or head rules")
        if not callable(getattr(model_cls, "save_pretrained", None)):
            raise ValueError(f"{where}: {model_cls.__name__} has no save_pretrained; every model has one (inherit "
                             "attnlab.models.pretrained.SavePretrained)")
        if name in self.architectures or model_cls in _BY_CLASS:
            raise ValueError(f"{where}: {name} or {model_cls.__name__} is already registered")
        if default and _DEFAULT_FOR.get(kind, self.model_type) != self.model_type:
            raise ValueError(f"{where}: {_DEFAULT_FOR[kind]!r} is already the default {kind} family")
        arch = Architecture(self, name, model_cls, kind, prefix, tuple(head_rules), tuple(ignore_on_load), factory,
                            tuple(aliases))
        if default:
            _DEFAULT_FOR[kind] = self.model_type
        self.architectures[name] = arch
        _BY_CLASS[model_cls] = arch
        return arch

    @property
    def default(self) -> Architecture:
        if not self.architectures:
            raise ValueError(f"model family {self.model_type!r} has no architecture registered")
        return next(iter(self.architectures.values()))

    def architecture(self, name: str | None, where: str = "config.json") -> Architecture:
        """The architecture called ``name`` (None: the default); ValueError naming the supported ones."""
        if name is None:
            return self.default
        arch = self.architectures.get(name)
        if arch is None:
            raise ValueError(f"{where}: architecture {name!r} of model_type {self.model_type!r} is not supported; "
                             f"supported: {', '.join(self.architectures)}")
        return arch

    def kinds(self) -> list[str]:
        return list(dict.fromkeys(a.kind for a in self.architectures.values()))

    def for_kind(self, kind: str) -> Architecture:
        """The (first registered) architecture of ``kind``; ValueError if the family has none."""
        arch = next((a for a in self.architectures.values() if a.kind == kind), None)
        if arch is None:
            raise ValueError(f"model family {self.model_type!r} has no {kind} architecture "
                             f"(it has: {', '.join(self.kinds()) or 'none'})")
        return arch

    # ------------------------------------------------------------------ configs
    def preset(self, name: str, **overrides):
        """The config of a named preset, with ``overrides`` for any field."""
        if name not in self.presets:
            raise ValueError(f"{self.model_type}: unknown preset {name!r}; presets: {', '.join(self.presets)}")
        return self.config_cls(**{**self.presets[name], **overrides})

    @property
    def sizes(self) -> tuple[str, ...]:
        """The arguments the family's sizing builder takes before its own options: its modality's
        sizes (text: vocab_size, context; images: image_size, patch_size, in_channels), then
        :data:`MODEL_SIZES`."""
        return MODALITIES[self.modality].sizes + MODEL_SIZES

    @property
    def options(self) -> dict[str, Any]:
        """The family's own sizing options beyond :attr:`sizes`, with their defaults."""
        if self.builder is None:
            return {}
        params = inspect.signature(self.builder).parameters.values()
        return {p.name: p.default for p in params if p.name not in self.sizes}

    def build_config(self, *, d_model: int, num_heads: int, num_layers: int, d_ff: int | None = None,
                     dropout: float = 0.0, **sizes_and_options):
        """A config sized by the modality's sizes (text: ``vocab_size`` and ``context``, the longest
        sequence; images: ``image_size``, ``patch_size``, ``in_channels``), the model sizes every
        family shares (``d_ff`` None: the family's default width) and the family's own options."""
        if self.builder is None:
            raise ValueError(f"model family {self.model_type!r} has no sizing builder")
        needed = MODALITIES[self.modality].sizes
        absent = [n for n in needed if n not in sizes_and_options]
        if absent:
            raise ValueError(f"{self.model_type}: build_config needs {', '.join(absent)} ({self.modality} sizes)")
        unknown = sorted(set(sizes_and_options) - set(needed) - set(self.options))
        if unknown:
            raise ValueError(f"{self.model_type}: unknown option(s) {', '.join(unknown)}; its options: "
                             f"{', '.join(self.options) or 'none'}")
        return self.builder(d_model=d_model, num_heads=num_heads, num_layers=num_layers, d_ff=d_ff, dropout=dropout,
                            **sizes_and_options)

    def input_limits(self, config) -> dict:
        """What inputs a model of ``config`` takes, as the family states it: for text its
        ``vocab_size`` and ``context`` (the longest sequence; None without a limit, as with
        relative positions), for images ``image_size``, ``patch_size`` and ``in_channels``."""
        if self.limits is None:
            raise ValueError(f"model family {self.model_type!r} states no input limits (register_family(limits=...))")
        limits = dict(self.limits(config))
        want = MODALITIES[self.modality].limits
        if set(limits) != set(want):
            raise ValueError(f"{self.model_type}: input limits give {sorted(limits)}, a {self.modality} family gives "
                             f"{', '.join(want)}")
        return limits

    # ------------------------------------------------------------------ what training tasks read
    def options_for(self, task: str) -> list["FamilyOption"]:
        """The family's own options of ``attnlab train TASK``."""
        return [o for o in self.training_options if task in o.tasks]

    def option_default(self, option: "FamilyOption") -> Any:
        """``option``'s value when it is not given: its own default, else the sizing builder's."""
        return option.default if option.default is not None else self.options.get(option.keyword)

    def token_id_sizes(self, tokenizer) -> dict[str, int]:
        """The sizing builder's keywords for the tokenizer's special ids (:attr:`token_ids`); a
        role the tokenizer lacks is left to the builder's default."""
        ids = {kw: getattr(tokenizer, f"{role}_id", None) for kw, role in self.token_ids.items()}
        return {kw: i for kw, i in ids.items() if i is not None}

    # ------------------------------------------------------------------ config.json
    def config_to_json(self, config) -> dict:
        """config.json's fields for ``config`` (HF names for a mapped family, ours otherwise)."""
        return self.config_to_hf(config) if self.hf else asdict(config)

    def config_from_json(self, data: dict, where: str = "config.json"):
        if self.hf:
            return self.config_from_hf(data)
        names = {f.name for f in fields(self.config_cls)}
        unknown = sorted(set(data) - names - _DIRECTORY_KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown {self.config_cls.__name__} field(s): {', '.join(unknown)}")
        return self.config_cls(**{k: v for k, v in data.items() if k in names})

    def __repr__(self) -> str:
        return f"Family({self.model_type!r}, architectures={list(self.architectures)})"


_DIRECTORY_KEYS = {"model_type", "architectures", "dtype", "torch_dtype"}   # written beside the config fields
_FAMILIES: dict[str, Family] = {}
_DEFAULT_FOR: dict[str, str] = {}             # kind -> the family a task trains when none is named
_BY_CLASS: dict[type, Architecture] = {}


TOKEN_ROLES = ("pad", "bos", "eos", "unk")      # a tokenizer's special ids: tokenizer.pad_id, .bos_id, ...


@dataclass(frozen=True)
class FamilyOption:
    """An option the family adds to training tasks: ``--name-with-dashes`` of ``attnlab train
    TASK`` for each TASK in ``tasks`` (task names, e.g. ``("lm",)``), ``name`` in recipes and
    config.yaml, passed to the sizing builder as ``keyword`` (default: ``name``). ``type`` is
    int, float, str or bool; ``default`` None leaves the builder's own default; ``check(value)``
    returns an error message or None. It shapes the model, so a resumed run keeps it."""
    name: str
    type: type
    help: str
    tasks: tuple[str, ...]
    keyword: str | None = None
    default: Any = None
    check: Callable[[Any], str | None] | None = None
    choices: tuple | None = None
    metavar: str | None = None

    def __post_init__(self):
        if self.keyword is None:
            object.__setattr__(self, "keyword", self.name)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _check_family_data(where: str, modality: str, build_config, options, task_defaults, token_ids,
                       special_tokens) -> None:
    """ValueError naming what is wrong with the options, task defaults, token ids or tokens a family states."""
    takes = set(inspect.signature(build_config).parameters) if build_config is not None else set()
    names = [o.name for o in options]
    for o in options:
        if not isinstance(o, FamilyOption):
            raise ValueError(f"{where}: options are FamilyOption, got {o!r}")
        if isinstance(o.tasks, str) or not o.tasks:
            raise ValueError(f"{where}: option {o.flag} names no task (tasks=('lm',), ...)")
        if o.type not in (int, float, str, bool):
            raise ValueError(f"{where}: option {o.flag} has type {o.type!r}; int, float, str or bool")
        if o.keyword not in takes or o.keyword in MODALITIES[modality].sizes + MODEL_SIZES:
            raise ValueError(f"{where}: option {o.flag} sets {o.keyword!r}, which is not one of build_config's own "
                             "keywords")
        if names.count(o.name) > 1:
            raise ValueError(f"{where}: option {o.flag} is stated twice")
    if not all(isinstance(v, dict) for v in task_defaults.values()):
        raise ValueError(f"{where}: task_defaults maps a task name to {{option name: value}}")
    for kw, role in token_ids.items():
        if kw not in takes or role not in TOKEN_ROLES:
            raise ValueError(f"{where}: token_ids maps build_config's keywords to a tokenizer role "
                             f"({', '.join(TOKEN_ROLES)}), got {kw!r}: {role!r}")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in special_tokens.items()):
        raise ValueError(f"{where}: special_tokens maps tokenizer_config.json keys to token strings")


def register_family(model_type: str, config_cls: type, *, base_rules=None, config_from_hf=None, config_to_hf=None,
                    presets: dict[str, dict] | None = None, build_config: Callable | None = None,
                    ignore_on_load: tuple[str, ...] = (), training: dict | None = None, modality: str = "text",
                    limits: Callable[[Any], dict] | None = None, options: tuple[FamilyOption, ...] = (),
                    task_defaults: dict[str, dict] | None = None, token_ids: dict[str, str] | None = None,
                    special_tokens: dict[str, str] | None = None,
                    hf_unsupported: Callable[[Any], str | None] | None = None) -> Family:
    """Create and register a family; add architectures with :meth:`Family.register`.

    ``base_rules``: the base's weight map (HF templates relative to the base), or None for an
    attnlab-native family. ``config_from_hf(dict) -> config`` / ``config_to_hf(config) -> dict``:
    both or neither (model_type, architectures and dtype are added on save). ``presets``: name ->
    config fields. ``build_config``: the sizing builder, keyword arguments the modality's sizes and
    :data:`MODEL_SIZES`, then the family's options. ``modality``: what its models take (a key of
    :data:`MODALITIES`); ``limits(config)``: that modality's input limits (:meth:`Family.input_limits`).
    ``hf_unsupported(config)``: why transformers' class could not run a config that uses a setting
    of attnlab's own (DyT in a ViT), else None; ``attnlab export`` refuses such a run.
    ``ignore_on_load``: regexes of checkpoint keys every architecture skips.
    ``training``: the family's own optimizer, peak lr and weight decay (``{"optimizer": "adafactor",
    "lr": 0.05, "weight_decay": 0.0}`` for T5), the defaults the training tasks use for it.

    What the training tasks and the exporter read, so that none of them names a family:
    ``options``: :class:`FamilyOption` s, the family's own flags of the tasks they name (refused
    with another ``--model``); ``task_defaults``: task name -> {option name: value}, the family's
    defaults for a task's own options (``{"mlm": {"objective": "sop"}}``: ALBERT's pre-training
    objective), used where the option is not given; ``token_ids``: the builder's keyword -> the
    tokenizer role whose id it takes (``{"decoder_start_token_id": "bos"}``); ``special_tokens``:
    tokenizer_config.json key -> token (``{"mask_token": "[MASK]"}``) that an exported tokenizer
    names where its vocabulary has the token.
    """
    if training and not set(training) <= {"optimizer", "lr", "weight_decay"}:
        raise ValueError(f"register_family({model_type!r}): training takes 'optimizer', 'lr' and 'weight_decay', "
                         f"got {sorted(training)}")
    if (config_from_hf is None) != (config_to_hf is None) or (config_from_hf is None) != (base_rules is None):
        raise ValueError(f"register_family({model_type!r}): give base_rules, config_from_hf and config_to_hf "
                         f"together (a Hugging Face family) or none of them (attnlab-native)")
    if isinstance(ignore_on_load, str):
        raise ValueError(f"register_family({model_type!r}): ignore_on_load must be a tuple of patterns")
    if limits is None:
        raise ValueError(f"register_family({model_type!r}): give limits=, the input limits of a config (text: "
                         "{'vocab_size': ..., 'context': ... or None}; images: image_size, patch_size, in_channels)")
    if model_type in _FAMILIES:
        raise ValueError(f"register_family: model_type {model_type!r} is already registered")
    if modality not in MODALITIES:
        raise ValueError(f"register_family({model_type!r}): unknown modality {modality!r}")
    if build_config is not None:
        params = inspect.signature(build_config).parameters
        absent = [n for n in MODALITIES[modality].sizes + MODEL_SIZES if n not in params]
        if absent:
            raise ValueError(f"register_family({model_type!r}): build_config lacks {', '.join(absent)}")
    task_defaults, token_ids = dict(task_defaults or {}), dict(token_ids or {})
    special_tokens = dict(special_tokens or {})
    _check_family_data(f"register_family({model_type!r})", modality, build_config, tuple(options), task_defaults,
                       token_ids, special_tokens)
    fam = Family(model_type, config_cls, None if base_rules is None else tuple(base_rules), config_from_hf,
                 config_to_hf, dict(presets or {}), build_config, tuple(ignore_on_load), training=dict(training or {}),
                 modality=modality, limits=limits, training_options=tuple(options), task_defaults=task_defaults,
                 token_ids=token_ids, special_tokens=special_tokens, hf_unsupported=hf_unsupported)
    _FAMILIES[model_type] = fam
    return fam


def family(model_type: str | None, where: str = "config.json") -> Family:
    """The family registered for ``model_type``; ValueError naming the supported ones."""
    fam = _FAMILIES.get(model_type)
    if fam is None:
        raise ValueError(f"{where}: unsupported model_type {model_type!r}; supported: {', '.join(sorted(_FAMILIES))}")
    return fam


def families(kind: str | None = None) -> list[Family]:
    """Every registered family (sorted by model_type), or those with an architecture of ``kind``."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; kinds: {', '.join(KINDS)}")
    return [f for _, f in sorted(_FAMILIES.items()) if kind is None or kind in f.kinds()]


def default_family(kind: str) -> str | None:
    """The model_type a task trains for ``kind`` when no ``--model`` is given: the family that
    registered an architecture of that kind with ``default=True``, else the only family with one,
    else None."""
    if kind in _DEFAULT_FOR:
        return _DEFAULT_FOR[kind]
    found = families(kind)
    return found[0].model_type if len(found) == 1 else None


def architectures() -> list[Architecture]:
    """Every registered (model type, architecture), family by family."""
    return [a for f in families() for a in f.architectures.values()]


def architecture_of(model: nn.Module) -> Architecture:
    """The architecture ``model``'s class is registered as; ValueError if none."""
    # the first registered class in its MRO: FSDP2's fully_shard swaps a model's class for a subclass
    arch = next((_BY_CLASS[c] for c in type(model).__mro__ if c in _BY_CLASS), None)
    if arch is None:
        raise ValueError(f"{type(model).__name__} is not a registered architecture; registered: "
                         f"{', '.join(sorted(c.__name__ for c in _BY_CLASS))}")
    return arch


def input_limits(model: nn.Module) -> dict:
    """The input limits ``model``'s family states for its config (:meth:`Family.input_limits`)."""
    return architecture_of(model).family.input_limits(model.config)


def training_loss(model: nn.Module, batch: dict, forward: Callable | None = None) -> Objective:
    """``model``'s training loss on ``batch`` (:mod:`attnlab.models.objective`): its class's own
    ``loss(batch, forward)`` where it has one, else its kind's objective. ``forward`` runs the model
    (a DDP or compiled wrapper of it; default the model)."""
    own = getattr(model, "loss", None)
    if callable(own):
        return own(batch, forward=forward)
    kind = KINDS[architecture_of(model).kind]
    if kind.objective is None:
        raise ValueError(f"{type(model).__name__}: a {kind.name} model states no training objective")
    return kind.objective(model, batch, forward)
