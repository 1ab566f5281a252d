"""The metrics file a training run writes (metrics.jsonl) and the loss plot drawn from it."""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["read_metrics", "plot_metrics"]

def read_metrics(jsonl: str | Path) -> list[dict]:
    """The records of a metrics.jsonl file (a torn last line, from a crash, is skipped)."""
    records = []
    for line in Path(jsonl).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def plot_metrics(jsonl: str | Path, png: str | Path) -> Path:
    """Draw the training loss (and eval losses) against the step from ``jsonl`` into ``png``;
    other eval metrics (BLEU, accuracy) go to a second panel. Uses matplotlib's Agg canvas
    directly, so no GUI backend and no global pyplot state are touched."""
    from matplotlib.figure import Figure

    records = read_metrics(jsonl)
    train = [r for r in records if r.get("kind", "train") == "train" and "loss" in r]
    evals = [r for r in records if r.get("kind") == "eval"]
    skip = {"kind", "step", "elapsed"}
    eval_keys = sorted({k for r in evals for k in r if k not in skip})
    loss_keys = [k for k in eval_keys if "loss" in k or "ppl" in k]
    other_keys = [k for k in eval_keys if k not in loss_keys]
    fig = Figure(figsize=(7, 6 if other_keys else 4), layout="constrained")
    axes = fig.subplots(2 if other_keys else 1, 1, squeeze=False)[:, 0]
    axes[0].plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    for key in loss_keys:
        pts = [(r["step"], r[key]) for r in evals if key in r]
        axes[0].plot(*zip(*pts), marker="o", label=key)
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("loss")
    axes[0].legend()
    for key in other_keys:
        pts = [(r["step"], r[key]) for r in evals if key in r]
        axes[1].plot(*zip(*pts), marker="o", label=key)
    if other_keys:
        axes[1].set_xlabel("step")
        axes[1].legend()
    png = Path(png)
    tmp = png.with_name(f".{png.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    tmp.replace(png)
    return png
