"""RoPE settings between a Hugging Face config.json and our configs: transformers 5.x's
``rope_parameters`` and 4.x's ``rope_theta`` + ``rope_scaling`` in, ``rope_parameters`` out
(used by every family built on LLaMA's skeleton; the kinds themselves are :mod:`attnlab.nn.rope`)."""
from __future__ import annotations

__all__ = ["rope_from_hf", "rope_to_hf"]


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
