"""The metrics file a training run writes (metrics.jsonl) and the loss plot drawn from it, and the
classification scores every task that predicts classes reports."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch

__all__ = ["read_metrics", "plot_metrics", "classification_scores", "format_scores"]

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


def classification_scores(gold: Sequence[int], pred: Sequence[int], num_classes: int) -> dict:
    """Accuracy and macro-F1 in %, per-class precision, recall and F1 (in %, 0 for a class never
    predicted or never present) and the confusion matrix (row = true class, column = predicted)."""
    confusion = torch.zeros(num_classes, num_classes, dtype=torch.long)
    for g, p in zip(gold, pred):
        confusion[g, p] += 1
    tp = confusion.diag().double()
    predicted, actual = confusion.sum(0).double(), confusion.sum(1).double()
    precision = torch.where(predicted > 0, tp / predicted.clamp(min=1), torch.zeros_like(tp))
    recall = torch.where(actual > 0, tp / actual.clamp(min=1), torch.zeros_like(tp))
    f1 = torch.where(precision + recall > 0, 2 * precision * recall / (precision + recall).clamp(min=1e-12),
                     torch.zeros_like(tp))
    n = int(confusion.sum())
    return {"n": n, "accuracy": 100.0 * float(tp.sum()) / max(n, 1), "macro_f1": 100.0 * float(f1.mean()),
            "precision": (100 * precision).tolist(), "recall": (100 * recall).tolist(), "f1": (100 * f1).tolist(),
            "support": actual.long().tolist(), "confusion": confusion}


def format_scores(scores: dict, labels: Sequence[str]) -> str:
    """The scores as ``attnlab eval`` prints them: a summary line and a per-class table."""
    width = max(8, *(len(x) for x in labels))
    rows = [f"accuracy {scores['accuracy']:.2f}%  macro-F1 {scores['macro_f1']:.2f}",
            f"  {'class':<{width}}  precision  recall     F1  support"]
    for i, label in enumerate(labels):
        rows.append(f"  {label:<{width}}  {scores['precision'][i]:9.2f}  {scores['recall'][i]:6.2f}  "
                    f"{scores['f1'][i]:5.2f}  {scores['support'][i]:7d}")
    return "\n".join(rows)
