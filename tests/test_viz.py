import pytest
import torch

from attnlab.viz import plot_attention, plot_attention_grid
from _tolerance import FP32, assert_close_scaled  # noqa: E402  (tests/ is on sys.path under pytest)


def test_plot_attention_writes_a_labelled_png(tmp_path):
    w = torch.softmax(torch.randn(4, 6), -1)
    path = plot_attention(w, list("abcd"), list("uvwxyz"), tmp_path / "a.png", title="cross-attention")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_plot_attention_grid_and_shape_errors(tmp_path):
    w = torch.softmax(torch.randn(2, 3, 4, 5), -1)
    path = plot_attention_grid(w, list("abcd"), list("vwxyz"), tmp_path / "g.png")
    assert path.stat().st_size > 5000
    with pytest.raises(ValueError, match="row labels"):
        plot_attention(w[0, 0], list("abc"), list("vwxyz"), tmp_path / "b.png")
    with pytest.raises(ValueError, match="layers, heads"):
        plot_attention_grid(w[0], list("abcd"), list("vwxyz"), tmp_path / "c.png")


def _translation_setup(monkeypatch):
    """A tiny untrained Transformer whose 'translation' is fixed: greedy decoding is another module's
    concern, so it is replaced by a stub that returns the given output."""
    import attnlab.viz.translation as vt
    from attnlab.models import Transformer
    from attnlab.tokenizer import WordTokenizer
    src_tok, tgt_tok = WordTokenizer.train(["one two three four"]), WordTokenizer.train(["un deux trois"])
    torch.manual_seed(0)
    model = Transformer(src_tok.vocab_size, tgt_tok.vocab_size, d_model=16, num_heads=2, num_encoder_layers=2,
                        num_decoder_layers=3, d_ff=32, dropout=0.0).eval()
    out = tgt_tok.encode("deux un") + [tgt_tok.eos_id]
    monkeypatch.setattr(vt, "greedy_decode", lambda *args, **kwargs: torch.tensor([out]))
    return vt, model, src_tok, tgt_tok, out


def test_cross_attention_equals_each_layers_softmax_of_its_own_q_k(monkeypatch):
    vt, model, src_tok, tgt_tok, out = _translation_setup(monkeypatch)
    inputs = {}
    handles = [layer.cross_attn.register_forward_hook(
        lambda m, args, kwargs, res, i=i: inputs.__setitem__(i, (args[0], args[1])), with_kwargs=True)
        for i, layer in enumerate(model.decoder_layers)]
    cross, src_pieces, tgt_pieces, text = vt.cross_attention(model, src_tok, tgt_tok, "three one two")
    for h in handles:
        h.remove()
    assert cross.shape == (3, 2, 3, 3) and src_pieces == ["three", "one", "two"]
    assert tgt_pieces == ["deux", "un", "</s>"] and text == "deux un"
    for i, layer in enumerate(model.decoder_layers):
        h, memory = inputs[i]
        a = layer.cross_attn
        q = a.q_proj(h).view(1, -1, 2, 8).transpose(1, 2)
        k = a.k_proj(memory).view(1, -1, 2, 8).transpose(1, 2)
        want = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, dim=-1)[0]
        assert_close_scaled(cross[i], want.detach(), FP32, f"layer {i} cross-attention weights")


def test_draw_alignment_writes_pngs(monkeypatch, tmp_path):
    vt, model, src_tok, tgt_tok, _ = _translation_setup(monkeypatch)
    for kwargs in ({}, {"layer": 2, "head": 1}, {"grid": True}):
        path, text = vt.draw_alignment(model, src_tok, tgt_tok, "three one two", tmp_path / "a.png", **kwargs)
        assert text == "deux un" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="layer"):
        vt.draw_alignment(model, src_tok, tgt_tok, "three one two", tmp_path / "b.png", layer=4)


# ----------------------------------------------------------------------------- labellers
def test_token_labels_of_recorded_positions_with_readable_specials_and_spaces():
    from attnlab.nn import EncoderLayer
    from attnlab.tokenizer import CharTokenizer, WordTokenizer
    from attnlab.viz import TokenLabels, record_attention
    word = WordTokenizer.train(["the cat sat"])
    ids = [word.bos_id] + word.encode("the cat sat") + [word.eos_id, word.pad_id, 999]
    labels = TokenLabels(word, torch.tensor(ids))
    assert labels() == ["<bos>", "the", "cat", "sat", "<eos>", "<pad>", "<id 999>"]
    layer = EncoderLayer(8, 2, 16, 0.0).eval()
    with torch.no_grad(), record_attention(layer) as record:
        layer(torch.randn(1, 7, 8))
    assert labels(record[0].key_positions) == labels(record[0].query_positions) == labels()
    assert labels(torch.tensor([2, 0])) == ["cat", "<bos>"]
    char = CharTokenizer.train(["a b\tc\n"])
    assert TokenLabels(char, char.encode("a b\tc\n"))() == ["a", "▁", "b", "\\t", "c", "\\n"]
    with pytest.raises(ValueError, match="position 7 is outside its 7 tokens"):
        labels([7])
    with pytest.raises(ValueError, match="one sequence of integer token ids"):
        TokenLabels(word, [[1, 2]])


def test_token_labels_decode_byte_level_pieces_and_keep_wordpiece_specials():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from attnlab.tokenizer import HFTokenizer, train_wordpiece
    from attnlab.viz import TokenLabels, readable_piece
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer, hf.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    hf.train_from_iterator(["hello world\nthe cat é"], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    gpt = HFTokenizer(hf)
    ids = gpt.encode("hello world\nthe cat é") + [gpt.eos_id]
    assert gpt.tokens(ids)[1:3] == ["Ġworld", "Ċ"]                     # what the raw pieces look like
    assert TokenLabels(gpt, ids)() == ["hello", "▁world", "\\n", "the", "▁cat", "▁é", "<|endoftext|>"]
    bert = train_wordpiece(["the cats are sleeping", "the dog is sleeping"], vocab_size=60)
    cls_sep = TokenLabels(bert, bert.encode("the cats"))()
    assert cls_sep[0] == "[CLS]" and cls_sep[-1] == "[SEP]" and cls_sep[1] == "the"
    assert readable_piece("<0x0A>") == "\\n" and readable_piece("") == "<empty>" and readable_piece("\x01") == "\\x01"


def test_patch_grid_follows_the_patch_embedding_order():
    from attnlab.viz import PatchGrid
    vit = PatchGrid(224, 16)
    assert (vit.rows, vit.cols, len(vit)) == (14, 14, 197)
    assert vit([0, 1, 14, 15, 196]) == ["[CLS]", "(0, 0)", "(0, 13)", "(1, 0)", "(13, 13)"]
    # the reference order: a stride-patch Conv2d's output flattened, as ViT embeds patches; each
    # patch's top-left pixel carries its own (y, x), so the flattened patch l says where it came from
    H, W, P = 32, 48, 16
    grid = PatchGrid((H, W), P, prefix=("[CLS]", "[DIST]"))
    yx = torch.stack(torch.meshgrid(torch.arange(H), torch.arange(W), indexing="ij")).float()[None]   # (1, 2, H, W)
    corner = torch.zeros(2, 2, P, P)
    corner[0, 0, 0, 0] = corner[1, 1, 0, 0] = 1.0
    tops = torch.nn.functional.conv2d(yx, corner, stride=P).flatten(2).transpose(1, 2)[0]           # (patches, 2)
    boxes = grid.boxes(torch.arange(2, len(grid)))
    assert [(top, left) for top, left, _, _ in boxes] == [tuple(map(int, t)) for t in tops]
    assert grid.boxes([0, 1]) == [None, None] and grid.coordinates([7]) == [(1, 2)] and boxes[-1][2:] == (H, W)
    assert PatchGrid(32, 16, prefix=())() == ["(0, 0)", "(0, 1)", "(1, 0)", "(1, 1)"]
    with pytest.raises(ValueError, match="patches of 16x16 pixels do not tile a 30x32 image"):
        PatchGrid((30, 32), 16)
    with pytest.raises(ValueError, match="position 197 is outside its 197 tokens"):
        vit([197])
    with pytest.raises(ValueError, match="patch_size must be a positive int"):
        PatchGrid(224, 0)
