"""The masked auto-encoder (He et al. 2022, "Masked Autoencoders Are Scalable Vision Learners", section 3).

    pixel_values (B, C, H, W) -> PatchEmbedding -> (B, P, E) + fixed 2-D sin-cos positions
        -> random masking: keep K = int(P (1 - mask_ratio)) patches per image, chosen by argsort(noise)
        -> [class token; K visible patches] -> the ViT encoder (Pre-Norm stack, final norm) -> (B, 1 + K, E)
    decoder: Linear(E -> E_d) -> a mask token in every dropped place, rows put back in patch order
        (ids_restore) -> + its own sin-cos table -> N_d Pre-Norm layers -> norm -> Linear(E_d -> p*p*C)
        -> logits (B, P, p*p*C), the class row dropped
    loss = mean over the masked patches of mean((logits - target)^2) over a patch's p*p*C values;
        target = the patch's pixels, or (norm_pix_loss) the pixels normalised by the patch's own
        mean and variance, (x - mean) / sqrt(var + 1e-6)

The encoder runs on the visible quarter only, so its attention costs (K + 1)^2 instead of (P + 1)^2:
at 224 px and p = 16, 50 rows instead of 197 (about 1/16 of the score matrix). Which patches are
masked is ``argsort(noise)`` of a (B, P) noise: give ``noise`` (transformers' name) or ``seed`` to
fix them, else torch.rand draws them on every call, as transformers does in eval mode too.
``mask`` (B, P) is 1 where a patch was dropped; ``ids_restore`` (B, P) puts the shuffled rows back.

Weights: transformers' ViTMAEModel / ViTMAEForPreTraining names as its save_pretrained writes them
(``vit.`` then ViT's own, ``decoder.decoder_encoder.layer.{i}`` for the decoder's layers); the
position tables are stored though fixed (here buffers, there parameters without gradient).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.patch import interpolate_grid_table, patch_grid
from .convert import Rule
from .objective import Objective
from .registry import KINDS, FamilyOption, register_family, register_kind
from .vit import ViTConfig, ViTEncoder, vit_config_from_hf, vit_config_to_hf, vit_rules

__all__ = ["ViTMAEConfig", "ViTMAEModel", "ViTMAEForPreTraining", "MAEDecoder", "MAEOutput", "MAEModelOutput",
           "VIT_MAE", "sincos_2d_table", "random_masking", "masking_noise", "patchify", "unpatchify",
           "reconstruction_loss", "build_config"]


@dataclass
class ViTMAEConfig(ViTConfig):
    decoder_d_model: int = 512
    decoder_num_heads: int = 16
    decoder_num_layers: int = 8
    decoder_d_ff: int = 2048
    mask_ratio: float = 0.75
    norm_pix_loss: bool = False

    def __post_init__(self):
        super().__post_init__()
        who = type(self).__name__
        for f in ("decoder_d_model", "decoder_num_heads", "decoder_num_layers", "decoder_d_ff"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) <= 0:
                raise ValueError(f"{who}: {f} must be a positive integer, got {getattr(self, f)!r}")
        if self.decoder_d_model % self.decoder_num_heads:
            raise ValueError(f"{who}: decoder_d_model ({self.decoder_d_model}) is not divisible by decoder_num_heads "
                             f"({self.decoder_num_heads})")
        for f in ("d_model", "decoder_d_model"):      # the sin-cos table gives each axis a sine and a cosine half
            if getattr(self, f) % 4:
                raise ValueError(f"{who}: {f} ({getattr(self, f)}) must be a multiple of 4 for the 2-D sin-cos "
                                 f"position table")
        if isinstance(self.mask_ratio, bool) or not isinstance(self.mask_ratio, (int, float)) \
                or not 0.0 <= self.mask_ratio < 1.0:
            raise ValueError(f"{who}: mask_ratio must be in [0, 1), got {self.mask_ratio!r}")
        if self.pooling != "cls":
            raise ValueError(f"{who}: pooling must be 'cls' (MAE has no classifier to pool for), got {self.pooling!r}")
        if self.norm != "layernorm":
            raise ValueError(f"{who}: norm must be 'layernorm' (transformers' ViTMAE has no other), got {self.norm!r}")

    @property
    def visible(self) -> int:
        """Patches the encoder sees per image, as transformers counts them: int(P (1 - mask_ratio))."""
        return int(self.num_patches * (1 - self.mask_ratio))


class MAEOutput(NamedTuple):
    """ViTMAEForPreTraining's output, transformers' fields: the loss (a scalar), logits (B, P, p*p*C),
    mask (B, P) (1 = dropped) and ids_restore (B, P)."""
    loss: Tensor
    logits: Tensor
    mask: Tensor
    ids_restore: Tensor


class MAEModelOutput(NamedTuple):
    """ViTMAEModel's output: the encoder's last hidden state (B, 1 + K, E) of the class token and the
    visible patches in shuffled order, which ``mask`` and ``ids_restore`` (B, P) explain."""
    last_hidden_state: Tensor
    mask: Tensor
    ids_restore: Tensor


# ----------------------------------------------------------------------------- pieces
def sincos_2d_table(grid: tuple[int, int], dim: int) -> Tensor:
    """The fixed (1, 1 + gh * gw, dim) position table of MAE: a zero row for the class token, then per
    patch (row h, column w, row-major) [sin(w ω), cos(w ω), sin(h ω), cos(h ω)] with ω_i = 10000^(-i / (dim/4)),
    computed in float64 and rounded once, as transformers builds it."""
    if dim % 4:
        raise ValueError(f"sincos_2d_table: dim ({dim}) must be a multiple of 4")
    q = dim // 4
    omega = 1.0 / 10000.0 ** (torch.arange(q, dtype=torch.float64) / q)
    h, w = torch.meshgrid(torch.arange(grid[0], dtype=torch.float64), torch.arange(grid[1], dtype=torch.float64),
                          indexing="ij")
    eh, ew = h.reshape(-1, 1) * omega, w.reshape(-1, 1) * omega
    table = torch.cat([ew.sin(), ew.cos(), eh.sin(), eh.cos()], dim=1)
    return torch.cat([torch.zeros(1, dim, dtype=torch.float64), table]).float().unsqueeze(0)


class SinCosPositions(nn.Module):
    """A fixed sin-cos table (:func:`sincos_2d_table`) kept as a buffer ``weight``: in the state dict
    and the checkpoint (a loaded one may hold other values), never trained."""

    def __init__(self, grid: tuple[int, int], dim: int):
        super().__init__()
        self.grid = tuple(grid)
        self.register_buffer("weight", sincos_2d_table(self.grid, dim))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.copy_(sincos_2d_table(self.grid, self.weight.size(-1)))

    def table(self, grid: tuple[int, int] | None = None) -> Tensor:
        """The table for a patch grid (resized bicubically as ViT's for another image size)."""
        return self.weight if grid is None else interpolate_grid_table(self.weight, 1, self.grid, grid)


def masking_noise(batch: int, num_patches: int, seed: int, device=None) -> Tensor:
    """The (B, P) uniform noise a seed stands for: the same seed masks the same patches."""
    return torch.rand(batch, num_patches, generator=torch.Generator().manual_seed(seed)).to(device)


def random_masking(x: Tensor, mask_ratio: float, noise: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(the K = int(P (1 - mask_ratio)) kept rows of x (B, P, E) in the order of ascending noise,
    mask (B, P) with 1 where a patch was dropped, ids_restore (B, P)). ``noise`` (B, P), default
    torch.rand: the patches with the smallest noise are kept."""
    B, P, E = x.shape
    if noise is None:
        noise = torch.rand(B, P, device=x.device)
    elif not isinstance(noise, Tensor) or tuple(noise.shape) != (B, P):
        raise ValueError(f"noise must be a (batch, patches) = ({B}, {P}) tensor, got "
                         f"{tuple(getattr(noise, 'shape', ())) or type(noise).__name__}")
    keep = int(P * (1 - mask_ratio))
    ids_shuffle = torch.argsort(noise.to(x.device), dim=1)
    ids_restore = torch.argsort(ids_shuffle, dim=1)
    kept = torch.gather(x, 1, ids_shuffle[:, :keep].unsqueeze(-1).expand(-1, -1, E))
    mask = (ids_restore >= keep).to(x.dtype)
    return kept, mask, ids_restore


def patchify(pixel_values: Tensor, patch_size: int) -> Tensor:
    """(B, C, H, W) -> (B, P, p*p*C): each patch's pixels row by row, the channels innermost."""
    B, C, H, W = pixel_values.shape
    gh, gw = patch_grid(H, W, patch_size)
    x = pixel_values[:, :, :gh * patch_size, :gw * patch_size].reshape(B, C, gh, patch_size, gw, patch_size)
    return x.permute(0, 2, 4, 3, 5, 1).reshape(B, gh * gw, patch_size * patch_size * C)


def unpatchify(patches: Tensor, patch_size: int, image_size: tuple[int, int], channels: int) -> Tensor:
    """The inverse of :func:`patchify`: (B, P, p*p*C) -> (B, C, H, W) for an (H, W) image."""
    gh, gw = patch_grid(*image_size, patch_size)
    if gh * gw != patches.size(1):
        raise ValueError(f"unpatchify: {patches.size(1)} patches are not the {gh}x{gw} grid of a {image_size} image")
    x = patches.reshape(patches.size(0), gh, gw, patch_size, patch_size, channels)
    return x.permute(0, 5, 1, 3, 2, 4).reshape(patches.size(0), channels, gh * patch_size, gw * patch_size)


def _normalised(target: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(target normalised per patch, its mean, sqrt(var + 1e-6)); var unbiased, as MAE's."""
    mean, var = target.mean(-1, keepdim=True), target.var(-1, keepdim=True)
    std = (var + 1.0e-6) ** 0.5
    return (target - mean) / std, mean, std


def reconstruction_loss(logits: Tensor, target: Tensor, mask: Tensor, norm_pix_loss: bool = False,
                        reduction: str = "mean") -> Tensor:
    """MAE's loss: per patch the mean squared error over its p*p*C values, against the pixels or
    (``norm_pix_loss``) the pixels normalised per patch; summed over the masked patches (``mask`` 1),
    then divided by their number ("mean") or not ("sum", for the Trainer's own normalisation)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reconstruction_loss: reduction must be 'mean' or 'sum', got {reduction!r}")
    target = target.float()
    if norm_pix_loss:
        target = _normalised(target)[0]
    per_patch = ((logits.float() - target) ** 2).mean(-1)
    total = (per_patch * mask).sum()
    return total / mask.sum() if reduction == "mean" else total


# ----------------------------------------------------------------------------- the models
class _MAEEncoder(ViTEncoder):
    """The ViT encoder with MAE's fixed positions, run on the visible patches only."""

    transfers_to = "vit"                  # its encoder starts a ViT classifier (attnlab.models.transfer)

    def __init__(self, config: ViTMAEConfig):
        super().__init__(config)
        self.position = SinCosPositions(self.patch_embed.grid, config.d_model)

    def reset_parameters(self) -> None:
        """ViT's initialisation (N(0, 0.02) truncated matrices, zero biases), the class token N(0, 0.02)
        as MAE's, the fixed tables rebuilt."""
        super().reset_parameters()
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, SinCosPositions):
                    module.reset_parameters()

    def _grid(self, pixel_values: Tensor, interpolate_pos_encoding: bool) -> tuple[int, int]:
        c, who = self.config, type(self).__name__
        if not isinstance(pixel_values, Tensor) or pixel_values.dim() != 4:
            raise ValueError(f"{who}: pixel_values must be a (batch, channels, height, width) tensor, got "
                             f"{tuple(getattr(pixel_values, 'shape', ())) or type(pixel_values).__name__}")
        H, W = pixel_values.shape[-2:]
        if not interpolate_pos_encoding and (H, W) != (c.image_size, c.image_size):
            raise ValueError(f"{who}: a {H}x{W} image, the model's is {c.image_size}x{c.image_size}; pass "
                             f"interpolate_pos_encoding=True to resize the position tables to it")
        return patch_grid(H, W, c.patch_size)

    def encode_visible(self, pixel_values: Tensor, noise: Tensor | None = None, seed: int | None = None,
                       interpolate_pos_encoding: bool = False) -> MAEModelOutput:
        """(hidden (B, 1 + K, E) after the final norm, mask (B, P), ids_restore (B, P))."""
        who = type(self).__name__
        grid = self._grid(pixel_values, interpolate_pos_encoding)
        if seed is not None:
            if noise is not None:
                raise ValueError(f"{who}: give noise or seed, not both")
            noise = masking_noise(pixel_values.size(0), grid[0] * grid[1], seed, pixel_values.device)
        x = self.patch_embed(pixel_values.to(self.patch_embed.proj.weight.dtype))
        table = self.position.table(grid).to(x.dtype)
        try:
            x, mask, ids_restore = random_masking(x + table[:, 1:], self.config.mask_ratio, noise)
        except ValueError as e:
            raise ValueError(f"{who}: {e}") from None
        x = torch.cat([(self.cls_token + table[:, :1]).expand(x.size(0), -1, -1), x], dim=1)
        for layer in self.layers:
            x = layer(x)
        return MAEModelOutput(self.norm(x), mask, ids_restore)


class ViTMAEModel(_MAEEncoder):
    """MAE's encoder alone (kind "masked-image-base", transformers' ViTMAEModel):
    ``forward(pixel_values (B, C, H, W), noise=None, interpolate_pos_encoding=False, *, seed=None)
    -> MAEModelOutput(last_hidden_state (B, 1 + K, E), mask, ids_restore)``."""

    def __init__(self, config: ViTMAEConfig):
        super().__init__(config)
        self.reset_parameters()

    def forward(self, pixel_values: Tensor, noise: Tensor | None = None, interpolate_pos_encoding: bool = False, *,
                seed: int | None = None) -> MAEModelOutput:
        return self.encode_visible(pixel_values, noise, seed, interpolate_pos_encoding)


class MAEDecoder(nn.Module):
    """The light decoder: ``forward(latent (B, 1 + K, E), ids_restore (B, P), grid=None) -> logits
    (B, P, p*p*C)``. Its layers and final norm are those of a ViT encoder of the decoder's sizes
    (built by :class:`ViTEncoder`, so that ViT's weight names and block wiring hold for them too)."""

    def __init__(self, config: ViTMAEConfig):
        super().__init__()
        c = config
        stack = ViTEncoder(ViTConfig(image_size=c.image_size, patch_size=c.patch_size, in_channels=c.in_channels,
                                     d_model=c.decoder_d_model, num_heads=c.decoder_num_heads,
                                     num_layers=c.decoder_num_layers, d_ff=c.decoder_d_ff, dropout=c.dropout,
                                     attention_dropout=c.attention_dropout, layer_norm_eps=c.layer_norm_eps,
                                     activation=c.activation, qkv_bias=c.qkv_bias))
        self.embed = nn.Linear(c.d_model, c.decoder_d_model)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, c.decoder_d_model))
        self.position = SinCosPositions(patch_grid(c.image_size, c.image_size, c.patch_size), c.decoder_d_model)
        self.layers, self.norm = stack.layers, stack.norm
        self.pred = nn.Linear(c.decoder_d_model, c.patch_size * c.patch_size * c.in_channels)

    def no_weight_decay(self) -> tuple[str, ...]:
        """The mask token: a learned input, not a weight; decay would pull it to 0."""
        return ("mask_token",)

    def table(self, patches: int) -> Tensor:
        """The decoder's table for ``patches`` patches: transformers resizes it for another image size
        along the flattened sequence (bicubically, as a 1 x P image), not over the 2-D grid."""
        if patches + 1 == self.position.weight.size(1):
            return self.position.weight
        t = self.position.weight
        rows = t[:, 1:].reshape(1, 1, -1, t.size(-1)).permute(0, 3, 1, 2)
        rows = F.interpolate(rows, size=(1, patches), mode="bicubic", align_corners=False)
        return torch.cat([t[:, :1], rows.permute(0, 2, 3, 1).reshape(1, -1, t.size(-1))], dim=1)

    def forward(self, latent: Tensor, ids_restore: Tensor) -> Tensor:
        h = self.embed(latent)
        B, _, D = h.shape
        P = ids_restore.size(1)
        rows = torch.cat([h[:, 1:], self.mask_token.to(h.dtype).expand(B, P + 1 - h.size(1), D)], dim=1)
        rows = torch.gather(rows, 1, ids_restore.unsqueeze(-1).expand(-1, -1, D))
        h = torch.cat([h[:, :1], rows], dim=1) + self.table(P).to(h.dtype)
        for layer in self.layers:
            h = layer(h)
        return self.pred(self.norm(h))[:, 1:]


class ViTMAEForPreTraining(_MAEEncoder):
    """MAE for pre-training (kind "masked-image-model", transformers' ViTMAEForPreTraining):
    ``forward(pixel_values (B, C, H, W), noise=None, interpolate_pos_encoding=False, *, seed=None)
    -> MAEOutput(loss, logits (B, P, p*p*C), mask (B, P), ids_restore (B, P))``.
    :meth:`reconstruction` gives the images the decoder sees, un-normalised per patch."""

    def __init__(self, config: ViTMAEConfig):
        super().__init__(config)
        self.decoder = MAEDecoder(config)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        with torch.no_grad():
            nn.init.trunc_normal_(self.decoder.mask_token, std=0.02, a=-0.04, b=0.04)

    def patchify(self, pixel_values: Tensor, interpolate_pos_encoding: bool = False) -> Tensor:
        """(B, C, H, W) -> (B, P, p*p*C), the target's layout (:func:`patchify`)."""
        self._grid(pixel_values, interpolate_pos_encoding)
        return patchify(pixel_values, self.config.patch_size)

    def unpatchify(self, patches: Tensor, original_image_size: tuple[int, int] | None = None) -> Tensor:
        c = self.config
        return unpatchify(patches, c.patch_size, original_image_size or (c.image_size, c.image_size), c.in_channels)

    def forward(self, pixel_values: Tensor, noise: Tensor | None = None, interpolate_pos_encoding: bool = False, *,
                seed: int | None = None) -> MAEOutput:
        latent, mask, ids_restore = self.encode_visible(pixel_values, noise, seed, interpolate_pos_encoding)
        logits = self.decoder(latent, ids_restore)
        target = self.patchify(pixel_values, interpolate_pos_encoding)
        loss = reconstruction_loss(logits, target, mask, self.config.norm_pix_loss)
        return MAEOutput(loss, logits, mask, ids_restore)

    def loss(self, batch: dict, forward=None) -> Objective:
        """MAE's objective (:mod:`attnlab.models.objective`): :func:`reconstruction_loss` summed over
        the masked patches of ``batch["pixel_values"]``, count the masked patches (the mask drawn
        by ``batch["seed"]``, or by ``batch["noise"]`` as transformers', where given)."""
        pixels, seed = batch["pixel_values"], batch.get("seed")
        out = (forward or self)(pixels, batch.get("noise"), **({} if seed is None else {"seed": seed}))
        target = patchify(pixels, self.config.patch_size)
        total = reconstruction_loss(out.logits, target, out.mask, self.config.norm_pix_loss, "sum")
        return Objective(total, int(out.mask.sum()))

    @torch.no_grad()
    def reconstruction(self, pixel_values: Tensor, out: MAEOutput) -> Tensor:
        """(B, C, H, W): the visible patches as given, the masked ones as predicted. With
        ``norm_pix_loss`` the predictions are per-patch normalised values, so they are first put
        back on each patch's own mean and standard deviation; shown raw they would be noise."""
        target = patchify(pixel_values, self.config.patch_size).float()
        pred = out.logits.float()
        if self.config.norm_pix_loss:
            _, mean, std = _normalised(target)
            pred = pred * std + mean
        m = out.mask.unsqueeze(-1).float()
        patches = target * (1 - m) + pred * m
        return unpatchify(patches, self.config.patch_size, tuple(pixel_values.shape[-2:]), self.config.in_channels)


# ----------------------------------------------------------------------------- Hugging Face
def _decoder_rules() -> list[Rule]:
    """The decoder's keys <-> transformers' names: its layers and norm named as ViT's are (the rules
    of :func:`attnlab.models.vit.vit_rules`, under ``decoder.`` / ``decoder.decoder_``), then its own."""
    layers = [replace(r, ours=tuple("decoder." + t for t in r.ours),
                      theirs=tuple("decoder.decoder_" + t for t in r.theirs))
              for r in vit_rules() if all(t.startswith("layers.") for t in r.ours)]
    return [*layers, Rule("decoder.norm.{p}", "decoder.decoder_norm.{p}"),
            Rule("decoder.embed.{p}", "decoder.decoder_embed.{p}"), Rule("decoder.mask_token", "decoder.mask_token"),
            Rule("decoder.position.weight", "decoder.decoder_pos_embed"),
            Rule("decoder.pred.{p}", "decoder.decoder_pred.{p}")]


# our config field -> transformers' ViTMAEConfig field, beyond ViT's
MAE_HF_NAMES = {"decoder_d_model": "decoder_hidden_size", "decoder_num_heads": "decoder_num_attention_heads",
                "decoder_num_layers": "decoder_num_hidden_layers", "decoder_d_ff": "decoder_intermediate_size",
                "mask_ratio": "mask_ratio", "norm_pix_loss": "norm_pix_loss"}


def mae_config_from_hf(c: dict) -> ViTMAEConfig:
    base = vit_config_from_hf(c, ViTMAEConfig)
    return replace(base, **{ours: c[hf] for ours, hf in MAE_HF_NAMES.items() if hf in c})


def mae_config_to_hf(cfg: ViTMAEConfig) -> dict:
    vit = {k: v for k, v in vit_config_to_hf(cfg).items() if k != "encoder_stride"}     # a ViT-for-masked-image field
    return {**vit, **{hf: getattr(cfg, ours) for ours, hf in MAE_HF_NAMES.items()}}


# ----------------------------------------------------------------------------- registration
def build_config(*, image_size: int, patch_size: int, in_channels: int, d_model: int, num_heads: int, num_layers: int,
                 d_ff: int | None = None, dropout: float = 0.0, decoder_d_model: int | None = None,
                 decoder_num_heads: int | None = None, decoder_num_layers: int = 2, decoder_d_ff: int | None = None,
                 mask_ratio: float = 0.75, norm_pix_loss: bool = False) -> ViTMAEConfig:
    """An MAE sized for training: d_ff 4 d_model unless given; the decoder as wide as the encoder
    with as many heads unless given, 2 layers, d_ff 4 times its width."""
    dw = decoder_d_model or d_model
    return ViTMAEConfig(image_size=image_size, patch_size=patch_size, in_channels=in_channels, d_model=d_model,
                        num_heads=num_heads, num_layers=num_layers, d_ff=d_ff or 4 * d_model, dropout=dropout,
                        attention_dropout=dropout, decoder_d_model=dw, decoder_num_heads=decoder_num_heads or num_heads,
                        decoder_num_layers=decoder_num_layers, decoder_d_ff=decoder_d_ff or 4 * dw,
                        mask_ratio=mask_ratio, norm_pix_loss=norm_pix_loss)


def _ratio(v) -> str | None:
    return None if 0 <= v < 1 else "must be in [0, 1)"


def _positive(v) -> str | None:
    return None if v > 0 else "must be positive"


_MAE = ("mae",)
OPTIONS = (
    FamilyOption("mask_ratio", float, "the fraction of each image's patches hidden from the encoder", _MAE,
                 check=_ratio),
    FamilyOption("norm_pix_loss", bool, "reconstruct each patch's pixels normalised by its own mean and variance",
                 _MAE),
    FamilyOption("decoder_d_model", int, "decoder width (default: the encoder's)", _MAE, check=_positive),
    FamilyOption("decoder_heads", int, "decoder attention heads (default: the encoder's)", _MAE,
                 keyword="decoder_num_heads", check=_positive),
    FamilyOption("decoder_layers", int, "decoder layers", _MAE, keyword="decoder_num_layers", check=_positive),
    FamilyOption("decoder_d_ff", int, "decoder feed-forward width (default: 4 x its width)", _MAE, check=_positive),
)

PRESETS = {
    "tiny": dict(image_size=16, patch_size=4, in_channels=3, d_model=32, num_heads=4, num_layers=2, d_ff=64,
                 decoder_d_model=16, decoder_num_heads=2, decoder_num_layers=1, decoder_d_ff=32),
    "vit-mae-base": dict(),                                                                   # facebook/vit-mae-base
    "vit-mae-large": dict(d_model=1024, num_heads=16, num_layers=24, d_ff=4096),
    "vit-mae-huge": dict(patch_size=14, d_model=1280, num_heads=16, num_layers=32, d_ff=5120),
}


def _example(config, limits, B, T, seed) -> dict:
    """Pixels and the noise that fixes which patches are masked (transformers draws its own otherwise)."""
    g = torch.Generator().manual_seed(seed)
    size, channels = limits["image_size"], limits["in_channels"]
    return {"pixel_values": torch.randn(B, channels, size, size, generator=g),
            "noise": torch.rand(B, config.num_patches, generator=g)}


def _batch(x) -> int:
    return x["pixel_values"].size(0)


if "masked-image-model" not in KINDS:
    register_kind("masked-image-model", modality="image", example=_example,
                  outputs=("loss", "logits", "mask", "ids_restore"),
                  shapes=lambda c, x: ((), (_batch(x), c.num_patches, c.patch_size ** 2 * c.in_channels),
                                       (_batch(x), c.num_patches), (_batch(x), c.num_patches)),
                  does="forward(pixel_values (B, C, H, W), noise (B, P) = None) -> (reconstruction loss, logits "
                       "(B, P, p*p*C), mask (B, P), ids_restore (B, P)): masked-image pre-training")
if "masked-image-base" not in KINDS:
    register_kind("masked-image-base", modality="image", example=_example,
                  outputs=("last_hidden_state", "mask", "ids_restore"),
                  shapes=lambda c, x: ((_batch(x), 1 + c.visible, c.d_model), (_batch(x), c.num_patches),
                                       (_batch(x), c.num_patches)),
                  does="forward(pixel_values (B, C, H, W), noise (B, P) = None) -> (the last hidden state of the "
                       "class token and the visible patches (B, 1 + K, E), mask (B, P), ids_restore (B, P))")

VIT_MAE = register_family("vit_mae", ViTMAEConfig, base_rules=vit_rules(), config_from_hf=mae_config_from_hf,
                          config_to_hf=mae_config_to_hf, presets=PRESETS, build_config=build_config, modality="image",
                          limits=lambda c: {"image_size": c.image_size, "patch_size": c.patch_size,
                                            "in_channels": c.in_channels}, options=OPTIONS)
VIT_MAE.register("ViTMAEForPreTraining", ViTMAEForPreTraining, kind="masked-image-model", prefix="vit.",
                 head_rules=_decoder_rules(), default=True)
VIT_MAE.register("ViTMAEModel", ViTMAEModel, kind="masked-image-base")
