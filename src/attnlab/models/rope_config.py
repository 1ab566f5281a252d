"""RoPE settings between a Hugging Face config.json and our configs: transformers 5.x's
``rope_parameters`` and 4.x's ``rope_theta`` + ``rope_scaling`` in, ``rope_parameters`` out
(used by every family built on LLaMA's skeleton; the kinds themselves are :mod:`attnlab.nn.rope`),
and :func:`stretch_context`, which rescales a loaded model's RoPE to read past its trained context."""
from __future__ import annotations

__all__ = ["rope_from_hf", "rope_to_hf", "stretch_context", "STRETCH_TYPES"]

STRETCH_TYPES = ("default", "linear", "yarn")


def rope_from_hf(c: dict, who: str, params: dict | None = None) -> dict:
    """Our rope_theta, rope_scaling and partial_rotary_factor from a config.json ``c``: from
    ``params`` (one layer type's entry of a nested ``rope_parameters``) or transformers 5.x's
    ``rope_parameters``, or 4.x's ``rope_scaling``, with ``rope_theta`` and ``partial_rotary_factor``
    from the top level where the dict lacks them. For llama3, yarn and longrope a top-level
    ``original_max_position_embeddings`` (Phi-3 keeps it there) wins over the dict's, as in
    transformers; without either it is max_position_embeddings."""
    rope = dict(params if params is not None else c.get("rope_parameters") or c.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in rope.values()):
        raise ValueError(f"{who}: per-layer-type RoPE parameters are not supported by this family")
    theta = rope.pop("rope_theta", None) or c.get("rope_theta")
    partial = rope.pop("partial_rotary_factor", None) or c.get("partial_rotary_factor")
    kind = rope.get("rope_type") or rope.get("type") or "default"
    rope.pop("type", None)
    if kind in ("llama3", "yarn", "longrope"):
        top = c.get("original_max_position_embeddings")
        rope["original_max_position_embeddings"] = top if top is not None else \
            rope.get("original_max_position_embeddings") or c["max_position_embeddings"]
    out = {"rope_scaling": None if kind == "default" else {**rope, "rope_type": kind}}
    if theta is not None:
        out["rope_theta"] = float(theta)
    if partial is not None:
        out["partial_rotary_factor"] = float(partial)
    return out


def rope_to_hf(theta: float, scaling: dict | None, partial_rotary_factor: float = 1.0) -> dict:
    """transformers' ``rope_parameters`` for our base, scaling and partial rotary factor."""
    rope = {"rope_type": "default", "rope_theta": theta, **(scaling or {})}
    if rope["rope_type"] == "ntk":
        raise ValueError(f"static NTK RoPE scaling {scaling} has no Hugging Face equivalent")
    if partial_rotary_factor != 1.0:
        rope["partial_rotary_factor"] = partial_rotary_factor
    return rope


def stretch_context(model, factor: float, rope_type: str = "yarn"):
    """Let ``model`` (a family built on LLaMA's skeleton, with plain RoPE) read ``factor`` times its
    trained context ``max_position_embeddings`` L0, in place; returns the model.

    ``rope_type``: ``linear`` divides every frequency by the factor (position interpolation, Chen et
    al. 2023); ``yarn`` interpolates the low frequencies only and sharpens the scores (Peng et al.
    2023), with ``original_max_position_embeddings`` L0; ``default`` keeps the frequencies and only
    lifts the bound (extrapolation, the baseline the other two are measured against). The config
    becomes what transformers reads for the same stretch (``rope_parameters`` and
    ``max_position_embeddings`` = factor L0), so save_pretrained writes a checkpoint it loads alike.
    """
    who = f"stretch_context({type(model).__name__})"
    c = getattr(model, "config", None)
    shared = getattr(model, "rotary_emb", None)
    users = [layer.self_attn for layer in getattr(model, "layers", ())
             if shared is not None and getattr(getattr(layer, "self_attn", None), "position", None) is shared]
    if not users or not hasattr(model, "rotary") or not hasattr(c, "rope_scaling"):
        raise ValueError(f"{who}: not a model whose layers share LLaMA's rotary embedding")
    if rope_type not in STRETCH_TYPES:
        raise ValueError(f"{who}: rope_type must be one of {', '.join(STRETCH_TYPES)}, got {rope_type!r}")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 1:
        raise ValueError(f"{who}: factor must be a number >= 1, got {factor!r}")
    if c.rope_scaling is not None:
        raise ValueError(f"{who}: RoPE is already scaled ({c.rope_scaling['rope_type']}); stretch plain RoPE only")
    old = c.max_position_embeddings
    scaling = None if rope_type == "default" else {"rope_type": rope_type, "factor": float(factor)}
    if rope_type == "yarn":
        scaling["original_max_position_embeddings"] = old
    c.rope_scaling, c.max_position_embeddings = scaling, int(old * factor)
    c.__post_init__()                                   # normalises and checks the scaling
    model.rotary_emb = model.rotary(c.rope_theta, c.rope_scaling)
    for attn in users:                                  # a layer without positions (NoPE) keeps none
        attn.position = model.rotary_emb
    return model
