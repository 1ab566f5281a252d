"""LLaVA (Liu et al. 2023, "Visual Instruction Tuning", section 4.1): a vision encoder, a projector
and a causal language model; the image becomes tokens of the language model's input.

    pixel_values (B_i, C, H, W) -> CLIP vision tower, the hidden state after layer
        ``vision_feature_layer`` (-2: the second-to-last) -> drop the class row ("default";
        "full" keeps it) -> projector: Linear -> GELU -> Linear -> image features (B_i, P, E)
    input_ids (B, T) holding P copies of ``image_token_id`` per image (a prompt's one "<image>"
        expanded to the image's P patches, as transformers' LlavaProcessor does) -> token vectors,
        the image tokens' rows replaced by the features in order -> LLaMA -> logits (B, T, V)

The vision tower's layers after ``vision_feature_layer`` and its final norm compute nothing that
the model reads; they are kept as buffers (checkpoints carry them) and trained by nothing.

Weights: as transformers saves LlavaForConditionalGeneration (``vision_tower.encoder.layers.{i}...``,
``multi_modal_projector.linear_1``, ``language_model.model.layers.{i}...``, ``language_model.lm_head``);
its module paths (``model.language_model...``) and the llava-hf checkpoints' names load too.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import torch
from torch import Tensor, nn

from ..nn.mlp import make_activation
from .clip import CLIPConfig, CLIPVisionTower, clip_config_from_hf, clip_config_to_hf, clip_rules
from .convert import Rule
from .llama import LLAMA_WEIGHT_MAP, Llama, LlamaConfig
from .llama import config_from_hf as llama_from_hf, config_to_hf as llama_to_hf
from .pretrained import SavePretrained
from .registry import KINDS, register_family, register_kind

__all__ = ["LlavaConfig", "LlavaForConditionalGeneration", "LLAVA", "expand_image_tokens"]

_ACT_FROM_HF = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "silu": "silu", "quick_gelu": "quick_gelu"}
_ACT_TO_HF = {v: k for k, v in _ACT_FROM_HF.items()}
_VISION_FIELDS = ("image_size", "patch_size", "in_channels", "vision_d_model", "vision_num_heads", "vision_num_layers",
                  "vision_d_ff", "activation", "layer_norm_eps", "attention_dropout")


@dataclass
class LlavaConfig:
    vision: CLIPConfig = field(default_factory=CLIPConfig)    # its image tower's fields; the text ones unused
    text: LlamaConfig = field(default_factory=LlamaConfig)
    image_token_id: int = 32000
    vision_feature_layer: int = -2
    vision_feature_select_strategy: str = "default"
    projector_activation: str = "gelu"
    projector_bias: bool = True

    def __post_init__(self):
        vision = CLIPConfig(**self.vision) if isinstance(self.vision, dict) else self.vision
        self.vision = CLIPConfig(**{f: getattr(vision, f) for f in _VISION_FIELDS})    # the text tower's: unused
        if isinstance(self.text, dict):
            self.text = LlamaConfig(**self.text)
        n = self.vision.vision_num_layers
        if not isinstance(self.vision_feature_layer, int) or not -n - 1 <= self.vision_feature_layer <= n:
            raise ValueError(f"LlavaConfig: vision_feature_layer must be one layer index in [{-n - 1}, {n}], got "
                             f"{self.vision_feature_layer!r}")
        if self.vision_feature_select_strategy not in ("default", "full"):
            raise ValueError(f"LlavaConfig: vision_feature_select_strategy must be 'default' or 'full', got "
                             f"{self.vision_feature_select_strategy!r}")
        if self.projector_activation not in _ACT_TO_HF:
            raise ValueError(f"LlavaConfig: projector_activation must be one of {tuple(_ACT_TO_HF)}")
        if not 0 <= self.image_token_id < self.text.vocab_size:
            raise ValueError(f"LlavaConfig: image_token_id {self.image_token_id} is not in the text vocabulary "
                             f"({self.text.vocab_size})")

    @property
    def vision_layers_used(self) -> int:
        """How many layers of the vision tower the features pass through."""
        layer = self.vision_feature_layer
        return layer if layer >= 0 else self.vision.vision_num_layers + 1 + layer

    @property
    def image_tokens(self) -> int:
        """Image tokens per image at the tower's own size: its patches (and the class row with "full")."""
        patches = (self.vision.image_size // self.vision.patch_size) ** 2
        return patches + (self.vision_feature_select_strategy == "full")


class Projector(nn.Module):
    """Image features (…, E_v) -> Linear -> activation -> Linear -> (…, E_t)."""

    def __init__(self, d_in: int, d_out: int, activation: str, bias: bool):
        super().__init__()
        self.linear_1 = nn.Linear(d_in, d_out, bias=bias)
        self.act = make_activation(activation)
        self.linear_2 = nn.Linear(d_out, d_out, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def _as_buffers(module: nn.Module) -> None:
    """Turn ``module``'s parameters into buffers of the same names (kept, saved, never trained)."""
    for sub in module.modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            delattr(sub, name)
            sub.register_buffer(name, p.detach())


class LlavaForConditionalGeneration(SavePretrained, nn.Module):
    """``forward(input_ids (B, T), pixel_values (B_i, C, H, W) or None, attention_mask=None,
    positions=None, cache=None) -> logits (B, T, V)``; the ids hold ``image_tokens`` copies of
    ``image_token_id`` per image, the images in the order of their tokens."""

    def __init__(self, config: LlavaConfig):
        super().__init__()
        self.config = c = config
        self.vision_tower = CLIPVisionTower(c.vision)
        self.multi_modal_projector = Projector(c.vision.vision_d_model, c.text.d_model, c.projector_activation,
                                               c.projector_bias)
        self.language_model = Llama(c.text)
        nn.init.normal_(self.multi_modal_projector.linear_1.weight, std=0.02)
        nn.init.normal_(self.multi_modal_projector.linear_2.weight, std=0.02)
        for layer in self.vision_tower.layers[c.vision_layers_used:]:
            _as_buffers(layer)
        _as_buffers(self.vision_tower.post_norm)

    def unread_weights(self) -> tuple[str, ...]:
        """The vision tower's layers past the feature layer and its final norm (see the module docstring)."""
        unused = [m for m in self.vision_tower.layers[self.config.vision_layers_used:]] + [self.vision_tower.post_norm]
        names = {id(m): n for n, m in self.named_modules()}
        return tuple(f"{names[id(m)]}.{b}" for m in unused for b, _ in m.named_buffers())

    def image_features(self, pixel_values: Tensor) -> Tensor:
        """(B_i, image_tokens, E_t): each image's tokens for the language model."""
        x = self.vision_tower.hidden_states(pixel_values, self.config.vision_layers_used)
        if self.config.vision_feature_select_strategy == "default":
            x = x[:, 1:]
        return self.multi_modal_projector(x)

    def forward(self, input_ids: Tensor, pixel_values: Tensor | None = None, attention_mask: Tensor | None = None,
                positions: Tensor | None = None, cache=None) -> Tensor:
        lm = self.language_model
        lm._check_ids(input_ids)
        x = lm.token_embedding(input_ids)
        if pixel_values is not None:
            features = self.image_features(pixel_values).to(x.dtype)
            where = input_ids == self.config.image_token_id
            if int(where.sum()) != features.shape[0] * features.shape[1]:
                raise ValueError(f"LlavaForConditionalGeneration: input_ids hold {int(where.sum())} image tokens, the "
                                 f"{features.shape[0]} image(s) give {features.shape[1]} each: expand each image's "
                                 "placeholder to that many (expand_image_tokens)")
            x = x.masked_scatter(where[..., None], features)
        return lm(input_ids, attention_mask, positions, cache, inputs_embeds=x)

    def new_cache(self):
        return self.language_model.new_cache()


def expand_image_tokens(ids: list[int], image_token_id: int, tokens_per_image: int) -> list[int]:
    """A prompt's ids with each ``image_token_id`` repeated ``tokens_per_image`` times, as
    transformers' LlavaProcessor expands "<image>" (``image_seq_length``)."""
    return [t for i in ids for t in ([i] * tokens_per_image if i == image_token_id else [i])]


# ----------------------------------------------------------------------------- Hugging Face
def llava_rules() -> list[Rule]:
    """Our keys <-> the names transformers writes for LlavaForConditionalGeneration (its saved
    layout: ``vision_tower.encoder...``, ``multi_modal_projector...``, ``language_model.model...``,
    ``language_model.lm_head``); :data:`ALIASES` reads its in-memory names and the Hub's too."""
    vision = [replace(r, ours=tuple("vision_tower." + o.removeprefix("vision_model.") for o in r.ours),
                      theirs=tuple("vision_tower." + t.removeprefix("vision_model.") for t in r.theirs))
              for r in clip_rules() if all(o.startswith("vision_model.") for o in r.ours)]
    text = [replace(r, ours=tuple("language_model." + o for o in r.ours),
                    theirs=tuple("language_model." + t for t in r.theirs)) for r in LLAMA_WEIGHT_MAP]
    projector = [Rule(f"multi_modal_projector.{n}.{{p}}", f"multi_modal_projector.{n}.{{p}}")
                 for n in ("linear_1", "linear_2")]
    return vision + projector + text


# other writers' names for the same tensors: transformers' module paths, the llava-hf checkpoints' tower
ALIASES = ((r"^model\.vision_tower\.vision_model\.", "vision_tower."), (r"^vision_tower\.vision_model\.", "vision_tower."),
           (r"^model\.multi_modal_projector\.", "multi_modal_projector."),
           (r"^model\.language_model\.", "language_model.model."), (r"^lm_head\.", "language_model.lm_head."))


def llava_config_from_hf(c: dict) -> LlavaConfig:
    v, t = dict(c.get("vision_config") or {}), dict(c.get("text_config") or {})
    shared = {k: v[k] for k in ("hidden_act", "layer_norm_eps", "attention_dropout") if k in v}
    vision = clip_config_from_hf({"vision_config": v, "text_config": shared})
    act = c.get("projector_hidden_act", "gelu")
    if act not in _ACT_FROM_HF:
        raise ValueError(f"LlavaConfig: projector_hidden_act {act!r} is not supported ({', '.join(_ACT_FROM_HF)})")
    if c.get("vision_feature_layer") is not None and not isinstance(c["vision_feature_layer"], int):
        raise ValueError(f"LlavaConfig: several vision feature layers {c['vision_feature_layer']} are not supported")
    return LlavaConfig(vision=vision, text=llama_from_hf(t), image_token_id=c.get("image_token_index", 32000),
                       vision_feature_layer=c.get("vision_feature_layer", -2),
                       vision_feature_select_strategy=c.get("vision_feature_select_strategy", "default"),
                       projector_activation=_ACT_FROM_HF[act], projector_bias=c.get("multimodal_projector_bias", True))


def llava_config_to_hf(cfg: LlavaConfig) -> dict:
    vision = {k: v for k, v in clip_config_to_hf(cfg.vision)["vision_config"].items() if k != "projection_dim"}
    return {"vision_config": {**vision, "model_type": "clip_vision_model"},
            "text_config": {**llama_to_hf(cfg.text), "model_type": "llama"},
            "image_token_index": cfg.image_token_id, "image_seq_length": cfg.image_tokens,
            "vision_feature_layer": cfg.vision_feature_layer,
            "vision_feature_select_strategy": cfg.vision_feature_select_strategy,
            "projector_hidden_act": _ACT_TO_HF[cfg.projector_activation],
            "multimodal_projector_bias": cfg.projector_bias, "tie_word_embeddings": cfg.text.tie_word_embeddings}


# ----------------------------------------------------------------------------- registration
def _prompts(config, limits, B, T, seed) -> dict:
    """Prompts of T text tokens with one image's tokens after the first, and B images."""
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(0, config.text.vocab_size - 1, (B, T), generator=g)
    text[text == config.image_token_id] = config.text.vocab_size - 1 if config.image_token_id != \
        config.text.vocab_size - 1 else 0
    image = torch.full((B, config.image_tokens), config.image_token_id)
    size = limits["image_size"]
    return {"input_ids": torch.cat([text[:, :1], image, text[:, 1:]], 1),
            "pixel_values": torch.randn(B, limits["in_channels"], size, size, generator=g)}


if "vision-language" not in KINDS:
    register_kind("vision-language", modality="image-text", command="attnlab ask", example=_prompts,
                  shapes=lambda c, x: (x["input_ids"].size(0), x["input_ids"].size(1), c.text.vocab_size),
                  does="forward(input_ids (B, T) with each image's tokens, pixel_values (B_i, C, H, W)) -> next-token "
                       "logits (B, T, V): a language model that reads images as tokens")


def build_config(*, image_size: int, patch_size: int, in_channels: int, vocab_size: int, context: int, d_model: int,
                 num_heads: int, num_layers: int, d_ff: int | None = None, dropout: float = 0.0,
                 image_token_id: int | None = None) -> LlavaConfig:
    """A vision tower and a LLaMA of the same width and depth; the image token is the vocabulary's last id."""
    from .clip import build_config as clip_sizes
    from .llama import build_config as llama_sizes
    vision = clip_sizes(image_size=image_size, patch_size=patch_size, in_channels=in_channels, vocab_size=vocab_size,
                        context=context, d_model=d_model, num_heads=num_heads, num_layers=num_layers, d_ff=d_ff,
                        dropout=dropout)
    text = llama_sizes(vocab_size=vocab_size, context=context, d_model=d_model, num_heads=num_heads,
                       num_layers=num_layers, d_ff=d_ff, dropout=dropout)
    return LlavaConfig(vision=vision, text=text, image_token_id=vocab_size - 1 if image_token_id is None
                       else image_token_id)


def _tiny() -> dict:
    vision = asdict(CLIPConfig(image_size=16, patch_size=4, vision_d_model=32, vision_num_heads=4, vision_num_layers=3,
                               vision_d_ff=48, projection_dim=24))
    text = asdict(LlamaConfig(vocab_size=99, d_model=32, num_heads=4, num_kv_heads=2, num_layers=2, d_ff=64,
                              max_position_embeddings=64))
    return dict(vision=vision, text=text, image_token_id=98)


LLAVA = register_family("llava", LlavaConfig, base_rules=llava_rules(), config_from_hf=llava_config_from_hf,
                        config_to_hf=llava_config_to_hf, presets={"tiny": _tiny()}, build_config=build_config,
                        modality="image-text", ignore_on_load=(r"\.rotary_emb\.inv_freq$",),
                        limits=lambda c: {"image_size": c.vision.image_size, "patch_size": c.vision.patch_size,
                                          "in_channels": c.vision.in_channels, "vocab_size": c.text.vocab_size,
                                          "context": c.text.max_seq_len})
LLAVA.register("LlavaForConditionalGeneration", LlavaForConditionalGeneration, kind="vision-language", aliases=ALIASES)
