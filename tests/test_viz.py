import pytest
import torch

from attnlab.viz import plot_attention, plot_attention_grid


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
