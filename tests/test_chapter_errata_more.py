"""Errata 10 and 21-24 of docs/chapter-errata.md, each shown by running the chapter's or the
article's own lines (re-typed with their bug) beside attnlab: section 7.2's training loop without
warmup, the article's (3, 4) input, its plot_attention, section 5.5's dates for Swin, DeiT and MAE,
and the positional encodings on an odd d_model. The chapter's and the article's classes these
share live in tests/test_chapter_errata.py.
"""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from attnlab.models import Transformer
from attnlab.nn import MultiHeadAttention, PositionalEncoding
from attnlab.nn.position import sinusoidal_table
from attnlab.train.schedules import make_schedule
from attnlab.viz import plot_attention, record_attention

from _tolerance import FP32, assert_close_scaled  # noqa: E402
from test_chapter_errata import ARTICLE_POSITIONAL_ENCODING, ArticleMHA, ChapterPositionalEncoding  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def chapter_generate_square_subsequent_mask(sz):
    """Section 7.1's helper, as written: an additive float mask, -inf above the diagonal."""
    mask = (torch.triu(torch.ones(sz, sz)) == 1).transpose(0, 1)
    mask = mask.float().masked_fill(mask == 0, float('-inf')).masked_fill(mask == 1, float(0.0))
    return mask


def chapter_train_transformer(model, train_loader, optimizer, criterion, device):
    """Section 7.2's train_transformer, as written (its comments left out)."""
    model.train()
    total_loss = 0
    for batch_idx, (src, tgt) in enumerate(train_loader):
        src, tgt = src.to(device), tgt.to(device)
        tgt_input = tgt[:, :-1]
        tgt_label = tgt[:, 1:]
        tgt_mask = chapter_generate_square_subsequent_mask(tgt_input.size(1)).to(device)
        optimizer.zero_grad()
        output = model(src, tgt_input, tgt_mask=tgt_mask)
        loss = criterion(output.view(-1, output.size(-1)), tgt_label.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        total_loss += loss.item()
    return total_loss / len(train_loader)


class _TinySeq2Seq(nn.Module):
    """Enough of a model for the chapter's loop: (src, tgt_input, tgt_mask=) -> (B, T, V) logits."""

    def __init__(self, vocab=12, d=16):
        super().__init__()
        self.model = Transformer(src_vocab_size=vocab, tgt_vocab_size=vocab, d_model=d, num_heads=2,
                                 num_encoder_layers=1, num_decoder_layers=1, d_ff=32, dropout=0.0)

    def forward(self, src, tgt, tgt_mask=None):
        return self.model(src, tgt)                # attnlab's decoder is causal by itself


def test_section_7_2_loop_has_no_warmup():
    """Erratum 10, run: the chapter's own train_transformer steps its optimizer at the full rate
    from the first batch (the optimizer's rate, read as each step is taken, never moves); its own
    8.3 advises warmup. attnlab's schedules start at peak / warmup and climb."""
    torch.manual_seed(0)
    model = _TinySeq2Seq()
    batches = [(torch.randint(3, 12, (1, 5)), torch.randint(3, 12, (1, 6))) for _ in range(6)]   # batch 1: see erratum 6
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    rates = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: rates.append(opt.param_groups[0]["lr"]))
    before = [p.detach().clone() for p in model.parameters()]
    loss = chapter_train_transformer(model, batches, optimizer, nn.CrossEntropyLoss(), "cpu")
    assert math.isfinite(loss) and len(rates) == len(batches)
    assert rates == [1e-3] * len(batches), "no warmup: the first step is taken at the peak rate"
    # Adam's first step moves every weight by about the full rate whatever its gradient's size
    moved = torch.cat([(p.detach() - b).abs().flatten() for p, b in zip(model.parameters(), before)])
    assert moved.max() > 0.9 * len(batches) * 1e-3 * 0.5
    model = _TinySeq2Seq()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = make_schedule("cosine", optimizer, warmup=100, total_steps=1000)
    ours = []
    for _ in range(5):
        ours.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        sched.step()
    assert ours[0] == pytest.approx(1e-5) and all(a < b for a, b in zip(ours, ours[1:]))


def test_erratum_21_a_3_by_4_input_makes_every_token_attend_only_to_itself():
    """The article's first example, `x = torch.randn(3, 4)  # 形状(batch_size, seq_len, embed_dim)`:
    the tensor is (seq_len, embed_dim), two axes, not three. Fed to the article's own
    MultiHeadAttention, which reads axis 0 as the batch, it becomes 3 sentences of one token each:
    no error, and every token attends only to itself (its output ignores the other two tokens).
    attnlab refuses the 2-D tensor in one line and gives a (1, 3, 4) batch real attention."""
    torch.manual_seed(0)
    x = torch.randn(3, 4)                                  # the article's line
    mha = ArticleMHA(4, 2).eval()
    out = mha(x, x, x)                                     # runs: (3, 4) -> view(3, -1, 2, 2): 3 batches of 1
    assert out.shape == (3, 1, 4)
    changed = x.clone()
    changed[1:] = torch.randn(2, 4)                        # change tokens 1 and 2 only
    assert torch.equal(mha(changed, changed, changed)[0], out[0]), "token 0 never looked at the others"
    alone = torch.stack([mha(x[i:i + 1], x[i:i + 1], x[i:i + 1])[0] for i in range(3)])
    assert_close_scaled(out, alone, FP32, "each token's output is that of a one-token sentence")
    batched = mha(x[None], x[None], x[None])[0]            # the shape the comment meant: (1, 3, 4)
    assert (batched - out[:, 0]).abs().max() > 1e-3, "with a real sequence axis the tokens mix"
    ours = MultiHeadAttention(4, 2).eval()
    with pytest.raises(ValueError, match=r"batch-first \(B, L, E\), got \(3, 4\)"):
        ours(x)
    with record_attention(ours) as record:
        ours(x[None])
    w = record.weights(0)[0]                               # (H, 3, 3)
    assert w.shape == (2, 3, 3) and (w.diagonal(dim1=-2, dim2=-1) < 0.999).all()


ARTICLE_PLOT_ATTENTION = """
def plot_attention(attention_weights, sentence):
    fig, ax = plt.subplots()
    cax = ax.matshow(attention_weights, cmap='viridis')
    fig.colorbar(cax)
    ax.set_xticks(range(len(sentence)))
    ax.set_yticks(range(len(sentence)))
    ax.set_xticklabels(sentence, rotation=90)
    ax.set_yticklabels(sentence)
    plt.show()
"""


def test_erratum_22_plot_attention_uses_plt_unimported_and_one_sentence_for_both_axes(tmp_path):
    """The article's plot_attention, as written: it calls `plt`, which none of its imports (torch,
    nn, F) defines, and it labels rows and columns with one `sentence`, so cross-attention (target
    rows, source columns) cannot be drawn right: a 2-token target over a 3-word source gets the
    source's words on its 2 rows (and a third label below the picture). attnlab's plot_attention
    takes row and column labels apart and refuses labels that do not match the matrix."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    namespace = {"torch": torch, "nn": nn, "F": F}
    exec(ARTICLE_PLOT_ATTENTION, namespace)
    cross = torch.softmax(torch.randn(2, 3), -1).numpy()   # 2 target tokens x 3 source words
    source, target = ["der", "Hund", "bellt"], ["the", "dog"]
    with pytest.raises(NameError, match="plt"):
        namespace["plot_attention"](cross, source)
    namespace["plt"] = plt
    plt.close("all")
    namespace["plot_attention"](cross, source)            # with plt given, it draws without complaint
    ax = plt.gcf().axes[0]
    rows = [t.get_text() for t in ax.get_yticklabels()]
    assert rows == source and len(rows) != cross.shape[0], "the rows, which are target tokens, carry the source's words"
    plt.close("all")
    ours = plot_attention(torch.as_tensor(cross), target, source, tmp_path / "cross.png")
    assert ours.is_file()
    with pytest.raises(ValueError, match="do not match"):
        plot_attention(torch.as_tensor(cross), source, source, tmp_path / "wrong.png")


CHAPTER_5_5 = """2024-2025年ViT领域的重要进展：
Swin Transformer：引入层次化结构和移位窗口，降低计算复杂度
DeiT（Data-efficient Image Transformer）：使用知识蒸馏，减少数据依赖
MAE（Masked Autoencoder）：自监督预训练方法，提升数据效率"""


def test_erratum_23_swin_deit_and_mae_are_not_2024_2025_work():
    """Section 5.5 lists Swin, DeiT and MAE under "2024-2025年ViT领域的重要进展". Each is older: the
    papers attnlab's models cite (in each model module's first line) are Liu et al. 2021 (Swin,
    ICCV 2021), Touvron et al. 2021 (DeiT, ICML 2021) and He et al. 2022 (MAE, CVPR 2022)."""
    import re
    import attnlab.models.deit as deit
    import attnlab.models.mae as mae
    import attnlab.models.swin as swin
    first, last = map(int, re.match(r"(\d{4})-(\d{4})年", CHAPTER_5_5).groups())
    listed = {name: name.split()[0] in CHAPTER_5_5 for name in ("Swin", "DeiT", "MAE")}
    assert all(listed.values()) and (first, last) == (2024, 2025)
    cited = {name: int(re.search(r"et al\.\s+(\d{4})", module.__doc__).group(1))
             for name, module in (("Swin", swin), ("DeiT", deit), ("MAE", mae))}
    assert cited == {"Swin": 2021, "DeiT": 2021, "MAE": 2022}
    assert all(year < first for year in cited.values()), "none of the three is from the years the chapter gives"


CHAPTER_4_2_POSITIONAL_ENCODING = """
class PositionalEncoding(nn.Module):
    def __init__(self, d_model, max_seq_len=5000, dropout=0.1):
        super(PositionalEncoding, self).__init__()
        self.dropout = nn.Dropout(p=dropout)
        pe = torch.zeros(max_seq_len, d_model)
        position = torch.arange(0, max_seq_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(
            torch.arange(0, d_model, 2).float() *
            (-math.log(10000.0) / d_model)
        )
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        pe = pe.unsqueeze(0).transpose(0, 1)
        self.register_buffer('pe', pe)
    def forward(self, x):
        x = x + self.pe[:x.size(0), :]
        return self.dropout(x)
"""


def test_erratum_24_both_positional_encodings_crash_on_an_odd_d_model():
    """The chapter's PositionalEncoding (sections 4.2 and 7.1) and the article's both fill
    `pe[:, 1::2]`, which has d_model // 2 columns, with ceil(d_model / 2) cosines: an odd d_model
    stops with a shape error. attnlab's gives the odd width its extra sine channel."""
    namespace = {"torch": torch, "nn": nn, "math": math}
    exec(CHAPTER_4_2_POSITIONAL_ENCODING, namespace)
    article = {"torch": torch, "nn": nn, "math": math}
    exec(ARTICLE_POSITIONAL_ENCODING.replace("PositionalEncoding(8, max_len=16)", ""), article)
    for build in (lambda d: namespace["PositionalEncoding"](d, max_seq_len=16),
                  lambda d: ChapterPositionalEncoding(d, max_len=16),
                  lambda d: article["PositionalEncoding"](d, max_len=16)):
        assert build(8).pe.numel() == 16 * 8                      # an even width works
        with pytest.raises(RuntimeError, match="size"):
            build(7)
    table = sinusoidal_table(16, 7)
    pos = torch.arange(16.0)[:, None]
    freqs = torch.exp(torch.arange(0, 7, 2).float() * (-math.log(10000.0) / 7))     # 4 frequencies
    assert_close_scaled(table[:, 0::2], torch.sin(pos * freqs), FP32)
    assert_close_scaled(table[:, 1::2], torch.cos(pos * freqs[:3]), FP32)
    assert PositionalEncoding(7)(torch.zeros(2, 5, 7)).shape == (2, 5, 7)
