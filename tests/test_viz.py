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
