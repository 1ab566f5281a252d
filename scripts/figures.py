"""Draw the walk-through's figures from attnlab's own code into docs/figures/.

    PYTHONPATH=src .venv/bin/python scripts/figures.py            # every figure
    PYTHONPATH=src .venv/bin/python scripts/figures.py masks rope  # some of them

Each figure is two functions: ``data_NAME()`` computes the numbers the figure shows with attnlab
(seeded; a second or less, 8.4's accumulation, which trains three tiny runs, about two),
``draw_NAME(data, path)`` plots them with matplotlib's Agg backend.
docs/figures/manifest.json records, per figure, the page that embeds it, a fingerprint of its
data (up to 64 of its numbers) and the PNG's SHA-256. tests/test_figures.py recomputes each
fingerprint and compares it with the manifest, so a figure whose numbers attnlab no longer
produces fails the suite; PNG bytes are not compared across machines (fonts differ), only
against the manifest that was written with them.

Six figures are measured from trained runs, and their manifest entries name the run and the
numbers the pages quote instead of a fingerprint (the test cannot retrain them): the alignment
from a translation run (``--run DIR``, else ``runs/translate`` when the main job has run
(scripts/main.sh), else a short seeded run trained here: 150 steps, about a minute on an idle
two-core CPU), and the vision page's position similarity, class-token attention and a screenshot
of the explorer's image view (headless Chromium, /usr/bin/chromium through Selenium) from one
digits ViT (``--vision-run DIR``, else ``attnlab train image --steps 800 --seed 0 --image-size 16
--patch-size 2 --ema 0`` trained here, about three minutes on one idle core). scripts/figures_vision.py
holds the vision page's figures, scripts/figures_lessons.py those of the sections that had none,
scripts/figures_multimodal.py the multimodal page's three (from a clip, a vlm and a speech run:
``--clip-run``, ``--vlm-run``, ``--speech-run``, else trained here), scripts/figure_common.py what
the modules share.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))   # the sibling modules below, however this is run
from figure_common import fitted_top as _fitted_top, heatmap as _heatmap, plt, save_figure as _save  # noqa: E402
from figures_lessons import (DECODER_BLOCKS, ENCODER_BLOCKS, architecture_figure,  # noqa: E402,F401
                             data_architecture, draw_architecture,
                             data_accumulation, data_block_stream, data_encoder_influence,
                             data_ffn_width, data_parameter_budget, data_position_offset, data_shapes,
                             data_torch_parity, draw_accumulation, draw_block_stream, draw_encoder_influence,
                             draw_ffn_width, draw_parameter_budget, draw_position_offset, draw_shapes,
                             draw_torch_parity, shapes_figure)
from figures_llms import data_rope_types, draw_rope_types  # noqa: E402,F401
from figures_compression import (data_distill_temperature, data_prune_error, data_quant_error,  # noqa: E402,F401
                                 draw_distill_temperature, draw_prune_error,
                                 draw_quant_error)
from figures_multimodal import (CLIP_COMMAND, SPEECH_COMMAND, VLM_COMMAND, clip_space,  # noqa: E402,F401
                                speech_attention, vlm_attention)
from figures_vision import (VISION_COMMAND, class_attention, data_mae_masking, data_patches,  # noqa: E402,F401
                            draw_mae_masking, draw_patches, explorer_image_view, position_similarity,
                            position_similarity_data)

from attnlab.nn import (causal_mask, combine_masks, padding_mask,  # noqa: E402
                        scaled_dot_product_attention)
from attnlab.nn.block import EncoderLayer  # noqa: E402
from attnlab.nn.position import RotaryEmbedding, sinusoidal_table  # noqa: E402
from attnlab.train.schedules import noam  # noqa: E402
from attnlab.viz.views import text_views  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ROOT / "docs" / "figures"
MANIFEST = FIGURES / "manifest.json"
SSM_SENTENCE = "the cat sat on the mat because the mat was warm"
ALIGN_SENTENCE = "when the old teacher sees forty-seven red birds , the girl helps the dog"


# --------------------------------------------------------------------------- data

def data_hand_example() -> dict:
    """The chapter's section 1.4 example (seed 42, three tokens, d_k = 4): its weights."""
    torch.manual_seed(42)
    Q, K, V = torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4)
    _, w = scaled_dot_product_attention(Q, K, V, return_weights=True)
    return {"weights": w.numpy()}


def data_scaling() -> dict:
    """Mean largest softmax weight of random unit-variance q, k, with and without 1/sqrt(d_k)."""
    g = torch.Generator().manual_seed(0)
    dims = [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    scaled, unscaled = [], []
    for d in dims:
        q, k = torch.randn(256, d, generator=g), torch.randn(16, d, generator=g)
        v = torch.zeros(16, 1)
        _, ws = scaled_dot_product_attention(q, k, v, return_weights=True)
        _, wu = scaled_dot_product_attention(q, k, v, scale=1.0, return_weights=True)
        scaled.append(ws.max(-1).values.mean().item())
        unscaled.append(wu.max(-1).values.mean().item())
    return {"d_k": np.array(dims, dtype=np.float64), "scaled": np.array(scaled), "unscaled": np.array(unscaled)}


def data_masks() -> dict:
    """Padding (the second sentence has two pads), causal, and the two combined, for batch row 1."""
    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 0, 0]])
    pad = padding_mask(ids, pad_id=0)                         # (B, S), True = real token
    padding = pad[1][None, :].expand(5, 5)                    # as seen by every query of row 1
    causal = causal_mask(5)
    combined = combine_masks(pad[:, None, None, :], causal)[1, 0]
    return {"padding": padding.float().numpy(), "causal": causal.float().numpy(),
            "combined": combined.float().numpy()}


def data_sinusoidal() -> dict:
    return {"table": sinusoidal_table(64, 64).numpy()}


def data_rope() -> dict:
    """q . k after RoPE for the same vector at every distance m - n (head_dim 64)."""
    g = torch.Generator().manual_seed(0)
    rope = RotaryEmbedding(64)
    distances = torch.arange(0, 128)
    out = {"distance": distances.double().numpy()}
    for name, x in (("ones", torch.ones(1, 1, 1, 64)), ("random", torch.randn(1, 1, 1, 64, generator=g))):
        q, _ = rope.transform(x, x, torch.tensor([0]))                       # the query at position 0
        row = x.expand(1, 1, 128, 64)
        k, _ = rope.transform(row, row, distances)                           # the same vector at 0..127
        out[name] = (q @ k.transpose(-1, -2))[0, 0, 0].numpy()
    return out


def data_warmup() -> dict:
    steps = np.arange(1, 20001)
    lr = {w: np.array([noam(int(s), 512, w) for s in steps[::50]]) for w in (1000, 4000, 8000)}
    return {"step": steps[::50].astype(np.float64), "w1000": lr[1000], "w4000": lr[4000], "w8000": lr[8000]}


def _layer_grad_norms(norm_first: bool, depth: int, seed: int) -> list[float]:
    torch.manual_seed(seed)
    d = 64
    layers = torch.nn.ModuleList([EncoderLayer(d, 4, 4 * d, dropout=0.0, norm_first=norm_first)
                                  for _ in range(depth)])
    final = torch.nn.LayerNorm(d) if norm_first else torch.nn.Identity()
    head = torch.nn.Linear(d, 100)
    x = torch.randn(8, 32, d)
    target = torch.randint(0, 100, (8, 32))
    h = x
    for layer in layers:
        h = layer(h)
    loss = torch.nn.functional.cross_entropy(head(final(h)).flatten(0, 1), target.flatten())
    loss.backward()
    return [math.sqrt(sum(float(p.grad.pow(2).sum()) for p in layer.parameters())) for layer in layers]


def data_norm_gradients() -> dict:
    """Gradient norm of each layer's parameters at initialisation, 12 layers, mean of 3 seeds."""
    depth = 12
    post = np.mean([_layer_grad_norms(False, depth, s) for s in range(3)], axis=0)
    pre = np.mean([_layer_grad_norms(True, depth, s) for s in range(3)], axis=0)
    return {"layer": np.arange(1, depth + 1, dtype=np.float64), "post_norm": post, "pre_norm": pre}


def data_soft_lookup() -> dict:
    """Section 1.1 / the article's example: q = [1, 0, 1] against three keys. A dictionary's hard
    lookup returns the value of the one matching key; attention's soft lookup weighs every value."""
    q = torch.tensor([[1., 0., 1.]])
    K = torch.tensor([[1., 1., 0.], [1., 0., 1.], [0., 1., 0.]])
    V = torch.tensor([[1., 0.], [0., 1.], [1., 1.]])
    out, w = scaled_dot_product_attention(q, K, V, return_weights=True)
    hard = torch.nn.functional.one_hot(w.argmax(-1), 3).float()
    return {"scores": (q @ K.T / math.sqrt(3))[0].numpy(), "weights": w[0].numpy(), "hard": hard[0].numpy(),
            "soft_out": out[0].numpy(), "hard_out": (hard @ V)[0].numpy()}


HEADS_SENTENCE = "the cat sat on the mat"


def data_heads() -> dict:
    """Sections 2.1-2.3: one seeded MultiHeadAttention(32, 4) over six word vectors (no positions),
    its (H, T, S) weights recorded per head. Untrained: what it shows is the mechanism (each
    head its own distribution per row; the two "the" identical without positions)."""
    from attnlab.nn import MultiHeadAttention
    from attnlab.viz import record_attention
    words = HEADS_SENTENCE.split()
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
    torch.manual_seed(0)
    embed = torch.nn.Embedding(len(vocab), 32)
    mha = MultiHeadAttention(32, 4).eval()
    x = embed(torch.tensor([[vocab[w] for w in words]]))            # (B=1, T=6, E=32)
    with torch.no_grad(), record_attention(mha) as record:
        mha(x)
    return {"weights": record.weights(0)[0].numpy()}                # (H=4, T=6, S=6)


def data_mlm_masking() -> dict:
    """Section 6.1: BERT's 80/10/10 rule as attnlab.data.mask_tokens applies it, counted over
    64 x 512 ordinary tokens (ids 5..999; 0-4 special, 4 = [MASK])."""
    from attnlab.data.masking import IGNORE_INDEX, mask_tokens
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 1000, (64, 512), generator=g)
    inputs, labels = mask_tokens(ids, mask_id=4, vocab_size=1000, special_ids=range(5), generator=g)
    selected = labels != IGNORE_INDEX
    masked, kept = selected & (inputs == 4), selected & (inputs == ids)
    swapped = selected & ~masked & ~kept
    n = int(selected.sum())
    row = np.where(masked[0, :48], 1, np.where(swapped[0, :48], 2, np.where(kept[0, :48], 3, 0)))
    return {"selected": np.array([n / ids.numel()]),
            "shares": np.array([int(masked.sum()) / n, int(swapped.sum()) / n, int(kept.sum()) / n]),
            "row": row.astype(np.float64)}


def _score_entries(model, prompt, new_tokens: int, use_cache: bool) -> list[int]:
    from attnlab.viz import record_attention
    with torch.no_grad(), record_attention(model) as record:
        model.generate(prompt, new_tokens, use_cache=use_cache)
    return [int(c.weights.shape[-2] * c.weights.shape[-1]) for c in record.select(layer=0)]


def data_kv_cache() -> dict:
    """Sections 6.2/6.6: score entries (T x S per head) the first layer of a seeded "tiny" GPT
    computes for each forward while generating 24 tokens from a 4-token prompt, with the KV cache
    (a prefill, then one query per step) and without it (the whole prefix again every step),
    read off attnlab's per-call attention records."""
    from attnlab.models.gpt import GPT, GPTConfig
    from attnlab.models.gpt import PRESETS as GPT_PRESETS
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(**GPT_PRESETS["tiny"])).eval()
    prompt = torch.tensor([[5, 6, 7, 8]])
    cached, full = _score_entries(gpt, prompt, 24, True), _score_entries(gpt, prompt, 24, False)
    return {"cached": np.array(cached, dtype=np.float64), "recomputed": np.array(full, dtype=np.float64)}


def data_kv_memory() -> dict:
    """Long context: bytes a "tiny" LLaMA's decoding state holds after L tokens, L = 32 .. 512, for
    each cache kind (full, sliding window 64, sink 4 + 60, int8, int4 with 32 full-precision
    recent tokens), read with attnlab.nn.kv_cache.cache_bytes after streaming L tokens."""
    from attnlab.generate import stream_logits
    from attnlab.models.llama import LLAMA
    from attnlab.nn.kv_cache import KVCacheKind, cache_bytes
    torch.manual_seed(0)
    model = LLAMA.architecture(None).build(LLAMA.preset("tiny", max_position_embeddings=1024)).eval()
    lengths = np.arange(32, 513, 32)
    kinds = {"full": KVCacheKind("full"), "sliding": KVCacheKind("sliding", window=64),
             "sink": KVCacheKind("sink", window=60, sink_tokens=4), "int8": KVCacheKind("int8"),
             "int4": KVCacheKind("int4")}
    ids = torch.randint(0, 96, (1, int(lengths[-1])), generator=torch.Generator().manual_seed(0))
    data = {"length": lengths.astype(np.float64)}
    for name, kind in kinds.items():
        sizes = []
        with torch.no_grad():
            for L in lengths:
                sizes.append(cache_bytes(stream_logits(model, ids[:, :int(L)], 32, kind)))
        data[name] = np.array(sizes, dtype=np.float64)
    return data


def data_t5_buckets() -> dict:
    """Section 6.5: T5's bucket of every relative position (key - query) from -160 to 160."""
    from attnlab.nn.position import relative_position_bucket
    rel = torch.arange(-160, 161)
    return {"relative": rel.double().numpy(), "bidirectional": relative_position_bucket(rel).double().numpy(),
            "causal": relative_position_bucket(rel, bidirectional=False).double().numpy()}


def data_extrapolation() -> dict:
    """Section 8.2 (erratum 12): a sinusoidal table for E = 512 whose model trained on positions
    0..511: the share of the 512 channels that hold, at each later position, a value outside the
    range that channel took in training."""
    d, trained = 512, 512
    table = sinusoidal_table(4 * trained, d)
    lo, hi = table[:trained].min(0).values, table[:trained].max(0).values
    outside = ((table < lo - 1e-3) | (table > hi + 1e-3)).double().mean(-1)
    return {"position": np.arange(4 * trained, dtype=np.float64)[::8], "outside": outside.numpy()[::8]}


# --------------------------------------------------------------------------- drawing

def data_implicit_attention() -> dict:
    """The last layer of a seeded, untrained GPT and Mamba-2 (their "tiny" presets, 4 heads each)
    on one sentence of word ids: the GPT's softmax weights and the magnitude of the Mamba-2's
    implicit attention (attnlab.viz.implicit), both through the explorer's own views."""
    from attnlab.models.gpt import GPT, GPTConfig
    from attnlab.models.gpt import PRESETS as GPT_PRESETS
    from attnlab.models.mamba2 import PRESETS as MAMBA2_PRESETS
    from attnlab.models.mamba2 import Mamba2, Mamba2Config
    words = SSM_SENTENCE.split()
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
    ids = [vocab[w] for w in words]
    out = {}
    for name, build in (("gpt", lambda: GPT(GPTConfig(**GPT_PRESETS["tiny"]))),
                        ("mamba2", lambda: Mamba2(Mamba2Config(**MAMBA2_PRESETS["tiny"])))):
        torch.manual_seed(0)
        (view,) = text_views(build(), ids, words)
        out[name] = (view.weights[-1] / view.scale).numpy()
    return out


def draw_implicit_attention(data, path):
    words = SSM_SENTENCE.split()
    heads = data["gpt"].shape[0]
    fig, axes = plt.subplots(2, heads, figsize=(3.0 * heads, 6.4))
    for row, (key, what) in enumerate((("gpt", "GPT attention"), ("mamba2", "Mamba-2 implicit attention"))):
        for h in range(heads):
            ax = axes[row][h]
            w = data[key][h]
            ax.imshow(w / max(float(w.max()), 1e-12), cmap="viridis", vmin=0.0)
            ax.set_xticks(range(len(words)), labels=words, rotation=90, fontsize=6)
            ax.set_yticks(range(len(words)), labels=words, fontsize=6)
            ax.set_title(f"{what}, head {h + 1}", fontsize=8)
    fig.suptitle("last layer, untrained, seeded: rows attend to columns (each panel scaled by its largest entry)",
                 fontsize=9)
    _save(fig, path)


def draw_hand_example(data, path):
    w = data["weights"]
    fig, ax = plt.subplots(figsize=(4, 3.4))
    im = _heatmap(ax, w, ["k0", "k1", "k2"], ["q0", "q1", "q2"], "softmax(QKᵀ/√4), seed 42")
    for i in range(3):
        for j in range(3):
            ax.text(j, i, f"{w[i, j]:.2f}", ha="center", va="center", color="w" if w[i, j] < 0.6 else "k")
    fig.colorbar(im, ax=ax)
    _save(fig, path)


def draw_scaling(data, path):
    fig, ax = plt.subplots(figsize=(5, 3.4))
    ax.semilogx(data["d_k"], data["unscaled"], "o-", label="unscaled: softmax(q·k)")
    ax.semilogx(data["d_k"], data["scaled"], "s-", label="scaled: softmax(q·k/√d_k)")
    ax.axhline(1 / 16, color="grey", lw=0.8, ls=":", label="uniform over 16 keys")
    ax.set_xlabel("d_k")
    ax.set_ylabel("mean largest weight")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8)
    _save(fig, path)


def draw_masks(data, path):
    fig, axes = plt.subplots(1, 3, figsize=(9, 3.2))
    keys = [f"k{j}" for j in range(5)]
    queries = [f"q{i}" for i in range(5)]
    for ax, name in zip(axes, ("padding", "causal", "combined")):
        _heatmap(ax, data[name], keys, queries, f"{name} (True = may attend)")
    _save(fig, path)


def draw_sinusoidal(data, path):
    fig, ax = plt.subplots(figsize=(6, 3.6))
    im = ax.imshow(data["table"], cmap="RdBu", vmin=-1, vmax=1, aspect="auto")
    ax.set_xlabel("channel (even: sin, odd: cos)")
    ax.set_ylabel("position")
    fig.colorbar(im, ax=ax)
    _save(fig, path)


def draw_rope(data, path):
    fig, ax = plt.subplots(figsize=(6, 3.4))
    ax.plot(data["distance"], data["ones"], label="q = k = all ones")
    ax.plot(data["distance"], data["random"], label="q = k = one random vector", alpha=0.8)
    ax.set_xlabel("distance m - n")
    ax.set_ylabel("q_m · k_n after RoPE")
    ax.legend(fontsize=8)
    _save(fig, path)


def draw_warmup(data, path):
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for w in (1000, 4000, 8000):
        ax.plot(data["step"], data[f"w{w}"], label=f"warmup = {w}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("learning rate (d_model = 512)")
    ax.legend(fontsize=8)
    _save(fig, path)


def draw_norm_gradients(data, path):
    fig, ax = plt.subplots(figsize=(6, 3.4))
    ax.plot(data["layer"], data["post_norm"], "o-", label="Post-Norm (the paper)")
    ax.plot(data["layer"], data["pre_norm"], "s-", label="Pre-Norm (+ final norm)")
    ax.set_yscale("log")
    ax.set_xlabel("layer (1 = next to the input)")
    ax.set_ylabel("‖∂loss/∂θ_layer‖ at initialisation")
    ax.legend(fontsize=8)
    _save(fig, path)


def draw_soft_lookup(data, path):
    keys = ["k0 [1,1,0]", "k1 [1,0,1]", "k2 [0,1,0]"]
    fig, axes = plt.subplots(1, 3, figsize=(9, 2.8))
    axes[0].bar(range(3), data["scores"], color="grey")
    axes[0].set_title("scores q·k/√3", fontsize=9)
    for ax, key, title in ((axes[1], "hard", "a dictionary: the one best key"),
                           (axes[2], "weights", "attention: softmax, every key a share")):
        ax.bar(range(3), data[key], color="tab:blue" if key == "weights" else "tab:orange")
        for j, v in enumerate(data[key]):
            ax.text(j, v + 0.02, f"{v:.2f}", ha="center", fontsize=8)
        out = data["soft_out"] if key == "weights" else data["hard_out"]
        ax.set_title(f"{title}\noutput = [{out[0]:.2f}, {out[1]:.2f}]", fontsize=9)
        ax.set_ylim(0, 1.15)
    for ax in axes:
        ax.set_xticks(range(3), labels=keys, fontsize=7)
    fig.suptitle("query q = [1, 0, 1]", fontsize=9)
    _save(fig, path)


def heads_figure(data):
    """The figure and what tests/test_figures.py checks: one colour scale for the four heads,
    fitted to their weights, with its bar, and each weight written in its cell."""
    words = HEADS_SENTENCE.split()
    w = data["weights"]
    top = _fitted_top(w)
    fig, axes = plt.subplots(1, w.shape[0] + 1, figsize=(3.0 * w.shape[0] + 0.6, 3.2),
                             gridspec_kw={"width_ratios": [1] * w.shape[0] + [0.06]})
    for h, ax in enumerate(axes[:-1]):
        im = _heatmap(ax, w[h], words, words, f"head {h + 1}", vmax=top)
        ax.tick_params(axis="x", rotation=90)
        for t in range(w.shape[1]):
            for s in range(w.shape[2]):
                ax.text(s, t, f"{w[h, t, s]:.2f}", ha="center", va="center", fontsize=6,
                        color="black" if w[h, t, s] > 0.6 * top else "white")
    bar = fig.colorbar(im, cax=axes[-1])
    bar.set_label(f"weight (scale 0 to {top:.2f})", fontsize=8)
    fig.suptitle("MultiHeadAttention(32, 4), seeded, untrained, no positions: rows (queries) attend to columns (keys)",
                 fontsize=9)
    return fig, top, bar


def draw_heads(data, path):
    fig, _, _ = heads_figure(data)
    _save(fig, path)


def draw_mlm_masking(data, path):
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 2.8), gridspec_kw={"width_ratios": [1, 2]})
    names = ["[MASK]", "random token", "unchanged"]
    left.bar(names, data["shares"], color=["tab:red", "tab:purple", "tab:green"])
    for j, v in enumerate(data["shares"]):
        left.text(j, v + 0.02, f"{v:.1%}", ha="center", fontsize=8)
    left.set_ylim(0, 1)
    left.set_title(f"the {data['selected'][0]:.1%} selected tokens, replaced by", fontsize=9)
    left.tick_params(axis="x", labelsize=8)
    cmap = matplotlib.colors.ListedColormap(["#eeeeee", "tab:red", "tab:purple", "tab:green"])
    right.imshow(data["row"][None, :], cmap=cmap, vmin=0, vmax=3, aspect="auto")
    right.set_yticks([])
    right.set_xlabel("position in the first sequence (grey: not selected, loss skips it)")
    right.set_title("which tokens one batch row predicts", fontsize=9)
    _save(fig, path)


def draw_kv_cache(data, path):
    fig, ax = plt.subplots(figsize=(6, 3.4))
    steps = np.arange(1, len(data["cached"]) + 1)
    ax.plot(steps, np.cumsum(data["recomputed"]), "o-", ms=3, label="no cache: the whole prefix every step")
    ax.plot(steps, np.cumsum(data["cached"]), "s-", ms=3, label="KV cache: one query per step")
    ax.set_xlabel("forward pass (1 = the prompt)")
    ax.set_ylabel("score entries computed, cumulative")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    _save(fig, path)


def draw_kv_memory(data, path):
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for name, style in (("full", "o-"), ("int8", "s-"), ("int4", "^-"), ("sink", "v-"), ("sliding", "d-")):
        ax.plot(data["length"], data[name] / 1024, style, ms=3, label=name)
    ax.set_xlabel("tokens read")
    ax.set_ylabel("cache, KiB (tiny LLaMA, fp32)")
    ax.legend(fontsize=8)
    _save(fig, path)


def draw_t5_buckets(data, path):
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    ax.step(data["relative"], data["bidirectional"], where="mid", label="encoder (bidirectional)")
    ax.step(data["relative"], data["causal"], where="mid", label="decoder (causal)")
    for d in (-128, -8, 8, 128):
        ax.axvline(d, color="grey", lw=0.6, ls=":")
    ax.set_xlabel("relative position (key - query)")
    ax.set_ylabel("bucket")
    ax.legend(fontsize=8)
    _save(fig, path)


def draw_extrapolation(data, path):
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(data["position"], 100 * data["outside"])
    ax.axvline(512, color="grey", lw=0.8, ls=":")
    ax.text(520, 5, "trained up to 511", fontsize=8, color="grey")
    ax.set_xlabel("position")
    ax.set_ylabel("% of channels outside the trained range")
    _save(fig, path)


# --------------------------------------------------------------------------- alignment (measured)

def _alignment_run(run: Path | None) -> tuple[Path, str]:
    if run is not None:
        import yaml
        settings = yaml.safe_load((run / "config.yaml").read_text())["settings"]
        return run, f"a run of attnlab train translate, {settings['steps']} steps, seed {settings['seed']}"
    main = ROOT / "runs" / "translate"
    if (main / "latest").exists():
        return main, "runs/translate (the main job)"
    out = Path(tempfile.mkdtemp(prefix="attnlab-figures-")) / "run"
    cmd = [sys.executable, "-m", "attnlab.cli", "train", "translate", "--out", str(out), "--steps", "150",
           "--seed", "0", "--no-progress"]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return out, "a short run: attnlab train translate --steps 150 --seed 0"


def alignment(path: Path, run: Path | None = None) -> dict:
    from attnlab.tasks import get_task, inspect_path
    from attnlab.viz.translation import cross_attention
    run, source = _alignment_run(run)
    info = inspect_path(str(run))
    task = get_task(info.run.task).load(info.run, "cpu")
    cross, src, tgt, translation = cross_attention(task.model, task.src_tok, task.tgt_tok, ALIGN_SENTENCE)
    w = cross.mean(dim=(0, 1))
    fig, ax = plt.subplots(figsize=(max(4.0, 0.35 * len(src) + 2), max(3.0, 0.3 * len(tgt) + 1.8)))
    im = ax.imshow(w.numpy(), cmap="viridis", vmin=0.0, aspect="auto")
    ax.set_xticks(range(len(src)), labels=src, rotation=90, fontsize=8)
    ax.set_yticks(range(len(tgt)), labels=tgt, fontsize=8)
    ax.set_xlabel("English (source)")
    ax.set_ylabel("German (produced)")
    ax.set_title("cross-attention, mean of layers and heads", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    _save(fig, path)
    return {"source": source, "translation": translation}


# --------------------------------------------------------------------------- manifest

FIGURES_BY_PAGE = {
    "hand_example": "attention.md", "scaling": "attention.md", "masks": "masks.md",
    "sinusoidal": "positions.md", "rope": "positions.md", "warmup": "trainer.md",
    "norm_gradients": "norms.md", "implicit_attention": "state-space.md",
    "soft_lookup": "attention.md", "heads": "multi-head-attention.md", "mlm_masking": "bert.md",
    "kv_cache": "causal-lm.md", "t5_buckets": "t5.md", "patches": "vision.md", "mae_masking": "vision.md",
    "extrapolation": "positions.md", "encoder_influence": "encoder-decoder.md", "ffn_width": "feed-forward.md",
    "position_offset": "positions.md", "accumulation": "trainer.md", "parameter_budget": "summary.md",
    "shapes": "index.md", "block_stream": "classification.md", "torch_parity": "masks.md",
    "architecture": "encoder-decoder.md", "rope_types": "llms.md", "kv_memory": "long-context.md",
    "quant_error": "compression.md", "prune_error": "compression.md", "distill_temperature": "compression.md",
}
MEASURED = {"alignment": "encoder-decoder.md", "position_similarity": "vision.md", "class_attention": "vision.md",
            "explorer_image_view": "vision.md", "clip_space": "multimodal.md", "vlm_attention": "multimodal.md",
            "speech_attention": "multimodal.md"}
_MEASURED_RUN = {"alignment": "run", "position_similarity": "vision_run", "class_attention": "vision_run",
                 "explorer_image_view": "vision_run", "clip_space": "clip_run", "vlm_attention": "vlm_run",
                 "speech_attention": "speech_run"}


def fingerprint(data: dict) -> list[float]:
    """Up to 64 numbers spread over all the figure's data, in a fixed order."""
    flat = np.concatenate([np.asarray(data[k], dtype=np.float64).ravel() for k in sorted(data)])
    idx = np.linspace(0, flat.size - 1, num=min(64, flat.size)).round().astype(int)
    return [float(f"{v:.7g}") for v in flat[idx]]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build(names: list[str], run: Path | None = None, vision_run: Path | None = None, clip_run: Path | None = None,
          vlm_run: Path | None = None, speech_run: Path | None = None) -> dict:
    FIGURES.mkdir(parents=True, exist_ok=True)
    manifest = json.loads(MANIFEST.read_text()) if MANIFEST.exists() else {}
    module = sys.modules[__name__]
    for name in names:
        path = FIGURES / f"{name}.png"
        if name in MEASURED:
            given = {"run": run, "vision_run": vision_run, "clip_run": clip_run,
                     "vlm_run": vlm_run, "speech_run": speech_run}[_MEASURED_RUN[name]]
            entry = {"page": MEASURED[name], **getattr(module, name)(path, given)}
        else:
            data = getattr(module, f"data_{name}")()
            getattr(module, f"draw_{name}")(data, path)
            entry = {"page": FIGURES_BY_PAGE[name], "fingerprint": fingerprint(data)}
        entry["png_sha256"] = _sha256(path)
        manifest[name] = entry
        print(f"wrote {path.relative_to(ROOT)}")
    MANIFEST.write_text(json.dumps(dict(sorted(manifest.items())), indent=1) + "\n")
    return manifest


def main(argv=None) -> int:
    every = list(FIGURES_BY_PAGE) + list(MEASURED)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", metavar="NAME", help=f"figures to draw (default all): {', '.join(every)}")
    p.add_argument("--run", type=Path, default=None,
                   help="translation run for the alignment (default runs/translate, else a short run trained here)")
    p.add_argument("--vision-run", type=Path, default=None,
                   help="digits ViT run for the position-similarity and class-attention figures (default: one "
                        f"trained here, attnlab {' '.join(VISION_COMMAND)})")
    p.add_argument("--clip-run", type=Path, default=None, help="digits clip run for the multimodal page's "
                   f"embedding-space figure (default: one trained here, attnlab {' '.join(CLIP_COMMAND)})")
    p.add_argument("--vlm-run", type=Path, default=None, help="digits vlm run for its text-to-image attention "
                   f"figure (default: one trained here, attnlab {' '.join(VLM_COMMAND)})")
    p.add_argument("--speech-run", type=Path, default=None, help="speech run for the multimodal page's frames-as-"
                   f"tokens figure (default: one trained here, attnlab {' '.join(SPEECH_COMMAND)})")
    args = p.parse_args(argv)
    unknown = sorted(set(args.names) - set(every))
    if unknown:
        p.error(f"unknown figure {', '.join(unknown)}; choose from {', '.join(every)}")
    torch.set_num_threads(1)
    build(args.names or every, args.run, args.vision_run, args.clip_run, args.vlm_run, args.speech_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
