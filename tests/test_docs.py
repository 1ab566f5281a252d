"""The walk-through runs: every ```python block of docs/*.md, and the chapter-errata claims.

Each page's blocks run in order in one fresh namespace (a page may build on its earlier
blocks), parametrised per page so a failure names the page. A page without a runnable
example fails (index.md included: it has one).

The second half proves the errata (docs/chapter-errata.md) that no other test file covers:
each test reproduces the chapter's mistake in a few lines and shows attnlab's version right.
"""
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from attnlab.models import Transformer
from attnlab.nn import causal_mask, generate_square_subsequent_mask, scaled_dot_product_attention
from attnlab.nn.block import DecoderLayer, EncoderLayer
from attnlab.viz import record_attention

from _tolerance import FP32, assert_close_scaled  # noqa: E402  (tests/ is on sys.path under pytest)

DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGES = sorted(DOCS.glob("*.md"))
BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def python_blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text(encoding="utf-8"))


def test_docs_exist():
    names = {p.name for p in PAGES}
    for want in ("index.md", "attention.md", "multi-head-attention.md", "masks.md", "positions.md",
                 "norms.md", "encoder-decoder.md", "causal-lm.md", "chapter-errata.md", "extending.md",
                 "feed-forward.md", "trainer.md", "summary.md"):
        assert want in names, f"docs/{want} is missing"


@pytest.fixture(autouse=True)
def one_thread():
    """The examples use tiny tensors: one thread is fastest, and stays fast on a busy machine
    (with several threads, tiny matmuls spin-wait for cores other processes hold)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_page_examples_run(page):
    blocks = python_blocks(page)
    assert blocks, f"docs/{page.name} has no ```python example"
    namespace = {"__name__": f"docs.{page.stem}"}
    torch.manual_seed(0)
    for i, source in enumerate(blocks, 1):
        code = compile(source, f"docs/{page.name} [python block {i}]", "exec")
        exec(code, namespace)


# ------------------------------------------------------------------ chapter errata

def _chapter_attention_weights(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The chapter's masking line, applied as written: masked_fill(mask == 0, -1e9)."""
    return torch.softmax(scores.masked_fill(mask == 0, -1e9), dim=-1)


def test_chapter_mask_inverts_causality_and_attnlab_does_not():
    """Erratum 1: the chapter's additive causal mask fed to its `mask == 0` test looks only ahead."""
    torch.manual_seed(0)
    T, D = 5, 8
    q, k, v = torch.randn(1, 1, T, D), torch.randn(1, 1, T, D), torch.randn(1, 1, T, D)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    chapter = _chapter_attention_weights(scores, generate_square_subsequent_mask(T))[0, 0]
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    # rows 0..T-2 put all their weight on future keys; the last row is uniform over every key
    assert torch.allclose(chapter[:-1].masked_fill(future[:-1], 0.0), torch.zeros(T - 1, T))
    assert torch.allclose(chapter[-1], torch.full((T,), 1.0 / T))

    for mask, causal in ((causal_mask(T), False), (generate_square_subsequent_mask(T), False), (None, True)):
        out, w = scaled_dot_product_attention(q, k, v, mask, is_causal=causal, return_weights=True)
        assert torch.equal(w[0, 0] > 0, causal_mask(T)), "attnlab: weight only on the past and present"
        # changing a future value never changes an earlier output
        v2 = v.clone()
        v2[..., -1, :] += 10.0
        out2, _ = scaled_dot_product_attention(q, k, v2, mask, is_causal=causal)
        assert_close_scaled(out2[..., :-1, :], out[..., :-1, :], FP32)


def test_decoder_layer_self_attention_is_causal_and_cross_attention_reads_memory():
    """Erratum 2: self-attention gets the causal mask, cross-attention takes K/V from the memory."""
    torch.manual_seed(0)
    layer = DecoderLayer(32, 4, 64, dropout=0.0).eval()
    x, memory = torch.randn(2, 6, 32), torch.randn(2, 9, 32)
    with record_attention(layer) as record:
        out = layer(x, memory)
    w_self, w_cross = record.weights("self_attn"), record.weights("cross_attn")
    assert w_self.shape == (2, 4, 6, 6) and w_cross.shape == (2, 4, 6, 9)
    assert torch.equal(w_self[0, 0] > 0, causal_mask(6))
    x2 = x.clone()
    x2[:, -1] += 5.0                                            # change the last target token only
    out2 = layer(x2, memory)
    assert_close_scaled(out2[:, :-1], out[:, :-1], FP32, "earlier positions must not see the future")
    out3 = layer(x, memory + 1.0)
    assert (out3 - out).abs().max() > 1e-3, "cross-attention must read the memory"
    # the encoder layer's optional mask is a mask, never a memory: a (T, T) mask leaves shapes intact
    enc = EncoderLayer(32, 4, 64, dropout=0.0).eval()
    with record_attention(enc) as record:
        y = enc(x, mask=causal_mask(6))
    assert y.shape == x.shape and torch.equal(record.weights("self_attn")[0, 0] > 0, causal_mask(6))


def test_padded_targets_do_not_change_the_loss():
    """Erratum 6: with padding masks and ignore_index, padding changes neither outputs nor loss."""
    torch.manual_seed(0)
    PAD = 0
    model = Transformer(src_vocab_size=20, tgt_vocab_size=20, d_model=32, num_heads=4, num_encoder_layers=1,
                        num_decoder_layers=1, d_ff=64, dropout=0.0, pad_id=PAD).eval()
    src = torch.tensor([[5, 6, 7, 8], [9, 10, PAD, PAD]])
    tgt = torch.tensor([[1, 11, 12, 13, 2], [1, 14, 2, PAD, PAD]])
    tgt_input, tgt_label = tgt[:, :-1], tgt[:, 1:]
    with pytest.raises(RuntimeError):
        tgt_label.view(-1)                                       # the chapter's .view(-1) on a sliced tensor
    logits = model(src, tgt_input)
    loss = F.cross_entropy(logits.reshape(-1, 20), tgt_label.reshape(-1), ignore_index=PAD)

    # the same two sentences without padding, one at a time
    total, count = 0.0, 0
    for s, t in (([5, 6, 7, 8], [1, 11, 12, 13, 2]), ([9, 10], [1, 14, 2])):
        s, t = torch.tensor([s]), torch.tensor([t])
        lg = model(s, t[:, :-1])
        total += F.cross_entropy(lg.reshape(-1, 20), t[:, 1:].reshape(-1), reduction="sum")
        count += t.size(1) - 1
    assert_close_scaled(loss, total / count, FP32, "padded batch vs sentences alone")
    unmasked = F.cross_entropy(logits.reshape(-1, 20), tgt_label.reshape(-1))
    assert abs(unmasked.item() - loss.item()) > 1e-3, "counting padding targets changes the loss"
