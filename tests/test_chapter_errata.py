"""The chapter's code as written, next to attnlab: each test re-types the few chapter lines an
erratum in docs/chapter-errata.md is about (with the chapter's bug), shows the bug happen, and
shows attnlab's result right. "The chapter" is seed 000 (its section numbers), "the article" the
from-scratch self-attention article (seed 002).
"""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from attnlab.models import Transformer
from attnlab.nn import MultiHeadAttention, PositionalEncoding, causal_mask, scaled_dot_product_attention
from attnlab.nn.block import DecoderLayer, EncoderLayer
from attnlab.nn.position import sinusoidal_table
from attnlab.viz import plot_attention, record_attention

from _tolerance import FP32, assert_close_scaled  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------- the chapter's code (section 7.1)

class ChapterMHA(nn.Module):
    """Section 7.1's MultiHeadAttention, as written (dropout left out: the tests run in eval)."""

    def __init__(self, d_model, num_heads):
        super().__init__()
        self.d_model, self.num_heads, self.d_k = d_model, num_heads, d_model // num_heads
        self.qkv_proj = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.scale = math.sqrt(self.d_k)

    def forward(self, query, memory=None, mask=None):
        batch_size = query.size(0)
        if memory is None:
            memory = query
        q = self.qkv_proj(query)[:, :, :self.d_model]
        kv = self.qkv_proj(memory)[:, :, self.d_model:]
        k, v = kv.chunk(2, dim=-1)
        q = q.view(batch_size, -1, self.num_heads, self.d_k).transpose(1, 2)
        k = k.view(batch_size, -1, self.num_heads, self.d_k).transpose(1, 2)
        v = v.view(batch_size, -1, self.num_heads, self.d_k).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / self.scale
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        attn = F.softmax(scores, dim=-1)
        context = torch.matmul(attn, v).transpose(1, 2).contiguous().view(batch_size, -1, self.d_model)
        return self.out_proj(context)


class ChapterFFN(nn.Module):
    def __init__(self, d_model, d_ff):
        super().__init__()
        self.linear1, self.linear2, self.activation = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model), nn.GELU()

    def forward(self, x):
        return self.linear2(self.activation(self.linear1(x)))


class ChapterEncoderLayer(nn.Module):
    def __init__(self, d_model, num_heads, d_ff):
        super().__init__()
        self.self_attn, self.feed_forward = ChapterMHA(d_model, num_heads), ChapterFFN(d_model, d_ff)
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)

    def forward(self, x, mask=None):
        x = x + self.self_attn(self.norm1(x), mask)              # the chapter's call: mask lands in memory
        return x + self.feed_forward(self.norm2(x))


class ChapterDecoderLayer(nn.Module):
    def __init__(self, d_model, num_heads, d_ff):
        super().__init__()
        self.self_attn, self.cross_attn = ChapterMHA(d_model, num_heads), ChapterMHA(d_model, num_heads)
        self.feed_forward = ChapterFFN(d_model, d_ff)
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(d_model), nn.LayerNorm(d_model), nn.LayerNorm(d_model)

    def forward(self, x, memory, src_mask=None, tgt_mask=None):
        x = x + self.self_attn(self.norm1(x), tgt_mask)
        x = x + self.cross_attn(self.norm2(x), memory=memory, mask=src_mask)
        return x + self.feed_forward(self.norm3(x))


class ChapterPositionalEncoding(nn.Module):
    """Section 7.1's table: sequence-first, indexed by the first axis."""

    def __init__(self, d_model, max_len=5000):
        super().__init__()
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0).transpose(0, 1))

    def forward(self, x):
        return x + self.pe[:x.size(0), :]


# ---------------------------------------------------------------- the article's code (seed 002)

def article_attention(Q, K, V):
    dim_k = K.size(-1)
    scores = torch.matmul(Q, K.transpose(-2, -1)) / torch.sqrt(torch.tensor(dim_k))
    return torch.matmul(F.softmax(scores, dim=-1), V)


class ArticleMHA(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.Wq, self.Wk = nn.Linear(embed_dim, embed_dim), nn.Linear(embed_dim, embed_dim)
        self.Wv, self.Wo = nn.Linear(embed_dim, embed_dim), nn.Linear(embed_dim, embed_dim)

    def split_heads(self, x):
        return x.view(x.size(0), -1, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, Q, K, V):
        batch_size = Q.size(0)
        out = article_attention(self.split_heads(self.Wq(Q)), self.split_heads(self.Wk(K)), self.split_heads(self.Wv(V)))
        return self.Wo(out.transpose(1, 2).contiguous().view(batch_size, -1, self.embed_dim))


ARTICLE_POSITIONAL_ENCODING = """
class PositionalEncoding(nn.Module):
    def __init__(self, d_model, max_len=5000):
        super().__init__()
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer('pe', pe.unsqueeze(0))
    def forward(self, x):
        return x + self.pe[:, :x.size(1)]
PositionalEncoding(8, max_len=16)
"""


# ---------------------------------------------------------------- errata 2, 3, 5, 7

def test_erratum_2_chapter_layer_projects_the_mask_as_memory():
    torch.manual_seed(0)
    d, T = 32, 15
    chapter = ChapterDecoderLayer(d, 4, 64).eval()
    x, memory = torch.randn(2, T, d), torch.randn(2, 20, d)
    tgt_mask = torch.triu(torch.ones(T, T), diagonal=1).masked_fill(torch.triu(torch.ones(T, T), 1) == 1,
                                                                    float("-inf"))
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        chapter(x, memory, tgt_mask=tgt_mask)                    # the (15, 15) mask goes through qkv_proj
    # without masks it runs, and its self-attention is not causal
    out = chapter(x, memory)
    x2 = x.clone()
    x2[:, -1] += torch.randn(d)                                 # LayerNorm would erase a constant shift
    assert (chapter(x2, memory)[:, :-1] - out[:, :-1]).abs().max() > 1e-3, "the chapter sees the future"
    ours = DecoderLayer(d, 4, 64, dropout=0.0).eval()
    mine = ours(x, memory)
    assert_close_scaled(ours(x2, memory)[:, :-1], mine[:, :-1], FP32, "attnlab's decoder is causal")


def test_erratum_3_chapter_positions_index_the_batch_axis():
    torch.manual_seed(0)
    B, T, d = 3, 7, 16
    x = torch.zeros(B, T, d)                                     # batch-first, as the rest of the model
    added = ChapterPositionalEncoding(d)(x)
    # every token of batch element b got position b's row; positions along the sequence got nothing
    for b in range(B):
        assert torch.allclose(added[b], sinusoidal_table(B, d)[b].expand(T, d))
    ours = PositionalEncoding(d, max_len=64).eval()(x)
    assert torch.allclose(ours, sinusoidal_table(T, d).expand(B, T, d))


def test_erratum_5_chapter_encoder_layer_is_pre_norm_with_gelu():
    """The chapter's "Transformer as in the paper" equals torch's Pre-Norm GELU layer, not the
    paper's Post-Norm ReLU layer, with the same weights."""
    torch.manual_seed(0)
    d, H, ff = 32, 4, 64
    chapter = ChapterEncoderLayer(d, H, ff).eval()
    pre = nn.TransformerEncoderLayer(d, H, ff, dropout=0.0, activation="gelu", batch_first=True, norm_first=True)
    post = nn.TransformerEncoderLayer(d, H, ff, dropout=0.0, activation="relu", batch_first=True, norm_first=False)
    for layer in (pre, post):
        sd = {"self_attn.in_proj_weight": chapter.self_attn.qkv_proj.weight,
              "self_attn.in_proj_bias": chapter.self_attn.qkv_proj.bias,
              "self_attn.out_proj.weight": chapter.self_attn.out_proj.weight,
              "self_attn.out_proj.bias": chapter.self_attn.out_proj.bias,
              "linear1.weight": chapter.feed_forward.linear1.weight, "linear1.bias": chapter.feed_forward.linear1.bias,
              "linear2.weight": chapter.feed_forward.linear2.weight, "linear2.bias": chapter.feed_forward.linear2.bias,
              "norm1.weight": chapter.norm1.weight, "norm1.bias": chapter.norm1.bias,
              "norm2.weight": chapter.norm2.weight, "norm2.bias": chapter.norm2.bias}
        layer.load_state_dict(sd)
        layer.eval()
    x = torch.randn(2, 6, d)
    with torch.no_grad():
        got = chapter(x)
        assert_close_scaled(got, pre(x), FP32, "the chapter's layer is torch's Pre-Norm GELU layer")
        assert (got - post(x)).abs().max() > 0.1, "and not the paper's Post-Norm ReLU layer"
    ours = EncoderLayer(d, H, ff, dropout=0.0)                  # attnlab's default is the paper's
    assert ours.norm_first is False


def test_erratum_7_torch_order_call_swaps_the_chapter_s_masks():
    """torch's decoder layer takes (tgt, memory, tgt_mask, memory_mask); the chapter's takes
    (x, memory, src_mask, tgt_mask). The same positional call gives the chapter's cross-attention
    the causal mask and leaves its self-attention unmasked."""
    torch.manual_seed(0)
    d, T = 32, 6
    chapter = ChapterDecoderLayer(d, 4, 64).eval()
    x, memory = torch.randn(1, T, d), torch.randn(1, T, d)     # S = T, so nothing complains
    keep = causal_mask(T).float()                               # the chapter's convention: 1 = keep
    out = chapter(x, memory, keep)                              # torch's order: tgt_mask third
    x2 = x.clone()
    x2[:, -1] += torch.randn(d)                                 # LayerNorm would erase a constant shift
    assert (chapter(x2, memory, keep)[:, :-1] - out[:, :-1]).abs().max() > 1e-3, "self-attention is not causal"
    m2 = memory.clone()
    m2[:, -1] += torch.randn(d)
    assert (chapter(x, m2, keep)[:, 0] - out[:, 0]).abs().max() < 1e-6, "query 0 never reads source key 5"
    ours = DecoderLayer(d, 4, 64, dropout=0.0).eval()
    with pytest.raises(TypeError):
        ours(x, memory, keep)                                   # masks by keyword only: no silent swap
    y = ours(x, memory)
    assert (ours(x, m2)[:, 0] - y[:, 0]).abs().max() > 1e-3, "attnlab's query 0 reads every source key"


def test_erratum_4_chapter_sentinel_overflows_fp16():
    """The chapter's masked_fill(mask == 0, -1e9) on fp16 scores (autocast, section 8.4) raises;
    attnlab's fp16 attention with the same mask is finite and puts no weight on blocked keys."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8).half() for _ in range(3))
    keep = causal_mask(4)
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(8)
    with pytest.raises(RuntimeError, match="overflow"):
        scores.masked_fill(keep.int() == 0, -1e9)
    out, w = scaled_dot_product_attention(q, k, v, keep, return_weights=True)
    assert out.dtype == torch.float16 and torch.isfinite(out).all() and (w[..., ~keep] == 0).all()


# ---------------------------------------------------------------- the items the review added

def test_xavier_embedding_is_fainter_than_the_positions_it_is_added_to():
    """Section 7.1's _init_parameters gives the embedding Xavier-uniform, then forward scales it
    by sqrt(d_model): a token vector's RMS is ~0.31 against the positional encoding's ~0.71."""
    torch.manual_seed(0)
    V, d = 10000, 512
    emb = nn.Embedding(V, d)
    nn.init.xavier_uniform_(emb.weight)                         # the chapter's loop: every p.dim() > 1
    token_rms = (emb.weight * math.sqrt(d)).pow(2).mean().sqrt().item()
    pe_rms = sinusoidal_table(64, d).pow(2).mean().sqrt().item()
    assert token_rms == pytest.approx(math.sqrt(6 / (V + d) / 3) * math.sqrt(d), rel=0.01)
    assert 0.30 < token_rms < 0.32 and 0.70 < pe_rms < 0.72
    ours = Transformer(src_vocab_size=V, tgt_vocab_size=V, d_model=d, num_heads=8, num_encoder_layers=1,
                       num_decoder_layers=1, d_ff=64)
    our_rms = (ours.src_embedding.weight * math.sqrt(d)).pow(2).mean().sqrt().item()
    assert 0.98 < our_rms < 1.02, "attnlab: tokens at unit scale, above the position signal"


def test_b_s_padding_mask_broadcasts_as_t_s():
    """A (B, S) padding mask through the chapter's masked_fill(mask == 0) on (B, H, T, S) scores
    lines up B with T: with B == T it runs and masks batch b's query t with sentence t's padding."""
    torch.manual_seed(0)
    B = T = S = 3
    mha = ChapterMHA(16, 2).eval()
    x = torch.randn(B, T, 16)
    pad = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]])       # (B, S), 1 = real token
    out = mha(x, mask=pad)                                      # runs: no error
    alone = mha(x[:1])                                          # sentence 0 has no padding at all
    assert (out[0, 0] - alone[0, 0]).abs().max() < 1e-6         # query 0 read mask row 0: all real
    assert (out[0, 2] - alone[0, 2]).abs().max() > 1e-3, "sentence 0's query 2 lost keys 1 and 2"
    with pytest.raises(RuntimeError):
        mha(torch.randn(2, T, 16), mask=pad[:2])                # B != T: the broadcast fails instead
    ours = MultiHeadAttention(16, 2).eval()
    o, _ = ours(x, key_padding_mask=pad.bool())
    assert_close_scaled(o[0], ours(x[:1])[0][0], FP32, "attnlab: sentence 0 is unchanged by the others' padding")


def test_sinusoidal_positions_beyond_training_are_new_inputs():
    """Erratum 12, run on the chapter's own PositionalEncoding (sections 4.2 and 7.1): "can
    extrapolate to longer sequences" (4.3). The table has rows beyond any length, but they are
    inputs a model never saw: a linear read-out of the position fitted on the table's first 64
    rows (the positions "trained") is exact there and wrong beyond them, and half the channels
    leave the range training showed them."""
    trained, d = 64, 32
    chapter = ChapterPositionalEncoding(d, max_len=4 * trained)
    table = chapter(torch.zeros(4 * trained, 1, d))[:, 0]                 # (positions, d): x + pe with x = 0
    assert_close_scaled(table, sinusoidal_table(4 * trained, d), FP32, "the chapter's table is attnlab's")
    positions = torch.arange(4 * trained, dtype=torch.float64)
    features = torch.cat([table.double(), torch.ones(4 * trained, 1, dtype=torch.float64)], dim=1)
    fit = torch.linalg.lstsq(features[:trained], positions[:trained, None]).solution
    error = (features @ fit)[:, 0] - positions
    assert error[:trained].abs().max() < 1e-3, "inside the trained range the read-out is exact"
    far = error[2 * trained:].abs()
    assert far.mean() > 2 and far[-1] > far[0], "beyond it the same read-out is positions off, and worse further out"
    seen_lo, seen_hi = table[:trained].min(0).values, table[:trained].max(0).values
    beyond = table[2 * trained:]
    unseen = ((beyond < seen_lo - 1e-3) | (beyond > seen_hi + 1e-3)).any(0).float().mean().item()
    assert unseen > 0.3, f"only {unseen:.0%} of the channels leave the trained range"
    with pytest.raises(RuntimeError):
        ChapterPositionalEncoding(8, max_len=16)(torch.zeros(17, 1, 8))   # and the chapter's table ends


def test_more_heads_cost_no_parameters():
    """The article's table says 4 heads "need more parameters" than 1: the projections are
    E x E whatever the number of heads."""
    counts = {h: sum(p.numel() for p in ArticleMHA(512, h).parameters()) for h in (1, 4, 8)}
    assert len(set(counts.values())) == 1
    ours = {h: sum(p.numel() for p in MultiHeadAttention(512, h).parameters()) for h in (1, 4, 8)}
    assert len(set(ours.values())) == 1 and set(ours.values()) == set(counts.values())


def test_shuffled_words_permute_the_output():
    """"Whatever the word order, the output is the same" (article, section 4): without positions
    the output is the same set of vectors, permuted along with the words, not the same output."""
    torch.manual_seed(0)
    mha = ArticleMHA(16, 2).eval()
    x = torch.randn(1, 5, 16)
    perm = torch.tensor([3, 0, 4, 1, 2])
    out, shuffled = mha(x, x, x), mha(x[:, perm], x[:, perm], x[:, perm])
    assert (shuffled - out).abs().max() > 1e-2, "not the same output"
    assert_close_scaled(shuffled, out[:, perm], FP32, "the same vectors, permuted")
    ours = MultiHeadAttention(16, 2).eval()
    assert_close_scaled(ours(x[:, perm])[0], ours(x)[0][:, perm], FP32)


def test_article_uses_math_without_importing_it():
    namespace = {"torch": torch, "nn": nn, "F": F}             # the article's imports: torch, nn, F
    with pytest.raises(NameError, match="math"):
        exec(ARTICLE_POSITIONAL_ENCODING, namespace)
    exec(ARTICLE_POSITIONAL_ENCODING, {**namespace, "math": math})


def test_plot_attention_has_no_weights_to_plot(tmp_path):
    """The article's plot_attention wants a (T, T) weight matrix, but its attention and its
    MultiHeadAttention return only the output: the weights are never there to plot."""
    torch.manual_seed(0)
    mha = ArticleMHA(16, 2).eval()
    x = torch.randn(1, 4, 16)
    returned = mha(x, x, x)
    assert isinstance(returned, torch.Tensor) and returned.shape == (1, 4, 16)   # the output, not (4, 4)
    sentence = ["the", "dog", "sees", "cats"]
    with pytest.raises(ValueError, match="do not match"):
        plot_attention(returned[0], sentence, sentence, tmp_path / "x.png")
    ours = MultiHeadAttention(16, 2).eval()
    with record_attention(ours) as record:
        ours(x)
    w = record.weights(0)[0]                                    # (H, T, S)
    assert w.shape == (2, 4, 4) and torch.allclose(w.sum(-1), torch.ones(2, 4))
    assert plot_attention(w.mean(0), sentence, sentence, tmp_path / "w.png").is_file()


def test_every_erratum_names_tests_that_exist():
    """docs/chapter-errata.md: each numbered erratum cites at least one test, and every test it
    cites is defined where it says."""
    import re
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    page = (root / "docs" / "chapter-errata.md").read_text(encoding="utf-8")
    sections = re.split(r"^## (?=\d+\. )", page, flags=re.MULTILINE)[1:]
    assert len(sections) >= 19
    for section in sections:
        title = section.splitlines()[0]
        cited = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", section)
        assert cited, f"erratum {title!r} cites no test"
        for path, name in cited:
            source = (root / path).read_text(encoding="utf-8")
            assert re.search(rf"^def {name}\(", source, re.MULTILINE), f"{path}::{name} (erratum {title!r}) does not exist"


# ---------------------------------------------------------------- the chapter's ViT (section 5.6)

class ChapterPatchEmbedding(nn.Module):
    def __init__(self, img_size=224, patch_size=16, in_channels=3, embed_dim=768):
        super(ChapterPatchEmbedding, self).__init__()
        self.img_size = img_size
        self.patch_size = patch_size
        self.num_patches = (img_size // patch_size) ** 2
        self.proj = nn.Conv2d(in_channels, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x):
        x = self.proj(x)
        x = x.flatten(2)
        x = x.transpose(1, 2)
        return x


class ChapterVisionTransformer(nn.Module):
    """Section 5.6's VisionTransformer, as written."""

    def __init__(self, img_size=224, patch_size=16, in_channels=3, num_classes=1000, embed_dim=768, depth=12,
                 num_heads=12, mlp_ratio=4, dropout=0.1):
        super(ChapterVisionTransformer, self).__init__()
        self.patch_embed = ChapterPatchEmbedding(img_size, patch_size, in_channels, embed_dim)
        num_patches = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, embed_dim))
        self.dropout = nn.Dropout(dropout)
        encoder_layer = nn.TransformerEncoderLayer(d_model=embed_dim, nhead=num_heads,
                                                   dim_feedforward=int(embed_dim * mlp_ratio), dropout=dropout,
                                                   activation='gelu', batch_first=True)
        self.transformer = nn.TransformerEncoder(encoder_layer, num_layers=depth)
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes)
        nn.init.normal_(self.cls_token, std=0.02)
        nn.init.normal_(self.pos_embed, std=0.02)

    def forward(self, x):
        batch_size = x.shape[0]
        x = self.patch_embed(x)
        cls_tokens = self.cls_token.expand(batch_size, -1, -1)
        x = torch.cat([cls_tokens, x], dim=1)
        x = x + self.pos_embed
        x = self.dropout(x)
        x = self.transformer(x)
        x = self.norm(x[:, 0])
        x = self.head(x)
        return x


def _before_final_norm(model, norm, x):
    """What ``norm`` receives during model(x), and what it returns."""
    seen = {}
    handle = norm.register_forward_hook(lambda m, args, out: seen.update(inp=args[0].detach(), out=out.detach()))
    with torch.no_grad():
        model(x)
    handle.remove()
    return seen["inp"], seen["out"]


def test_erratum_17_chapter_vit_is_post_norm_and_its_final_norm_does_nothing():
    """Section 5.6: nn.TransformerEncoderLayer's default is Post-Norm (norm_first=False), so every
    layer already ends in a LayerNorm; the extra self.norm(x[:, 0]) at initialisation (weight 1,
    bias 0) normalises a vector that is already normalised and hands it back unchanged."""
    torch.manual_seed(0)
    vit = ChapterVisionTransformer(img_size=32, patch_size=8, num_classes=10, embed_dim=64, depth=2,
                                   num_heads=4).eval()
    x = torch.randn(2, 3, 32, 32)
    assert vit(x).shape == (2, 10)
    assert all(layer.norm_first is False for layer in vit.transformer.layers), "the chapter's layers are Post-Norm"
    before, after = _before_final_norm(vit, vit.norm, x)
    assert (after - before).abs().max() < 1e-4, "the chapter's final norm changes nothing at initialisation"
    assert before.std(-1, unbiased=False).sub(1).abs().max() < 1e-4      # the last layer's norm2 already did it
    from attnlab.models.vit import VisionTransformer
    torch.manual_seed(0)
    ours = VisionTransformer(img_size=32, patch_size=8, num_classes=10, embed_dim=64, depth=2, num_heads=4).eval()
    assert all(layer.norm_first for layer in ours.layers), "attnlab's ViT layers are Pre-Norm, as ViT's paper"
    ours_before, ours_after = _before_final_norm(ours, ours.norm, x)
    assert (ours_after - ours_before).abs().max() > 0.5, "attnlab's final norm normalises the residual stream"


def test_erratum_18_cnn_vit_complexity_row_compares_pixels_with_patches():
    """Section 5.4's table: CNN O(n) "n = pixels" against ViT O(n²) "between patches". Per
    layer a convolution costs O(n k² C²) in the n pixels and ViT's attention O(N² d) in the
    N = n / P² patches: doubling the image side multiplies the one by 4 and the other by ~16, and
    at the chapter's own 224 px / 16 the score matrix has fewer entries than the image pixels."""
    from torch.utils.flop_counter import FlopCounterMode
    from attnlab.models.vit import VisionTransformer
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 8, kernel_size=3, padding=1)
    vit = VisionTransformer(img_size=224, patch_size=16, num_classes=10, embed_dim=32, depth=1, num_heads=2).eval()
    conv_flops, scores = {}, {}
    for side in (224, 448):
        x = torch.randn(1, 3, side, side)
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            conv(x)
        conv_flops[side] = counter.get_total_flops()
        with torch.no_grad(), record_attention(vit) as record:
            vit(x, interpolate_pos_encoding=True)
        T, S = record.weights(0).shape[-2:]
        scores[side] = T * S
    assert conv_flops[448] == 4 * conv_flops[224], "a convolution is linear in the pixels"
    assert scores[224] == 197 ** 2 and scores[448] == 785 ** 2
    assert scores[448] / scores[224] > 15, "attention is quadratic in the pixels too, not only in the patches"
    assert scores[224] < 224 * 224, "at 224 px / 16, 38,809 score entries against 50,176 pixels"


CHAPTER_DYT = "DyT（Dynamic Tanh）：2024年何恺明团队提出，用动态tanh替代LayerNorm，在ViT等模型上取得更好效果"


def test_erratum_19_dyt_is_from_2025():
    """Section 5.5 dates DyT to 2024. "Transformers without Normalization" (Zhu, Chen, He, LeCun,
    Liu) is arXiv 2503.10622, March 2025 (CVPR 2025); attnlab's DyT cites it so, and is the
    formula the paper gives: weight * tanh(alpha x) + bias."""
    import inspect
    import re
    from attnlab.nn.norm import DyT
    chapter_year = int(re.search(r"(\d{4})年", CHAPTER_DYT).group(1))
    paper_year = int(re.search(r"LeCun, Liu (\d{4})", inspect.getdoc(DyT)).group(1))
    assert (chapter_year, paper_year) == (2024, 2025), "the chapter's year is not the paper's"
    torch.manual_seed(0)
    dyt = DyT(8, alpha_init=0.5)
    with torch.no_grad():
        dyt.weight.uniform_(0.5, 1.5)
        dyt.bias.uniform_(-0.1, 0.1)
    x = torch.randn(3, 8) * 4
    assert_close_scaled(dyt(x), dyt.weight * torch.tanh(0.5 * x) + dyt.bias, FP32)


CHAPTER_MAMBA2 = "Mamba-2（2024）：\n\n速度提升2-8倍"


def _ssd_share_of_forward_flops(d_model: int, num_layers: int, length: int = 512) -> float:
    """The fraction of a Mamba-2 forward's matrix-product FLOPs that its SSD cores (the part the
    paper's 2-8x is about) perform; the rest is the projections and the head."""
    from torch.utils.flop_counter import FlopCounterMode
    import attnlab.models.mamba2 as m2
    cfg = m2.Mamba2Config(vocab_size=96, d_model=d_model, num_layers=num_layers, d_state=128, expand=2,
                          head_dim=64, n_groups=1)
    torch.manual_seed(0)
    model, core, scan = m2.Mamba2(cfg).eval(), [], m2.ssd_scan

    def counted(*args, **kwargs):
        with FlopCounterMode(display=False) as inner:
            out = scan(*args, **kwargs)
        core.append(inner.get_total_flops())
        return out

    m2.ssd_scan = counted
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as whole:
            model(torch.randint(0, 96, (1, length)))
    finally:
        m2.ssd_scan = scan
    assert len(core) == num_layers
    return sum(core) / whole.get_total_flops()


def test_erratum_20_mamba2_s_2_to_8x_is_its_core_layer_s_figure():
    """Section 6.4 says Mamba-2 is "2-8x faster". Dao and Gu (2024) report that figure for the SSD
    algorithm against Mamba's fused selective scan, one layer's core on a GPU, not for a model.
    In attnlab's Mamba-2 of the benchmark's shape (d_model 256, state 128) the SSD cores do about a
    quarter of the forward's matrix-product FLOPs, so even a free core would speed the whole model
    by at most 1 / (1 - share), about 1.4x; at d_model 1024 the share falls below a tenth (the
    projections grow with d_model², the core with d_model)."""
    assert "2-8倍" in CHAPTER_MAMBA2
    small, wide = _ssd_share_of_forward_flops(256, 4), _ssd_share_of_forward_flops(1024, 1)
    assert 0.2 < small < 0.35, small
    assert 1 / (1 - small) < 1.6
    assert wide < 0.12 and wide < small / 2, (small, wide)

