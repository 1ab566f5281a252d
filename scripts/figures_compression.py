"""The compression lesson's figures (docs/compression.md): weight error against bits and group
size, and one layer's output error against sparsity for magnitude and Wanda. Seeded, a second."""
from __future__ import annotations

import numpy as np
import torch

from figure_common import plt, save_figure

from attnlab.compress import dequantize, prune_mask, quantize_rtn

GROUPS = (32, 64, 128, 256, 1024)
SPARSITIES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)


def data_quant_error() -> dict:
    """Relative error ||W - Q(W)|| / ||W|| of heavy-tailed weights (Student-t, 4 degrees of freedom,
    64 x 1024) for each layout against the group size (1024: one group per row)."""
    t = torch.distributions.StudentT(4.0)
    torch.manual_seed(0)
    w = t.sample((64, 1024)) * 0.02
    out = {"group": np.array(GROUPS, dtype=np.float64)}
    for layout in ("q4_0", "q4_1", "q8_0"):
        out[layout] = np.array([float((w - dequantize(*quantize_rtn(w, layout, s))).norm() / w.norm())
                                for s in GROUPS])
    return out


def data_prune_error() -> dict:
    """One layer (64 x 256) on inputs where a tenth of the features are 20 times larger (as in LLMs'
    activations): relative output error ||X W^T - X (M * W)^T|| / ||X W^T|| against sparsity."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 256, generator=g) * torch.where(torch.rand(256, generator=g) < 0.1, 20.0, 1.0)
    w = torch.randn(64, 256, generator=g)
    y, norms = x @ w.t(), x.norm(dim=0)
    out = {"sparsity": np.array(SPARSITIES)}
    for method in ("magnitude", "wanda"):
        out[method] = np.array([float((x @ (w * prune_mask(w, s, method, norms)).t() - y).norm() / y.norm())
                                for s in SPARSITIES])
    return out


def _lines(data, x, series, labels, path, log=False):
    """One line per series of ``data`` against ``data[x]``; ``labels``: (x label, y label)."""
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for (key, label), style in zip(series, ("o-", "s-", "^-")):
        ax.plot(data[x], data[key], style, ms=4, label=label)
    if log:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
    ax.set_xlabel(labels[0])
    ax.set_ylabel(labels[1])
    ax.legend(fontsize=8)
    save_figure(fig, path)


def draw_quant_error(data, path):
    _lines(data, "group", [(k, k) for k in ("q4_0", "q4_1", "q8_0")],
           ("group size (weights sharing one scale; 1024 = one per row)", "relative weight error"), path, log=True)


def draw_prune_error(data, path):
    _lines(data, "sparsity", [("magnitude", "magnitude (|W|, per layer)"), ("wanda", "Wanda (|W| x ||X_j||, per row)")],
           ("sparsity (fraction of weights removed)", "relative output error of the layer"), path)


TEMPERATURES = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)


def data_distill_temperature() -> dict:
    """Distillation's soft term (attnlab.train.losses.distillation_loss, alpha = 1) for one position
    of seeded logits over 12 tokens: the teacher's softened distribution at T = 1, 2, 4 (left), and
    the norm of the soft term's gradient on the student's logits against T, with the T^2 factor and
    without it (right)."""
    from attnlab.train.losses import distillation_loss
    g = torch.Generator().manual_seed(0)
    teacher, student = torch.randn(1, 12, generator=g) * 3.0, torch.randn(1, 12, generator=g) * 3.0
    target = teacher.argmax(-1)
    out = {"rank": np.arange(12, dtype=np.float64), "temperature": np.array(TEMPERATURES)}
    order = teacher[0].argsort(descending=True)
    for t in (1.0, 2.0, 4.0):
        out[f"p_T{t:g}"] = torch.softmax(teacher[0, order] / t, -1).double().numpy()
    with_t2, without = [], []
    for t in TEMPERATURES:
        s = student.clone().requires_grad_(True)
        loss = distillation_loss(s, teacher, target, temperature=t, alpha=1.0)
        (grad,) = torch.autograd.grad(loss, s)
        with_t2.append(float(grad.norm()))
        without.append(float(grad.norm()) / t ** 2)           # the same term without its T^2 factor
    out["grad_with_t2"], out["grad_without_t2"] = np.array(with_t2), np.array(without)
    return out


def draw_distill_temperature(data, path):
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.2))
    for (t, style) in zip((1, 2, 4), ("o-", "s-", "^-")):
        left.plot(data["rank"], data[f"p_T{t}"], style, ms=4, label=f"T = {t}")
    left.set_xlabel("teacher's tokens, most likely first")
    left.set_ylabel("softmax(t / T)")
    left.legend(fontsize=8)
    right.plot(data["temperature"], data["grad_with_t2"], "o-", ms=4, label="T² · KL (attnlab's loss)")
    right.plot(data["temperature"], data["grad_without_t2"], "s-", ms=4, label="KL alone")
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("temperature T")
    right.set_ylabel("‖gradient on student logits‖")
    right.legend(fontsize=8)
    save_figure(fig, path)
