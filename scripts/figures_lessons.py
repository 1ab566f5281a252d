"""The lesson figures of sections that had none, for scripts/figures.py: the encoder's
bidirectional reach (3.2), the feed-forward network's width and position-wise action (3.4),
`PositionalEncoding`'s offset in cached decoding (4.6), gradient accumulation against one
batch and the activations each keeps (8.4), where the 2017 model's parameters live (9), the
shapes of multi-head attention (A1), the residual stream through one complete block (A5) and
the check against `torch.nn.MultiheadAttention` (A6). Each ``data_NAME()`` runs attnlab in
under a second (the accumulation's three tiny training runs, about two)."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import matplotlib
import numpy as np
import torch

from figure_common import heatmap, plt, save_figure as _save

WORDS = "the cat sat on the mat".split()


def influence(fn, x: torch.Tensor) -> np.ndarray:
    """(T, T): ‖∂ fn(x)_i / ∂ x_j‖ for x (T, E), each row divided by its largest entry: how much
    output position i depends on input position j."""
    T, E = x.shape
    jac = torch.autograd.functional.jacobian(lambda v: fn(v[None])[0], x)          # (T, E, T, E)
    norms = jac.permute(0, 2, 1, 3).reshape(T, T, E * E).norm(dim=-1)
    return (norms / norms.max(-1, keepdim=True).values).numpy()


def data_encoder_influence() -> dict:
    """Section 3.2: one seeded EncoderLayer over six positions, as the encoder runs it (every
    position sees every other) and with the decoder's causal mask."""
    from attnlab.nn import causal_mask
    from attnlab.nn.block import EncoderLayer
    torch.manual_seed(0)
    layer = EncoderLayer(16, 4, 64, dropout=0.0).eval()
    x = torch.randn(6, 16)
    return {"encoder": influence(layer, x),
            "causal": influence(lambda v: layer(v, mask=causal_mask(6)), x)}


def draw_encoder_influence(data, path):
    fig, axes = plt.subplots(1, 2, figsize=(7.4, 3.4))
    cmap = matplotlib.colormaps["viridis"].copy()
    cmap.set_under("white")                     # exactly zero: this input cannot reach that output
    for ax, key, title in ((axes[0], "encoder", "EncoderLayer: the encoder"),
                           (axes[1], "causal", "the same layer, causal mask")):
        im = ax.imshow(np.where(data[key] > 0, data[key], 1e-9), cmap=cmap,
                       norm=matplotlib.colors.LogNorm(vmin=1e-3, vmax=1.0))
        ax.set_xticks(range(len(WORDS)), labels=WORDS, rotation=90)
        ax.set_yticks(range(len(WORDS)), labels=WORDS)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("input position j")
        ax.set_ylabel("output position i")
    fig.colorbar(im, ax=axes, fraction=0.03, label="‖∂out_i/∂in_j‖, row max = 1 (white: 0)")
    fig.suptitle("how much each output depends on each input (seeded, untrained; log scale)", fontsize=9)
    fig.subplots_adjust(left=0.1, right=0.84, bottom=0.2, top=0.85, wspace=0.45)
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def data_ffn_width() -> dict:
    """Section 3.4: FeedForward(8, 32) on six token vectors: the input (T, E), the hidden layer
    after the ReLU (T, F), the output (T, E), and the influence of each input position on each
    output position (only the diagonal: every position alone)."""
    from attnlab.nn import FeedForward
    torch.manual_seed(0)
    ffn = FeedForward(8, 32).eval()
    x = torch.randn(6, 8)
    with torch.no_grad():
        hidden = torch.relu(ffn.linear1(x))
        out = ffn(x[None])[0]
    return {"x": x.numpy(), "hidden": hidden.numpy(), "out": out.numpy(), "influence": influence(ffn, x)}


def draw_ffn_width(data, path):
    fig, axes = plt.subplots(1, 4, figsize=(11, 2.9), gridspec_kw={"width_ratios": [8, 32, 8, 6]})
    lim = float(max(np.abs(data[k]).max() for k in ("x", "hidden", "out")))
    zeros = float((data["hidden"] == 0).mean())
    for ax, key, title in ((axes[0], "x", "x: (T, E = 8)"),
                           (axes[1], "hidden", f"ReLU(x W₁ + b₁): (T, F = 32), {zeros:.0%} zeros"),
                           (axes[2], "out", "FFN(x): (T, E = 8)")):
        ax.imshow(data[key], cmap="RdBu", vmin=-lim, vmax=lim, aspect="auto")
        ax.set_yticks(range(len(WORDS)), labels=WORDS, fontsize=7)
        ax.set_xlabel("channel", fontsize=8)
        ax.set_title(title, fontsize=9)
    heatmap(axes[3], data["influence"], WORDS, WORDS, "‖∂out_i/∂x_j‖")
    axes[3].tick_params(axis="x", rotation=90, labelsize=7)
    axes[3].tick_params(axis="y", labelsize=7)
    _save(fig, path)


def data_position_offset() -> dict:
    """Section 4.6: what PositionalEncoding(16) adds to eight zero vectors in one forward, and
    when they arrive one at a time as cached decoding feeds them, with offset= the number of
    tokens before them and without."""
    from attnlab.nn import PositionalEncoding
    pe = PositionalEncoding(16, max_len=64, dropout=0.0)
    x = torch.zeros(1, 8, 16)
    steps = [x[:, t:t + 1] for t in range(8)]
    return {"full": pe(x)[0].numpy(),
            "offset": torch.cat([pe(s, offset=t) for t, s in enumerate(steps)], 1)[0].numpy(),
            "no_offset": torch.cat([pe(s) for s in steps], 1)[0].numpy()}


def draw_position_offset(data, path):
    fig, axes = plt.subplots(1, 3, figsize=(9, 2.9))
    for ax, key, title in ((axes[0], "full", "one forward of 8 tokens"),
                           (axes[1], "offset", "one token a step, offset=t"),
                           (axes[2], "no_offset", "one token a step, no offset")):
        ax.imshow(data[key], cmap="RdBu", vmin=-1, vmax=1, aspect="auto")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("channel", fontsize=8)
        ax.set_ylabel("token", fontsize=8)
    _save(fig, path)


class _Sentences:
    """A Task for attnlab's Trainer: predict the next token of 32 sequences of uneven length
    (padding ignored), with a one-layer model. ``mean_of_means`` returns each micro-batch's mean
    loss as if it were one token, the normalisation the Trainer avoids."""

    def __init__(self, mean_of_means: bool = False):
        from attnlab.nn.block import EncoderLayer
        g = torch.Generator().manual_seed(0)
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Embedding(16, 16), EncoderLayer(16, 2, 32, dropout=0.0),
                                         torch.nn.Linear(16, 16))
        self.data = torch.randint(1, 16, (32, 12), generator=g)
        lengths = torch.randint(3, 13, (32,), generator=g)
        self.data[torch.arange(12)[None] >= lengths[:, None]] = 0            # 0 = padding
        self.mean_of_means = mean_of_means
        self.micro = 2

    def plan(self, epoch, seed):
        return [self.data[i:i + self.micro] for i in range(0, 32, self.micro)]

    @staticmethod
    def _sum(model, batch):
        logits = model(batch[:, :-1])
        target = batch[:, 1:]
        total = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=0,
                                                  reduction="sum")
        return total, int((target != 0).sum())

    def loss(self, model, batch):
        total, n = self._sum(model, batch)
        return (total / n, 1, {}) if self.mean_of_means else (total, n, {})

    @torch.no_grad()
    def evaluate(self, model):
        total, n = self._sum(model, self.data)          # every sequence, per real token
        return {"loss_per_token": float(total) / n}


def _train_losses(micro: int, accum: int, mean_of_means: bool = False) -> list[float]:
    from attnlab.train import TrainConfig, Trainer
    task = _Sentences(mean_of_means)
    task.micro = micro
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig(out_dir=Path(tmp), steps=16, lr=3e-2, schedule="constant", warmup_steps=1,
                          accum_steps=accum, progress=False, log_every=1, eval_every=1)
        trainer = Trainer(task, cfg)
        trainer.fit()
        trainer.close()
        records = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    return [r["loss_per_token"] for r in records if r.get("kind") == "eval"]


SAVED_CASES = ("batch 8", "micro-batch 2", "batch 8,\ncheckpointed", "micro-batch 2,\ncheckpointed")


def _saved_bytes(model, batch: int, checkpointed: bool) -> int:
    """Bytes of the activations ``model`` (a "tiny" GPT: 2 layers, E = 32) keeps for its backward
    pass on ``batch`` sequences of 32 tokens: the storages of the floating-point tensors autograd
    saves in the forward, each counted once (views share one), weights left out (so are integer
    positions and boolean masks, which a cache may share between calls)."""
    model.gradient_checkpointing = checkpointed                  # what --grad-checkpointing sets
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if t.is_floating_point() and storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage                 # held, so no later tensor reuses its memory
        return t
    ids = torch.randint(0, 96, (batch, 32), generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids).logsumexp(-1).mean()
    loss.backward()
    return sum(s.nbytes() for s in saved.values())


def data_accumulation() -> dict:
    """Section 8.4: 16 steps of attnlab's Trainer on batches of 8 uneven sequences, as one batch
    of 8, as 4 accumulated micro-batches of 2 (the Trainer's sum / tokens), and as 4 micro-batches
    whose mean losses are averaged: after each step, the loss per real token over all 32 sequences.
    And what the memory is saved from: the activations kept for the backward pass, for a batch of
    8 and a micro-batch of 2, with and without gradient checkpointing."""
    from attnlab.models.gpt import PRESETS, GPT, GPTConfig
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(**PRESETS["tiny"])).train()
    return {"one_batch": np.array(_train_losses(8, 1)), "accumulated": np.array(_train_losses(2, 4)),
            "mean_of_means": np.array(_train_losses(2, 4, mean_of_means=True)),
            "saved_bytes": np.array([_saved_bytes(gpt, b, c) for b, c in ((8, False), (2, False), (8, True), (2, True))],
                                    dtype=np.float64)}


def draw_accumulation(data, path):
    steps = np.arange(1, len(data["one_batch"]) + 1)
    fig, (left, right, memory) = plt.subplots(1, 3, figsize=(13, 3.4))
    left.plot(steps, data["one_batch"], "o-", ms=6, label="one batch of 8")
    left.plot(steps, data["accumulated"], "x-", ms=6, label="4 x 2, accumulated (sum / tokens)")
    left.plot(steps, data["mean_of_means"], "s--", ms=3, label="4 x 2, mean of the micro-batch means")
    left.set_xlabel("optimizer step")
    left.set_ylabel("loss per real token, all 32 sequences")
    left.legend(fontsize=7)
    for key, marker in (("accumulated", "x-"), ("mean_of_means", "s--")):
        gap = np.abs(data[key] - data["one_batch"]) / data["one_batch"]
        right.semilogy(steps, np.maximum(gap, 1e-9), marker, ms=4, label=key.replace("_", " "))
    right.set_xlabel("optimizer step")
    right.set_ylabel("|loss - one batch's| / loss (floor 1e-9)")
    right.legend(fontsize=7)
    kib = data["saved_bytes"] / 1024
    memory.bar(range(4), kib, color=["tab:blue", "tab:orange", "tab:green", "tab:olive"])
    for i, v in enumerate(kib):
        memory.text(i, v * 1.02, f"{v:.0f} KiB", ha="center", fontsize=7)
    memory.set_xticks(range(4), labels=SAVED_CASES, fontsize=7)
    memory.set_ylabel("activations kept for backward (KiB)")
    memory.set_title('"tiny" GPT, 32 tokens a sequence', fontsize=8)
    _save(fig, path)


_PARTS = ("embeddings (shared, tied to the output)", "encoder self-attention", "encoder feed-forward",
          "decoder self-attention", "decoder cross-attention", "decoder feed-forward", "layer norms")
_SUBLAYERS = {".self_attn.": "self-attention", ".cross_attn.": "cross-attention", ".ff.": "feed-forward"}


def _part(name: str) -> str:
    """The component of Transformer's parameter ``name`` (encoder_layers.0.ff.linear1.weight, ...)."""
    if "norm" in name:
        return "layer norms"
    if "embedding" in name:
        return _PARTS[0]
    stack = "encoder" if name.startswith("encoder") else "decoder"
    return f"{stack} " + next(v for k, v in _SUBLAYERS.items() if k in name)


def data_parameter_budget() -> dict:
    """Section 9: the parameters of the 2017 base model (Transformer's defaults, a shared
    37,000-token vocabulary, embeddings tied to the output as the paper ties them), counted by
    component; built on the meta device, so no memory is spent."""
    from attnlab.models import Transformer
    with torch.device("meta"):
        model = Transformer(37000, 37000, share_embeddings=True, tie_output=True)
    counts = dict.fromkeys(_PARTS, 0)
    for name, p in model.named_parameters():                        # a tied tensor is listed once
        counts[_part(name)] += p.numel()
    return {"count": np.array(list(counts.values()), dtype=np.float64)}


def draw_parameter_budget(data, path):
    names, count = _PARTS, data["count"]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.barh(range(len(names)), count / 1e6, color="tab:blue")
    for i, c in enumerate(count):
        ax.text(c / 1e6 + 0.3, i, f"{c / 1e6:.2f} M ({c / count.sum():.0%})", va="center", fontsize=7)
    ax.set_yticks(range(len(names)), labels=names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, count.max() / 1e6 * 1.35)
    ax.set_xlabel(f"parameters, millions (total {count.sum() / 1e6:.1f} M)")
    ax.set_title("Transformer(37000, 37000), the base sizes: E = 512, H = 8, F = 2048, 6 + 6 layers", fontsize=8)
    _save(fig, path)


def data_shapes() -> dict:
    """Section A1: the shapes inside one MultiHeadAttention(32, 4) call of cross-attention,
    B = 2 sentences of T = 5 queries over S = 7 keys, each read off the module while it runs
    (hooks on its projections, its head split wrapped, the weights recorded)."""
    from attnlab.nn import MultiHeadAttention
    from attnlab.viz import record_attention
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 4).eval()
    seen, split = {}, []
    hooks = [mha.q_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("q", o.shape)),
             mha.out_proj.register_forward_hook(lambda m, i, o: seen.update(merged=i[0].shape, out=o.shape))]
    plain = mha._split

    def keep_split(t, heads):                                     # (B, L, H·D) -> (B, H, L, D), kept
        split.append(plain(t, heads))
        return split[-1]
    mha._split = keep_split                                       # this instance only, for this one call
    x, memory = torch.randn(2, 5, 32), torch.randn(2, 7, 32)
    with torch.no_grad(), record_attention(mha) as record:
        mha(x, memory, memory)
    for h in hooks:
        h.remove()
    by_length = {t.size(2): t.shape for t in split}                                  # q: T = 5; k, v: S = 7
    shapes = [x.shape, memory.shape, seen["q"], by_length[5], by_length[7], record.weights(0).shape,
              seen["merged"], seen["out"]]
    return {"shapes": np.array([list(s) + [0] * (4 - len(s)) for s in shapes], dtype=np.float64)}


SHAPE_STEPS = ("query x", "key/value\nmemory", "q = x W_q", "q split\ninto heads", "k, v split\ninto heads",
               "softmax(\nq kᵀ/√D)", "weights @ v,\nheads merged", "output\n· W_o")
SHAPE_LETTERS = ("(B, T, E)", "(B, S, E)", "(B, T, H·D)", "(B, H, T, D)", "(B, H, S, D)", "(B, H, T, S)",
                 "(B, T, H·D)", "(B, T, E)")


def shapes_figure(data):
    """The figure, its eight boxes and the texts each must hold (tests/test_figures.py renders it
    and checks every text lies inside its box)."""
    fig, ax = plt.subplots(figsize=(10, 3.0))
    boxes, texts = [], []
    for i, (step, letters, shape) in enumerate(zip(SHAPE_STEPS, SHAPE_LETTERS, data["shapes"])):
        dims = [int(d) for d in shape if d]
        x = i * 1.25
        boxes.append(ax.add_patch(plt.Rectangle((x, 0.2), 1.05, 1.45, facecolor="#dbe7f3", edgecolor="tab:blue")))
        texts.append([ax.text(x + 0.525, 1.3, step, ha="center", va="center", fontsize=7.5),
                      ax.text(x + 0.525, 0.8, letters, ha="center", va="center", fontsize=7.5, family="monospace"),
                      ax.text(x + 0.525, 0.45, "(" + ", ".join(map(str, dims)) + ")", ha="center", va="center",
                              fontsize=7.5, family="monospace", color="tab:red")])
        if i:
            ax.annotate("", xy=(x, 0.92), xytext=(x - 0.2, 0.92), arrowprops={"arrowstyle": "->", "color": "0.4"})
    ax.set_xlim(-0.1, 8 * 1.25)
    ax.set_ylim(0, 1.8)
    ax.set_axis_off()
    ax.set_title("MultiHeadAttention(32, 4) as cross-attention: B = 2, T = 5, S = 7, E = 32, H = 4, D = 8 "
                 "(red: the shapes it ran with)", fontsize=8)
    return fig, boxes, texts


def draw_shapes(data, path):
    fig, _, _ = shapes_figure(data)
    _save(fig, path)


STREAM_STAGES = {"post_norm": ("x", "x + attn(x)", "norm(·)", "+ FFN(·)", "norm(·) = out"),
                 "pre_norm": ("x", "x + attn(norm x)", "norm(·) into the FFN", "+ FFN(norm ·) = out")}


def _stream(norm_first: bool) -> np.ndarray:
    """(5 stages, T) RMS of every token's vector through one seeded EncoderLayer, read with hooks
    on its sublayers (Post-Norm: after each sum comes a norm; Pre-Norm: the sums are the stream)."""
    from attnlab.nn.block import EncoderLayer
    torch.manual_seed(0)
    layer = EncoderLayer(32, 4, 128, dropout=0.0, norm_first=norm_first).eval()
    x = torch.randn(1, 6, 32) * torch.tensor([0.5, 1.0, 2.0, 4.0, 1.0, 0.5])[None, :, None]
    got = {}

    def keep(name):
        return lambda m, i, o: got.__setitem__(name, (i[0], o))
    hooks = [layer.self_attn.register_forward_hook(keep("attn")), layer.ff.register_forward_hook(keep("ff"))]
    with torch.no_grad():
        out = layer(x)
        for h in hooks:
            h.remove()
        return _stages(x, got, out, norm_first)


def _stages(x, got, out, norm_first: bool) -> np.ndarray:
    attn = got["attn"][1][0] if isinstance(got["attn"][1], tuple) else got["attn"][1]   # (output, weights)
    ff_in, ff_out = got["ff"]
    if norm_first:      # x + attn(norm x); its norm feeds the FFN; out = that sum + FFN(...)
        stages = [x, x + attn, ff_in, out]
    else:               # norm(x + attn) feeds the FFN; out = norm(that + FFN(that))
        stages = [x, x + attn, ff_in, ff_in + ff_out, out]
    return torch.stack([s[0].pow(2).mean(-1).sqrt() for s in stages]).numpy()


def data_block_stream() -> dict:
    """Section A5: one complete self-attention block, EncoderLayer(32, 4, 128), on six token
    vectors of RMS 0.5 to 4: each token's RMS after each step, Post-Norm and Pre-Norm."""
    return {"post_norm": _stream(False), "pre_norm": _stream(True)}


def draw_block_stream(data, path):
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), sharey=True)
    for ax, key, title in ((axes[0], "post_norm", "Post-Norm (the article's block)"),
                           (axes[1], "pre_norm", "Pre-Norm: the norm feeds each sublayer")):
        stages = STREAM_STAGES[key]
        for t in range(data[key].shape[1]):
            ax.plot(range(len(stages)), data[key][:, t], "o-", ms=3, alpha=0.8, label=f"token {t + 1}")
        ax.set_xticks(range(len(stages)), labels=stages, fontsize=7, rotation=20)
        ax.set_yscale("log")
        ax.set_title(title, fontsize=9)
    axes[0].set_ylabel("RMS of the token's vector")
    axes[0].legend(fontsize=6, ncol=2, loc="upper right")      # where the Post-Norm lines are all at 1
    _save(fig, path)


def data_torch_parity() -> dict:
    """Section A6: attnlab's MultiHeadAttention(16, 4) and torch.nn.MultiheadAttention with the
    same weights (q/k/v stacked into in_proj_weight) on a padded batch: the largest difference per
    query, relative to the output's scale, with the padding mask inverted for torch (True =
    ignore) and passed as it is (attnlab's True = real)."""
    from attnlab.nn import MultiHeadAttention
    torch.manual_seed(0)
    ours = MultiHeadAttention(16, 4).eval()
    theirs = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()
    with torch.no_grad():
        theirs.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
        theirs.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
        theirs.out_proj.weight.copy_(ours.out_proj.weight)
        theirs.out_proj.bias.copy_(ours.out_proj.bias)
        x = torch.randn(2, 8, 16)
        real = torch.arange(8)[None] < torch.tensor([6, 5])[:, None]            # (B, S), True = real
        want, _ = ours(x, key_padding_mask=real)
        scale = want.abs().max()
        out = {}
        for key, mask in (("inverted", ~real), ("as_is", real)):
            got, _ = theirs(x, x, x, key_padding_mask=mask, need_weights=False)
            out[key] = ((got - want).abs().amax(-1) / scale)[0].numpy()          # (T,) of sentence 1
    return out


def draw_torch_parity(data, path):
    fig, ax = plt.subplots(figsize=(6, 3.2))
    t = np.arange(1, len(data["inverted"]) + 1)
    ax.semilogy(t, np.maximum(data["inverted"], 1e-9), "o-", label="key_padding_mask=~real (converted)")
    ax.semilogy(t, np.maximum(data["as_is"], 1e-9), "s-", label="key_padding_mask=real (attnlab's, unconverted)")
    ax.axhline(1e-5, color="grey", lw=0.8, ls=":")
    ax.text(1, 2e-5, "the tests' tolerance, 1e-5 of the scale", fontsize=7, color="grey")
    ax.set_xlabel("query position (6 real tokens, 2 padding)")
    ax.set_ylabel("max |torch - attnlab| / scale (floor 1e-9)")
    ax.legend(fontsize=7)
    _save(fig, path)


# ------------------------------------------------------------------ section 3.1: the architecture

# (label, attnlab module name in an EncoderLayer / DecoderLayer, colour), bottom to top
ENCODER_BLOCKS = (("multi-head self-attention", "self_attn", "#f6d8ae"), ("add & norm", "self_attn_norm", "#f2f2b0"),
                  ("feed-forward", "ff", "#c9e4f6"), ("add & norm", "ff_norm", "#f2f2b0"))
DECODER_BLOCKS = (("masked multi-head self-attention", "self_attn", "#f6d8ae"), ("add & norm", "self_attn_norm", "#f2f2b0"),
                  ("multi-head cross-attention", "cross_attn", "#f6d8ae"), ("add & norm", "cross_attn_norm", "#f2f2b0"),
                  ("feed-forward", "ff", "#c9e4f6"), ("add & norm", "ff_norm", "#f2f2b0"))


def data_architecture() -> dict:
    """Section 3.1: the 2017 base model as attnlab builds it (Transformer's defaults, a 37,000-token
    vocabulary, on the meta device): the parameters of each drawn block of one encoder and one
    decoder layer, of the embeddings and of the output layer. The figure names each block by the
    module that holds it, read from the model."""
    from attnlab.models import Transformer
    with torch.device("meta"):
        model = Transformer(src_vocab_size=37000, tgt_vocab_size=37000)
    count = lambda module: sum(p.numel() for p in module.parameters())
    enc, dec = model.encoder_layers[0], model.decoder_layers[0]
    return {"encoder": np.array([count(getattr(enc, name)) for _, name, _ in ENCODER_BLOCKS]),
            "decoder": np.array([count(getattr(dec, name)) for _, name, _ in DECODER_BLOCKS]),
            "layers": np.array([len(model.encoder_layers), len(model.decoder_layers)]),
            "ends": np.array([count(model.src_embedding), count(model.tgt_embedding), count(model.output_projection)])}


def _block(ax, x, y, w, h, label, colour, boxes, texts, size=7.5):
    boxes.append(ax.add_patch(plt.Rectangle((x, y), w, h, facecolor=colour, edgecolor="0.35", linewidth=0.8)))
    texts.append([ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=size)])
    return y + h


def _arrow(ax, start, end):
    ax.annotate("", xy=end, xytext=start, arrowprops={"arrowstyle": "->", "color": "0.3", "linewidth": 0.9})


def architecture_figure(data):
    """The drawn encoder-decoder, its boxes and the texts each must hold."""
    fig, ax = plt.subplots(figsize=(8.2, 7.6))
    boxes, texts = [], []
    w, h, gap = 2.6, 0.5, 0.12
    columns = (("encoder", 0.4, ENCODER_BLOCKS, data["encoder"], "src_embedding · √E + PositionalEncoding", "src (B, S)"),
               ("decoder", 4.4, DECODER_BLOCKS, data["decoder"], "tgt_embedding · √E + PositionalEncoding", "tgt (B, T)"))
    tops = {}
    for part, x, blocks, counts, embed, ids in columns:
        ax.text(x + w / 2, 0.15, ids, ha="center", va="center", fontsize=8, family="monospace")
        _arrow(ax, (x + w / 2, 0.3), (x + w / 2, 0.6))
        y = _block(ax, x, 0.6, w, h, embed, "#e4e4e4", boxes, texts, size=6.8)
        _arrow(ax, (x + w / 2, y), (x + w / 2, y + 0.35))
        y0 = y = y + 0.35
        for (label, name, colour), n in zip(blocks, counts):
            y = _block(ax, x + 0.15, y + gap, w - 0.3, h, f"{label}\n{name}: {int(n):,} parameters", colour, boxes, texts,
                       size=6.5)
        layers = int(data["layers"][0 if part == "encoder" else 1])
        ax.add_patch(plt.Rectangle((x, y0), w, y - y0 + gap, fill=False, edgecolor="0.2", linewidth=1.2))
        left = part == "encoder"                # the encoder's count on its left, the decoder's on its right
        ([ax.text(x - 0.1 if left else x + w + 0.1, (y0 + y) / 2,
                              f"{layers} x\n{'EncoderLayer' if left else 'DecoderLayer'}",
                              ha="right" if left else "left", va="center", fontsize=7.5, family="monospace")])
        tops[part] = (x, y0, y + gap)
    ex, ey0, ey1 = tops["encoder"]
    dx, dy0, dy1 = tops["decoder"]
    cross_y = dy0 + gap + 2 * (h + gap) + h / 2
    ax.plot([ex + w / 2, ex + w / 2, ex + w + 0.55], [ey1, ey1 + 0.3, ey1 + 0.3], color="0.3", linewidth=0.9)
    ax.plot([ex + w + 0.55, ex + w + 0.55], [ey1 + 0.3, cross_y], color="0.3", linewidth=0.9)
    _arrow(ax, (ex + w + 0.55, cross_y), (dx + 0.15, cross_y))
    ax.text(ex + w + 0.5, ey1 + 0.4, "memory (B, S, E):\nthe cross-attention's\nkeys and values", fontsize=6.8,
            va="bottom", ha="right")
    _arrow(ax, (dx + w / 2, dy1), (dx + w / 2, dy1 + 0.3))
    y = _block(ax, dx, dy1 + 0.3, w, h, f"output_projection: {int(data['ends'][2]):,} parameters", "#d9ead3",
               boxes, texts, size=6.8)
    _arrow(ax, (dx + w / 2, y), (dx + w / 2, y + 0.3))
    ax.text(dx + w / 2, y + 0.45, "logits (B, T, V) -> softmax: the next token", ha="center", fontsize=8)
    ax.set_xlim(-0.9, 8.3)
    ax.set_ylim(0, y + 0.75)
    ax.set_axis_off()
    ax.set_title("The Transformer (Vaswani et al. 2017) as attnlab.models.Transformer builds it (the base model's sizes;\n"
                 "each block named by its module; Post-Norm: the norm after each residual sum)", fontsize=8.5)
    return fig, boxes, texts


def draw_architecture(data, path):
    fig, _, _ = architecture_figure(data)
    _save(fig, path)
