"""Language modelling: the embedded corpus, the LM task (plan, loss with the MoE aux term,
evaluation), and `attnlab train lm` / `attnlab generate` end to end on tiny settings."""
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from attnlab.cli import main
from attnlab.data.files import DataFormatError
from attnlab.data.text import stdlib_corpus, text_file_corpus
from attnlab.tasks.lm import LanguageModelTask, load_lm, text_perplexity
from attnlab.models import GPT, GPTConfig, Mixtral, MixtralConfig
from attnlab.tokenizer import CharTokenizer
from _hf_fixtures import tiny_gpt2_dir  # noqa: E402  (tests/ is on sys.path under pytest)
from _tolerance import FP32_OP, assert_close_scaled  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--d-model", "32", "--heads", "2", "--layers", "1", "--context", "32", "--batch-size", "8", "--no-progress"]
TEXT = "the quick brown fox jumps over the lazy dog. " * 120


def run_cli(*args, timeout=120):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "attnlab.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=timeout)


# ----------------------------------------------------------------------------- data and task
def test_stdlib_corpus_is_deterministic_and_splits_by_file():
    a, b = stdlib_corpus(300_000), stdlib_corpus(300_000)
    assert (a.train_names, a.valid_names, a.train, a.valid) == (b.train_names, b.valid_names, b.train, b.valid)
    assert a.train and a.valid and not set(a.train_names) & set(a.valid_names)
    names = sorted(a.train_names + a.valid_names)
    assert a.train_names == sorted(a.train_names) and len(names) == len(set(names))
    assert not any(part in ("site-packages", "test", "tests") for n in names for part in n.split("/")[:-1])
    root = Path(os.__file__).resolve().parent
    assert a.valid[0] == (root / a.valid_names[0]).read_text(encoding="utf-8")
    assert sum(len(t.encode()) for t in a.train + a.valid) >= 300_000


def test_text_file_corpus_splits_90_10_and_names_bad_bytes(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("".join(chr(97 + i % 26) for i in range(1000)))
    c = text_file_corpus(str(f))
    assert c.train[0] + c.valid[0] == f.read_text() and len(c.valid[0]) == 100
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine\nstill fine\nbroken \xff here\n")
    with pytest.raises(DataFormatError, match=r"bad\.txt, line 3: not valid UTF-8"):
        text_file_corpus(str(bad))


def _task(model, context=16, n=600, batch_size=4):
    tok = CharTokenizer.train(["abcdefgh"])
    ids = torch.arange(n) % model.config.vocab_size
    return LanguageModelTask(model, tok, ids, ids[:200].flip(0), context=context, batch_size=batch_size,
                             steps_per_epoch=5, eval_windows=7)


def test_plan_is_deterministic_in_epoch_and_seed_and_gives_shifted_windows():
    torch.manual_seed(0)
    task = _task(GPT(GPTConfig(vocab_size=64, n_positions=16, d_model=16, num_heads=2, num_layers=1, dropout=0.0)))
    starts = lambda epoch, seed: torch.stack([b["start"] for b in task.plan(epoch, seed)])  # noqa: E731
    first = starts(0, 0)
    torch.manual_seed(123)                                 # the global RNG plays no part
    assert torch.equal(first, starts(0, 0)) and first.shape == (5, 4)
    assert not torch.equal(first, starts(1, 0)) and not torch.equal(first, starts(0, 1))
    many = torch.cat([starts(e, 0) for e in range(20)])
    assert int(many.min()) >= 0 and int(many.max()) <= 600 - 16 - 1
    x, y = task.windows(task.train_ids, first[0])
    assert x.shape == y.shape == (4, 16)
    assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(x[:, 0], task.train_ids[first[0]])
    metrics = task.evaluate(task.model.eval())
    assert metrics == task.evaluate(task.model) and math.isclose(metrics["val_ppl"], math.exp(metrics["val_loss"]))


def test_mixtral_loss_adds_the_aux_term_and_reports_expert_counts():
    torch.manual_seed(0)
    coef, X = 0.5, 4
    model = Mixtral(MixtralConfig(vocab_size=40, d_model=32, num_heads=4, num_kv_heads=4, num_layers=2, d_ff=48,
                                  max_position_embeddings=16, num_experts=X, top_k=2, router_aux_loss_coef=coef))
    task = _task(model)
    batch = task.plan(0, 0)[0]
    loss, n, extras = task.loss(model, batch)
    x, y = task.windows(task.train_ids, batch["start"])
    logits = model(x)
    router_logits, _ = model.routing()
    ce = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
    aux = model.aux_loss()
    assert n == 4 * 16
    assert (loss - ce).item() > 1.0                          # the aux term is there (aux >= 1 by construction)
    assert_close_scaled(loss, ce + coef * aux * n, FP32_OP, "loss = cross-entropy + coef * aux * tokens")
    assert_close_scaled(float(extras["aux_loss"]), aux.item() * n, FP32_OP, "reported aux loss")
    shares = torch.tensor([float(extras[f"expert_{e}"]) for e in range(X)], dtype=torch.float64)
    chosen = torch.cat([r.softmax(-1).topk(2, dim=-1).indices.flatten() for r in router_logits])
    assert_close_scaled(shares, torch.bincount(chosen, minlength=X).double() / (2 * 2), FP32_OP, "expert shares")
    assert math.isclose(float(shares.sum()), n)            # each token counted once over experts
    loss.backward()
    assert model.layers[0].ff.gate.weight.grad.abs().sum() > 0
    dense = _task(GPT(GPTConfig(vocab_size=40, n_positions=16, d_model=16, num_heads=2, num_layers=1)))
    assert dense.loss(dense.model, batch)[2] == {}


# ----------------------------------------------------------------------------- the command line
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm")
    (d / "text.txt").write_text(TEXT)
    r = run_cli("train", "lm", "--data", d / "text.txt", "--out", d / "run", "--steps", "30", "--eval-every", "10",
                "--lr", "1e-2", "--warmup", "3", "--beta2", "0.99", "--sample-tokens", "20", *TINY)
    return d, r


def test_train_lm_writes_checkpoints_and_the_loss_goes_down(trained):
    d, r = trained
    assert r.returncode == 0, r.stderr
    run = d / "run"
    for ckpt in (run / "best", run / "step-0000030"):
        assert {"model.safetensors", "run.json", "tokenizer.json", "trainer_state.json"} <= \
            {p.name for p in ckpt.iterdir()}
    meta = json.loads((run / "best" / "run.json").read_text())
    assert (meta["task"], meta["model_type"], meta["architecture"], meta["format"]) == \
        ("lm", "gpt2", "GPT2LMHeadModel", 3)
    assert meta["task_options"]["context"] == 32 and meta["config"]["d_model"] == 32
    saved = (run / "config.yaml").read_text()                  # the resolved settings, for --resume
    assert "task: lm" in saved and "context: 32" in saved and "beta2: 0.99" in saved
    groups = json.loads((run / "best" / "trainer_state.json").read_text())["optimizer"]["param_groups"]
    assert all(g["betas"] == [0.9, 0.99] for g in groups)          # --beta2 reached AdamW
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r["loss"] for r in records if r["kind"] == "train"]
    valid = [r["val_loss"] for r in records if r["kind"] == "eval"]
    assert len(train) == 3 and train[-1] < train[0] - 0.5, train
    assert valid[-1] < valid[0], valid
    assert "sample" in r.stdout


def test_resume_keeps_the_checkpoints_model_and_tokenizer(trained, tmp_path, capsys):
    d, r = trained
    assert r.returncode == 0, r.stderr
    shutil.copytree(d / "run", tmp_path / "run")            # the other tests keep the original run
    code = main(["train", "lm", "--data", str(d / "text.txt"), "--out", str(tmp_path / "run"), "--steps", "32",
                 "--resume", "--sample-tokens", "0", *TINY[:-1], "--d-model", "64", "--no-progress"])
    assert code == 2                                       # a size flag differing from the run's is refused
    assert "--d-model 64 differs from the run's 32" in capsys.readouterr().err
    code = main(["train", "lm", "--data", str(d / "text.txt"), "--out", str(tmp_path / "run"), "--steps", "32",
                 "--resume", "--sample-tokens", "0", *TINY])
    assert code == 0
    assert "(from the checkpoint)" in capsys.readouterr().err
    meta = json.loads((tmp_path / "run" / "step-0000032" / "run.json").read_text())
    assert meta["config"]["d_model"] == 32


class _Recorder:
    def __init__(self):
        self.writes, self.flushes = [], 0

    def write(self, s):
        self.writes.append(s)

    def flush(self):
        self.flushes += 1


def test_load_lm_gives_an_eval_model_optimised_for_inference(trained):
    from attnlab.nn import InferenceLinear
    d, _ = trained
    lm = load_lm(d / "run", "cpu")
    assert not lm.model.training
    linears = [m for m in lm.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(isinstance(m, InferenceLinear) for m in linears)
    assert lm.model.lm_head.weight is lm.model.token_embedding.weight


def test_generate_streams_text_from_the_checkpoint(trained, monkeypatch):
    d, r = trained
    assert r.returncode == 0, r.stderr
    out = run_cli("generate", d / "run", "--prompt", "the quick", "--max-new-tokens", "15", "--seed", "3")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("the quick") and len(out.stdout.rstrip("\n")) > len("the quick")
    recorder = _Recorder()                                 # in-process: the same text, written piece by piece
    monkeypatch.setattr(sys, "stdout", recorder)
    assert main(["generate", str(d / "run"), "--prompt", "the quick", "--max-new-tokens", "15", "--seed", "3"]) == 0
    assert "".join(recorder.writes) == out.stdout
    assert len(recorder.writes) > 5 and recorder.flushes >= len(recorder.writes)


def test_generate_with_a_draft_gives_the_same_greedy_text_and_passes_per_token(trained):
    d, r = trained
    assert r.returncode == 0, r.stderr
    args = ["generate", d / "run", "--prompt", "the", "--temperature", "0", "--max-new-tokens", "20"]
    plain = run_cli(*args)
    spec = run_cli(*args, "--draft", d / "run" / "step-0000010", "--num-draft-tokens", "3")
    assert plain.returncode == 0 and spec.returncode == 0, plain.stderr + spec.stderr
    assert spec.stdout == plain.stdout
    m = re.search(r"([0-9.]+) target forward passes per generated token", spec.stderr)
    assert m and 0.0 < float(m.group(1)) <= 1.0, spec.stderr
    assert "passes per" not in plain.stderr


def test_generate_from_a_hugging_face_gpt2_directory(tmp_path):
    pytest.importorskip("transformers")
    hf, tok = tiny_gpt2_dir(tmp_path, n_embd=32)
    prompt = tok.encode("the quick").ids
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)[0].tolist()
    expected = tok.decode(ref[:ref.index(0, len(prompt))] if 0 in ref[len(prompt):] else ref)
    r = run_cli("generate", tmp_path, "--prompt", "the quick", "--temperature", "0", "--max-new-tokens", "6")
    assert r.returncode == 0, r.stderr
    assert r.stdout == expected + "\n"


def _one_error_line(err: str, command: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith(f"attnlab {command}: error: "), err
    return lines[0]


def test_bad_input_is_one_line_and_exit_code_2(trained, tmp_path, capsys):
    d, _ = trained
    r = run_cli("train", "lm", "--data", tmp_path / "missing.txt", "--out", tmp_path / "r")
    assert r.returncode == 2 and "missing.txt" in _one_error_line(r.stderr, "train")
    assert main(["generate", str(d / "run"), "--prompt", "x" * 40]) == 2
    assert "context is 32 tokens" in _one_error_line(capsys.readouterr().err, "generate")
    assert main(["train", "lm", "--model", "bert", "--data", str(d / "text.txt"), "--out", str(tmp_path / "r")]) == 2
    assert "'bert' is not a registered causal-LM family" in _one_error_line(capsys.readouterr().err, "train")
    assert main(["train", "lm", "--experts", "4", "--data", str(d / "text.txt"), "--out", str(tmp_path / "r")]) == 2
    assert "--experts applies to --model mixtral, not --model gpt2" in _one_error_line(capsys.readouterr().err, "train")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "no-such-model"}')
    assert main(["generate", str(tmp_path / "hf"), "--prompt", "x"]) == 2
    assert "unsupported model_type 'no-such-model'" in _one_error_line(capsys.readouterr().err, "generate")
    assert main(["generate", str(tmp_path / "nothing")]) == 2
    assert "no checkpoint at" in _one_error_line(capsys.readouterr().err, "generate")
    with pytest.raises(SystemExit) as e:                      # an lm option is not a translate option
        main(["train", "translate", "--context", "8", "--out", str(tmp_path / "r")])
    assert e.value.code == 2 and "unrecognized arguments: --context 8" in capsys.readouterr().err


# ----------------------------------------------------------------------------- perplexity (attnlab eval)
def _hf_sliding_window_nll(hf, ids: list[int], context: int, stride: int) -> tuple[float, int]:
    """Hugging Face's documented perplexity recipe (labels -100 for the context part, the model's own
    shifted loss), written independently of attnlab: the summed NLL and the number of predictions."""
    total, count, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + context, len(ids))
        x = torch.tensor([ids[begin:end]])
        labels = x.clone()
        labels[:, :-(end - prev_end)] = -100
        with torch.no_grad():
            loss = hf(input_ids=x, labels=labels).loss
        n = int((labels[:, 1:] != -100).sum())
        total, count, prev_end = total + float(loss) * n, count + n, end
        if end == len(ids):
            break
    return total, count


@pytest.mark.parametrize("stride", [3, 8, 15])
def test_text_perplexity_matches_transformers_sliding_windows(tmp_path, stride):
    pytest.importorskip("transformers")
    hf, tok = tiny_gpt2_dir(tmp_path, n_embd=32)              # context 16
    text = " ".join(["the quick brown fox jumps over the lazy dog", "a cat"] * 7)
    ids = tok.encode(text).ids
    assert len(ids) > 3 * 16                                  # several windows
    lm = load_lm(tmp_path, "cpu")
    got = text_perplexity(lm, text, stride=stride, batch_size=2)
    nll, count = _hf_sliding_window_nll(hf, ids, 16, stride)
    assert got["tokens"] == count == len(ids) - 1             # every token but the first, once
    assert got["loss"] == pytest.approx(nll / count, rel=1e-5, abs=1e-6)
    assert got["ppl"] == pytest.approx(math.exp(nll / count), rel=1e-5)
    assert got["bits_per_byte"] == pytest.approx(nll / math.log(2) / len(text.encode()), rel=1e-5)
    cut = text_perplexity(lm, text, stride=stride, max_tokens=20)
    nll20, count20 = _hf_sliding_window_nll(hf, ids[:20], 16, stride)
    assert cut["tokens"] == count20 == 19 and cut["loss"] == pytest.approx(nll20 / count20, rel=1e-5)


def test_text_perplexity_rejects_bad_arguments(tmp_path):
    pytest.importorskip("transformers")
    tiny_gpt2_dir(tmp_path, n_embd=32)
    lm = load_lm(tmp_path, "cpu")
    for stride in (0, 16):
        with pytest.raises(ValueError, match=r"stride must be in \[1, context - 1\] = \[1, 15\]"):
            text_perplexity(lm, "the quick brown fox", stride=stride)
    with pytest.raises(ValueError, match="at least 2"):
        text_perplexity(lm, "the")
    with pytest.raises(ValueError, match="max_tokens must be at least 2"):
        text_perplexity(lm, "the quick brown fox", max_tokens=1)


def test_eval_scores_a_language_model_and_its_int8_change(trained, tmp_path):
    d, _ = trained
    held = tmp_path / "held.txt"
    held.write_text(TEXT[:600])
    r = run_cli("eval", d / "run", "--data", held, "--quantize", "int8", "--stride", "8")
    assert r.returncode == 0, r.stderr
    first, windows, int8, change = r.stdout.splitlines()
    fp32_ppl = float(re.search(r"perplexity (\d+\.\d+)", first).group(1))
    q_ppl = float(re.search(r"perplexity (\d+\.\d+)", int8).group(1))
    assert first.startswith(f"{held}: ") and "stride 8" in windows and "599 tokens scored" in windows
    assert 1.0 < fp32_ppl < 30 and abs(q_ppl / fp32_ppl - 1) < 0.02               # a trained char model; int8 close
    assert re.fullmatch(r"  perplexity change with int8: [+-]\d+\.\d\d %", change)
    assert fp32_ppl == pytest.approx(text_perplexity(load_lm(d / "run", "cpu"), TEXT[:600], stride=8)["ppl"],
                                     abs=1e-4)
    bad = run_cli("eval", d / "run", "--data", held, "--stride", "32")
    assert bad.returncode == 2 and "stride must be in [1, context - 1] = [1, 31]" in _one_error_line(bad.stderr, "eval")
