"""The table of docs/llms.md: what each decoder family of the registry changes from LLaMA's
skeleton, read off a model built from the family's ``tiny`` preset (so the table says what the code
builds, and tests/test_llms_page.py checks that the page holds this script's output).

Usage: python scripts/llm_table.py     (prints the Markdown table)
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from attnlab.models import registry  # noqa: E402
from attnlab.nn.latent_attention import MultiHeadLatentAttention  # noqa: E402
from attnlab.nn.mlp import SparseMoE  # noqa: E402
from attnlab.nn.position import RotaryEmbedding  # noqa: E402

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "smollm3",
            "llama4_text", "deepseek_v3"]
COLUMNS = ["family", "q/k/v bias", "q/k norm", "sliding or chunked layers", "layers without RoPE",
           "score soft-cap", "norm gain", "norms after sub-blocks", "fused q/k/v", "MoE layers", "latent attention"]


def _yes(flag: bool) -> str:
    return "yes" if flag else "-"


def features(model_type: str) -> list[str]:
    """One row: the family's features, read off a model built from its tiny preset."""
    fam = registry.family(model_type)
    arch = next(iter(fam.architectures.values()))
    model = arch.build(fam.config_cls(**fam.presets["tiny"]))
    layers = list(model.layers)
    attns = [layer.self_attn for layer in layers]
    first = attns[0]
    proj = getattr(first, "q_proj", None) or getattr(first, "qkv_proj", None)
    moe = sum(isinstance(layer.ff, SparseMoE) for layer in layers)
    norm = layers[0].ff_norm if hasattr(layers[0], "ff_norm") else None
    gain = "1 + w" if getattr(norm, "unit_offset", False) else "w"
    # a family's own position module (Llama 4's) may hold the RoPE, the chunk and an L2 q/k norm
    pos = [getattr(a, "position", None) for a in attns]
    local = sum(getattr(a, "window", None) is not None or getattr(a, "chunk", None) is not None
                or getattr(p, "chunk", None) is not None for a, p in zip(attns, pos))
    no_rope = sum(p is None or not isinstance(p, RotaryEmbedding) and getattr(p, "rope", 0) is None for p in pos)
    qk_norm = getattr(first, "q_norm", None) is not None or getattr(pos[0], "qk_norm_eps", None) is not None
    after = any(getattr(layer, "ff_out_norm", None) is not None for layer in layers)
    return [f"`{model_type}`", _yes(proj is not None and proj.bias is not None),
            _yes(qk_norm),
            f"{local} of {len(layers)}" if local else "-", f"{no_rope} of {len(layers)}" if no_rope else "-",
            _yes(getattr(first, "softcap", None) is not None), gain, _yes(after),
            _yes(getattr(first, "fused_qkv", False)), f"{moe} of {len(layers)}" if moe else "-",
            _yes(isinstance(first, MultiHeadLatentAttention))]


def table() -> str:
    rows = [COLUMNS, ["---"] * len(COLUMNS)] + [features(m) for m in FAMILIES]
    return "\n".join("| " + " | ".join(r) + " |" for r in rows) + "\n"


if __name__ == "__main__":
    print(table(), end="")
