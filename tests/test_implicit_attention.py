"""The implicit attention matrix of Mamba-2 and Mamba-3 (attnlab.viz.implicit): read off each
layer's own scan inputs during a forward, multiplying it by the layer's scan input reproduces the
scan's output (the state-space duality for Mamba-2; the trapezoidal, rotated form for Mamba-3),
recording leaves the logits unchanged, and `attnlab viz` draws it as PNGs and as "matrix" views.
"""
import pytest
import torch

from attnlab.models.mamba import Mamba, MambaConfig
from attnlab.models.mamba2 import Mamba2, Mamba2Config
from attnlab.models.mamba3 import Mamba3, Mamba3Config
from attnlab.nn.ssd import ssd_reference
from attnlab.nn.mamba3_scan import mamba3_scan_reference
from attnlab.viz.implicit import (call_blocks, call_magnitude, call_matrix, implicit_magnitudes,
                                  implicit_matrices, record_scans)
from attnlab.viz.views import text_views
from _tolerance import assert_close_scaled  # noqa: E402

TOL = 1e-5


def _randomize(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


def _mamba2(**kw):
    torch.manual_seed(0)
    c = Mamba2Config(vocab_size=50, d_model=32, num_layers=2, d_state=8, expand=2, head_dim=16, n_groups=2, **kw)
    return _randomize(Mamba2(c))


def _mamba3(**kw):
    torch.manual_seed(0)
    c = Mamba3Config(vocab_size=50, d_model=32, num_layers=2, d_state=8, expand=2, headdim=16, **kw)
    return _randomize(Mamba3(c))


IDS = torch.tensor([[3, 14, 15, 9, 2, 6, 5, 35, 8, 9, 7, 9, 3]])       # 13: not a multiple of any chunk


def test_mamba2_matrix_times_its_input_plus_the_skip_is_the_layer_output():
    model = _mamba2()
    with torch.no_grad():
        plain = model(IDS)
        with record_scans(model) as calls:
            recorded = model(IDS)
    assert torch.equal(plain, recorded), "recording changed the logits"
    assert [c.family for c in calls] == ["mamba2"] * 2
    for call in calls:
        x, dt, A, B, C, D = call.inputs
        M = call_matrix(call)                                             # (b, h, T, T)
        assert M.shape == (1, 4, 13, 13) and (M.triu(1) == 0).all()
        y = torch.einsum("bhts,bshp->bthp", M, x.float()) + x * D[:, None]
        assert_close_scaled(y, call.output, TOL, "M x + D x against the layer's ssd_scan output")
        ref, _ = ssd_reference(x, dt, A, B, C, D)                         # and against the recurrence itself
        assert_close_scaled(y, ref, TOL, "M x + D x against ssd_reference")


@pytest.mark.parametrize("trapezoidal,rope_fraction", [(True, 0.5), (True, 1.0), (False, 0.5), (True, 0)])
def test_mamba3_matrix_times_its_input_is_the_scan_output(trapezoidal, rope_fraction):
    model = _mamba3(trapezoidal=trapezoidal, rope_fraction=rope_fraction, chunk_size=4)
    with torch.no_grad():
        plain = model(IDS)
        with record_scans(model) as calls:
            recorded = model(IDS)
    assert torch.equal(plain, recorded)
    assert [c.family for c in calls] == ["mamba3"] * 2
    for call in calls:
        C, B, X, a, gamma, beta = call.inputs
        M = call_matrix(call)
        Y = torch.einsum("bhts,bshp->bthp", M, X[:, :, 0].float())
        assert_close_scaled(Y, call.output[:, :, 0], TOL, "M X against the layer's mamba3_scan output")
        ref, _ = mamba3_scan_reference(C, B, X, a, gamma, beta)
        assert_close_scaled(Y, ref[:, :, 0], TOL, "M X against mamba3_scan_reference")


def test_the_matrix_is_the_duality_written_out_by_hand():
    """One head, n = 1, by the formula of the docstring: M[t, s] = C_t B_s exp(A Σ_{s<r<=t} Δ_r) Δ_s."""
    model = _mamba2()
    with record_scans(model) as calls:
        model(IDS[:, :4])
    x, dt, A, B, C, D = calls[0].inputs
    M = call_matrix(calls[0])[0, 0]
    want = torch.zeros(4, 4)
    for t in range(4):
        for s in range(t + 1):
            want[t, s] = (C[0, t, 0] @ B[0, s, 0]) * torch.exp(A[0] * dt[0, s + 1:t + 1, 0].sum()) * dt[0, s, 0]
    assert_close_scaled(M, want, TOL, "hand-written duality")


@pytest.mark.parametrize("rank,trapezoidal,rope_fraction", [(2, True, 0.5), (3, True, 1.0), (2, False, 0)])
def test_mimo_mamba3_blocks_times_its_inputs_are_the_scan_output(rank, trapezoidal, rope_fraction):
    """MIMO: an R x R block per (t, s); Σ_{s,j} M[t,i,s,j] X[s,j] is the scan's output Y[t,i]."""
    model = _mamba3(is_mimo=True, mimo_rank=rank, trapezoidal=trapezoidal, rope_fraction=rope_fraction,
                    chunk_size=4)
    with torch.no_grad():
        plain = model(IDS)
        with record_scans(model) as calls:
            recorded = model(IDS)
    assert torch.equal(plain, recorded)
    assert len(calls) == 2
    for call in calls:
        C, B, X, a, gamma, beta = call.inputs
        M = call_blocks(call)                                             # (b, h, T, R, T, R)
        assert M.shape == (1, 4, 13, rank, 13, rank)
        assert (M.permute(0, 1, 3, 5, 2, 4).triu(1) == 0).all()           # causal: no s > t
        Y = torch.einsum("bhtisj,bsjhp->btihp", M, X.float())
        assert_close_scaled(Y, call.output, TOL, "Σ M X against the layer's mamba3_scan output")
        ref, _ = mamba3_scan_reference(C, B, X, a, gamma, beta)
        assert_close_scaled(Y, ref, TOL, "Σ M X against mamba3_scan_reference")
        # the drawn scalar: each block's Frobenius norm, written out
        norms = M.pow(2).sum((3, 5)).sqrt()
        assert_close_scaled(call_magnitude(call), norms, TOL, "Frobenius norms")
        # no single signed matrix: refused in one line that names the alternatives
        with pytest.raises(ValueError, match=rf"MIMO Mamba-3 \(rank {rank}\).*call_blocks") as e:
            call_matrix(call)
        assert "\n" not in str(e.value)


def test_the_frobenius_norm_bounds_what_one_unit_input_moves():
    """The documented reading: no input of norm 1 at s moves the outputs at t by more than ||M_ts||_F."""
    model = _mamba3(is_mimo=True, mimo_rank=3, chunk_size=4)
    with record_scans(model) as calls:
        model(IDS)
    M = call_blocks(calls[0])[0, 0]                                       # (T, R, T, R)
    norms = call_magnitude(calls[0])[0, 0]
    x = torch.randn(200, 3, generator=torch.Generator().manual_seed(0))
    x = x / x.norm(dim=-1, keepdim=True)
    moved = torch.einsum("tisj,nj->ntsi", M, x).norm(dim=-1).amax(0)       # (T, T), the worst of 200 inputs
    assert (moved <= norms * (1 + 1e-6)).all() and (moved > 0.3 * norms).any()


def test_siso_blocks_are_the_signed_matrix_and_its_magnitude():
    model = _mamba3(chunk_size=4)
    with record_scans(model) as calls:
        model(IDS)
    M = call_matrix(calls[0])
    assert torch.equal(call_blocks(calls[0])[:, :, :, 0, :, 0], M)
    assert_close_scaled(call_magnitude(calls[0]), M.abs(), TOL, "R = 1: the Frobenius norm is |M|")


def test_text_views_of_a_mimo_mamba3_draw_the_block_norms_and_mamba1_is_refused():
    model = _mamba3(is_mimo=True, mimo_rank=2)
    labels = [str(i) for i in IDS[0].tolist()]
    (view,) = text_views(model, IDS[0].tolist(), labels)
    assert view.kind == "matrix" and view.weights.shape == (2, 4, 13, 13) and "rank 2×2 block" in view.title
    assert torch.allclose(view.weights, implicit_magnitudes(model, IDS)[:, 0])
    with pytest.raises(ValueError, match=r"MIMO Mamba-3 \(rank 2\)"):
        implicit_matrices(model, IDS)
    mamba1 = Mamba(MambaConfig(vocab_size=50, d_model=16, num_layers=1, d_state=4))
    with pytest.raises(ValueError, match="Mamba-1's decay differs per channel") as e:
        implicit_matrices(mamba1, IDS)
    assert "\n" not in str(e.value)


def test_text_views_of_a_mamba2_are_matrix_views_of_the_magnitude():
    model = _mamba2()
    labels = [f"t{i}" for i in range(13)]
    (view,) = text_views(model, IDS[0].tolist(), labels)
    assert view.kind == "matrix" and view.weights.shape == (2, 4, 13, 13) and view.rows == labels
    assert torch.allclose(view.weights, implicit_matrices(model, IDS)[:, 0].abs())


# ----------------------------------------------------------------------------- attnlab viz
TEXT = "the quick brown fox jumps over the lazy dog. " * 20
SMALL = ["--d-model", "16", "--heads", "2", "--layers", "2", "--no-progress"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from attnlab.cli import main
    d = tmp_path_factory.mktemp("ssmruns")
    (d / "text.txt").write_text(TEXT)
    for name, family, extra in (("mamba2", "mamba2", []), ("mamba3", "mamba3", []),
                                ("mamba3-mimo", "mamba3", ["--mimo-rank", "2"])):
        assert main(["train", "lm", "--model", family, "--data", str(d / "text.txt"), "--steps", "2",
                     "--eval-every", "2", "--context", "32", "--batch-size", "2", "--sample-tokens", "0",
                     "--out", str(d / name), *SMALL, *extra]) == 0
    return d


def _written(capsys):
    from pathlib import Path
    return [Path(line[len("wrote "):]) for line in capsys.readouterr().out.splitlines() if line.startswith("wrote ")]


@pytest.mark.parametrize("family", ["mamba2", "mamba3", "mamba3-mimo"])
def test_viz_of_a_state_space_run_draws_its_implicit_attention(runs, family, tmp_path, capsys):
    from attnlab.cli import main
    assert main(["viz", str(runs / family), "the lazy fox"]) == 0
    paths = _written(capsys)
    assert [p.name for p in paths] == ["layers-implicit-layer1.png", "layers-implicit-layer2.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" and p.parent.name == "viz" for p in paths)
    page = tmp_path / "page.html"
    assert main(["viz", str(runs / family), "the lazy fox", "--html", str(page)]) == 0
    text = page.read_text()
    assert '"kind":"matrix"' in text and "implicit attention" in text
    assert ("rank 2" in text) == (family == "mamba3-mimo")          # a MIMO run draws its blocks' norms


def test_viz_of_a_hugging_face_mamba2_directory(tmp_path, capsys):
    import attnlab
    from attnlab.cli import main
    from tokenizers import Tokenizer, models, pre_tokenizers
    model = _mamba2()
    attnlab.save_pretrained(model, tmp_path / "m2")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", "a", "cat", "sat"])}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "m2" / "tokenizer.json"))
    assert main(["viz", str(tmp_path / "m2"), "a cat sat", "--layer", "2", "--head", "3", "--out",
                 str(tmp_path / "figs")]) == 0
    assert [p.name for p in _written(capsys)] == ["layers-implicit-layer2-head3.png"]
