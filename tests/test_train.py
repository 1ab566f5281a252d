"""The Trainer and its pieces: loss, schedules, optimizer groups, accumulation, checkpoints,
exact resume after SIGKILL, torchrun equivalence, metrics and plot.

The task is tests/_train_worker.py (reverse random padded sequences with a tiny Transformer);
the subprocess tests run it as a script. Tolerances: label smoothing 1e-6 (fp32); gradient
accumulation 1e-6 absolute on every gradient; torchrun 2 x (B/4, accumulation 2) against one
process with B: loss curve within 1e-5 relative; resume: bit-identical.
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

import attnlab.train.checkpoint as ckpt_mod
from attnlab.models import Transformer
from attnlab.nn import DyT, RMSNorm
from attnlab.train import (CheckpointManager, TrainConfig, Trainer, label_smoothed_cross_entropy, load_checkpoint,
                           noam, noam_schedule, plot_metrics, split_decay)
from attnlab.train.distributed import shard_plan
from attnlab.train.schedules import cosine_schedule, constant_schedule

sys.path.insert(0, str(Path(__file__).parent))
from _train_worker import PAD, ReverseTask  # noqa: E402
from _tolerance import FP32_OP, assert_close_scaled  # noqa: E402  (tests/ is on sys.path under pytest)

WORKER = Path(__file__).parent / "_train_worker.py"
REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: one intra-op thread is faster, and on a busy 2-core machine a second OpenMP
    thread made each matmul ~100x slower (spin-waiting). Subprocesses get OMP_NUM_THREADS=1."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"))


def _worker(out: Path, *args: str) -> list[str]:
    return [sys.executable, str(WORKER), "--out", str(out), *args]


def _cfg(tmp_path: Path, **kw) -> TrainConfig:
    base = dict(out_dir=tmp_path / "run", steps=4, lr=1e-3, schedule="constant", progress=False, device="cpu",
                precision="fp32", log_every=1)
    return TrainConfig(**{**base, **kw})


# ----------------------------------------------------------------------------- losses
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_label_smoothing_equals_torch_and_ignores_padding(smoothing, reduction):
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 11, requires_grad=True)
    target = torch.randint(1, 11, (3, 7))
    target[0, 4:] = PAD
    target[2, 1:] = PAD
    ours = label_smoothed_cross_entropy(logits, target, smoothing, ignore_index=PAD, reduction=reduction)
    ref = F.cross_entropy(logits.reshape(-1, 11), target.reshape(-1), ignore_index=PAD, label_smoothing=smoothing,
                          reduction=reduction)
    assert_close_scaled(ours, ref, FP32_OP, "loss vs F.cross_entropy")
    g_ours, = torch.autograd.grad(ours, logits)
    g_ref, = torch.autograd.grad(ref, logits)
    assert_close_scaled(g_ours, g_ref, FP32_OP, "gradient vs F.cross_entropy's")
    assert g_ours[target == PAD].abs().max() == 0  # padding gets no gradient, not even from smoothing


# ----------------------------------------------------------------------------- schedules
def test_noam_equals_paper_formula_and_peaks_at_warmup():
    d, warmup = 512, 4000
    for step in (1, 2, 10, 3999, 4000, 4001, 10_000, 100_000):
        assert noam(step, d, warmup) == pytest.approx(d ** -0.5 * min(step ** -0.5, step * warmup ** -1.5), rel=1e-12)
    rates = [noam(s, d, warmup) for s in range(1, 20_001)]
    assert rates.index(max(rates)) + 1 == warmup
    assert max(rates) == pytest.approx((d * warmup) ** -0.5)
    # as a LambdaLR with lr = 1.0, the s-th optimizer step (s from 1) uses noam(s)
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = noam_schedule(opt, d_model=16, warmup=4)
    for s in range(1, 9):
        assert opt.param_groups[0]["lr"] == pytest.approx(noam(s, 16, 4))
        opt.step()
        sched.step()
    with pytest.raises(ValueError):
        noam(0, 16, 4)


def test_cosine_and_constant_warmup():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = cosine_schedule(opt, warmup=4, total_steps=12, min_lr_ratio=0.1)
    lrs = []
    for _ in range(14):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:4] == pytest.approx([0.5, 1.0, 1.5, 2.0])                      # steps 1..4
    assert lrs[7] == pytest.approx(0.2 + 1.8 * 0.5 * (1 + math.cos(math.pi * 0.5)))  # step 8: halfway
    assert lrs[11] == pytest.approx(0.2) and lrs[13] == pytest.approx(0.2)      # floor from step 12 on
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = constant_schedule(opt, warmup=2)
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.5, 1.0, 1.0, 1.0])


# ----------------------------------------------------------------------------- optimizer groups
def test_no_weight_decay_on_norms_biases_embeddings_and_tied_weight_once(tmp_path):
    model = Transformer(13, 13, d_model=16, num_heads=2, num_encoder_layers=1, num_decoder_layers=1, d_ff=32,
                        tie_output=True, share_embeddings=True, norm_first=True)
    model.extra = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), RMSNorm(16), DyT(16), nn.Embedding(5, 16))
    decay, no_decay = split_decay(model)
    decay_names, no_decay_names = {n for n, _ in decay}, {n for n, _ in no_decay}
    ids = [id(p) for _, p in decay + no_decay]
    assert len(ids) == len(set(ids)) == len({id(p) for p in model.parameters()})
    tied = model.tgt_embedding.weight
    assert tied is model.output_projection.weight and tied is model.src_embedding.weight
    assert sum(p is tied for _, p in decay + no_decay) == 1
    assert id(tied) in {id(p) for _, p in no_decay}
    for name in ("extra.1.weight", "extra.1.bias", "extra.2.weight", "extra.3.alpha", "extra.3.weight",
                 "extra.4.weight", "extra.0.bias", "encoder_norm.weight"):
        assert name in no_decay_names, name
    assert "extra.0.weight" in decay_names
    assert all(p.ndim >= 2 for _, p in decay)
    assert not any("norm" in n or "embedding" in n or n.endswith("bias") for n in decay_names)
    trainer_groups = Trainer(_Wrap(model), _cfg(tmp_path, weight_decay=0.1)).optimizer.param_groups
    assert [g["weight_decay"] for g in trainer_groups] == [0.1, 0.0]
    assert {id(p) for p in trainer_groups[1]["params"]} == {id(p) for _, p in no_decay}


class _Wrap:
    def __init__(self, model):
        self.model = model


# ----------------------------------------------------------------------------- accumulation
def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gradient_accumulation_equals_one_big_batch(tmp_path):
    task = ReverseTask(n_examples=16, micro=8, dropout=0.0)
    src, tgt_in, tgt_out = (t[:8] for t in task.data)
    small, large = (src[:3], tgt_in[:3], tgt_out[:3]), (src[3:], tgt_in[3:], tgt_out[3:])
    n_small, n_large = int((small[2] != PAD).sum()), int((large[2] != PAD).sum())
    assert n_small / 3 != n_large / 5  # uneven tokens per example: per-micro-batch means would be wrong
    big_task = ReverseTask(n_examples=16, micro=8, dropout=0.0)
    big_task.model.load_state_dict(task.model.state_dict())

    # Adam's first update is about lr * g / |g|: it amplifies round-off in near-zero gradients
    # without bound. eps = 1e-3 makes the update Lipschitz in g (constant lr / eps = 1), so equal
    # gradients must give equal weights.
    accum = Trainer(task, _cfg(tmp_path / "a", accum_steps=2, eps=1e-3))
    loss_a, tokens_a, _, _ = accum.accumulate([small, large])
    one = Trainer(big_task, _cfg(tmp_path / "b", eps=1e-3))
    loss_b, tokens_b, _, _ = one.accumulate([(src, tgt_in, tgt_out)])
    assert tokens_a == tokens_b == n_small + n_large
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    ga, gb = _grads(task.model), _grads(big_task.model)
    assert ga.keys() == gb.keys()
    # one vector: a key-projection bias has an exactly-zero gradient (softmax ignores a constant
    # shift), so its own scale is round-off; the scale that matters is the whole gradient's
    assert_close_scaled(torch.cat([ga[k].flatten() for k in ga]), torch.cat([gb[k].flatten() for k in ga]),
                        FP32_OP, "accumulated vs one-batch gradients")

    one._optimizer_step()
    accum._optimizer_step()
    for a, b in zip(task.model.parameters(), big_task.model.parameters()):
        assert_close_scaled(a, b, FP32_OP, "weights after one step")

    # the classic bug (mean per micro-batch, averaged) is far outside that tolerance
    naive_model = ReverseTask(n_examples=16, micro=8, dropout=0.0).model
    naive_model.load_state_dict(big_task.model.state_dict())
    big_task.model.zero_grad()
    one.accumulate([(src, tgt_in, tgt_out)])
    for mb in (small, large):
        logits = naive_model(mb[0], mb[1])
        (label_smoothed_cross_entropy(logits, mb[2], 0.1, PAD, "mean") / 2).backward()
    naive, gb = _grads(naive_model), _grads(big_task.model)
    assert max((naive[k] - gb[k]).abs().max().item() for k in gb) > 1e-4


def test_shard_plan_gives_every_rank_the_same_count():
    plan = list(range(11))
    shards = [shard_plan(plan, r, 4) for r in range(4)]
    assert [len(s) for s in shards] == [2, 2, 2, 2]
    assert sorted(sum(shards, [])) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert shard_plan(plan, 0, 1) == plan


# ----------------------------------------------------------------------------- resume after SIGKILL
RESUME_ARGS = ["--steps", "10", "--save-every", "3", "--accum", "2", "--micro", "4", "--n-examples", "36",
               "--eval-every", "5", "--dropout", "0.1"]


def test_resume_after_sigkill_is_bit_identical(tmp_path):
    """36 examples / micro 4 = 9 micro-batches, 4 steps an epoch (one left over), 10 steps over 3 epochs.
    The victim hangs inside step 8 (loss call 15), after the checkpoint at step 6, and is SIGKILLed."""
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    logs = {name: tmp_path / f"{name}.log" for name in ("ref", "victim")}
    with open(logs["ref"], "wb") as ref_log, open(logs["victim"], "wb") as victim_log:
        ref = subprocess.Popen(_worker(ref_dir, *RESUME_ARGS), env=_env(), stderr=ref_log)
        victim = subprocess.Popen(_worker(run_dir, *RESUME_ARGS, "--hang-at-loss-call", "15"), env=_env(),
                                  stderr=victim_log)
    marker = tmp_path / "run.hanging"
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert victim.poll() is None, logs["victim"].read_text()
        assert time.monotonic() < deadline, "worker never reached the hang point"
        time.sleep(0.05)
    assert (run_dir / "latest").read_text().strip() == "step-0000006"
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 7  # got past step 6
    resumed = subprocess.run(_worker(run_dir, *RESUME_ARGS, "--resume"), env=_env(), capture_output=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr.decode()
    assert ref.wait(timeout=300) == 0, logs["ref"].read_text()

    for name in ("model.safetensors", "optimizer.safetensors"):
        a, b = load_file(ref_dir / "step-0000010" / name), load_file(run_dir / "step-0000010" / name)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), name
    state_a, state_b = (json.loads((d / "step-0000010" / "trainer_state.json").read_text()) for d in (ref_dir, run_dir))
    assert state_a["rng"] == state_b["rng"] and state_a["scheduler"] == state_b["scheduler"]
    curve = lambda d: [(r["step"], r.get("loss"), r.get("val_loss"))  # noqa: E731
                       for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())]
    assert curve(ref_dir) == curve(run_dir)
    # dropout was on, so the restored RNG mattered: a fresh seed would give other weights
    task = ReverseTask(36, 4, 0.1)
    assert any(m.p > 0 for m in task.model.modules() if isinstance(m, nn.Dropout))


# ----------------------------------------------------------------------------- atomic checkpoints
def test_interrupted_checkpoint_write_keeps_previous_loadable(tmp_path, monkeypatch):
    task = ReverseTask(n_examples=16, micro=8, dropout=0.0)
    model = task.model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(*task.data[:2]).sum().backward()
    opt.step()
    manager = CheckpointManager(tmp_path, keep_last=2)
    manager.save(1, model, opt, {"step": 1})
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)

    def boom(*a, **k):  # model.safetensors is already in the temporary directory by now
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_mod, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        manager.save(2, model, opt, {"step": 2})
    monkeypatch.undo()
    assert any(p.name.startswith(".tmp-step-0000002") for p in tmp_path.iterdir())  # half-written, hidden
    assert not (tmp_path / "step-0000002").exists()
    assert (tmp_path / "latest").read_text().strip() == "step-0000001"
    fresh = ReverseTask(n_examples=16, micro=8, dropout=0.0).model
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    state = load_checkpoint(tmp_path, fresh, fresh_opt)
    assert state["step"] == 1
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in saved.items())
    assert fresh.output_projection.weight is fresh.tgt_embedding.weight  # tie survives loading
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])

    # crash after the rename but before the pointer update: latest still names step 1
    monkeypatch.setattr(ckpt_mod, "write_text_atomic", boom)
    with pytest.raises(OSError):
        manager.save(2, model, opt, {"step": 2})
    monkeypatch.undo()
    assert load_checkpoint(tmp_path, fresh)["step"] == 1
    CheckpointManager(tmp_path)  # a restart sweeps the temporary leftovers
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())


# ----------------------------------------------------------------------------- torchrun
def test_torchrun_two_processes_equal_one_process(tmp_path):
    """2 ranks x accumulation 2 x micro-batch 2 against 1 process x one micro-batch of 8."""
    common = ["--steps", "4", "--dropout", "0", "--n-examples", "32", "--lr", "1.0", "--dump-weights"]
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", str(WORKER), "--out", str(tmp_path / "ddp"),
           "--micro", "2", "--accum", "2", *common]
    ddp = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    single = subprocess.run(_worker(tmp_path / "one", "--micro", "8", *common), env=_env(), capture_output=True,
                            timeout=300)
    assert single.returncode == 0, single.stderr.decode()
    out, _ = ddp.communicate(timeout=300)
    assert ddp.returncode == 0, out.decode()[-3000:]
    losses = [[r["loss"] for r in map(json.loads, (tmp_path / d / "metrics.jsonl").read_text().splitlines())
               if r["kind"] == "train"] for d in ("one", "ddp")]
    assert len(losses[0]) == len(losses[1]) == 4
    for a, b in zip(*losses):
        assert abs(a - b) <= 1e-5 * abs(a), losses
    r0, r1 = load_file(tmp_path / "ddp" / "rank0.safetensors"), load_file(tmp_path / "ddp" / "rank1.safetensors")
    assert all(torch.equal(r0[k], r1[k]) for k in r0)  # every parameter synced despite no_sync (pitfall 19)


# ----------------------------------------------------------------------------- metrics, plot, budget, config
def test_metrics_plot_best_and_keep_last(tmp_path):
    task = ReverseTask(n_examples=32, micro=8, dropout=0.1)
    cfg = _cfg(tmp_path, steps=6, save_every=1, keep_last=2, eval_every=2, lr=3e-3, schedule="cosine",
               warmup_steps=2)
    summary = Trainer(task, cfg).fit()
    out = cfg.out_dir
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert {"loss", "lr", "tokens_per_s", "elapsed", "correct"} <= train[0].keys()
    assert all(math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 for r in train)
    assert [r["step"] for r in evals] == [2, 4, 6] and all("val_loss" in r for r in evals)
    png = out / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    assert sorted(p.name for p in out.glob("step-*")) == ["step-0000005", "step-0000006"]
    assert (out / "latest").read_text().strip() == "step-0000006"
    best = json.loads((out / "best" / "trainer_state.json").read_text())
    assert best["best"]["value"] == min(r["val_loss"] for r in evals) and (out / "best" / "vocab.txt").exists()
    assert summary["step"] == 6 and not summary["stopped_early"]
    plot_metrics(out / "metrics.jsonl", tmp_path / "again.png")
    assert (tmp_path / "again.png").stat().st_size > 1000


def test_time_budget_stops_with_checkpoint_and_resume_continues(tmp_path):
    task = ReverseTask(n_examples=32, micro=8, dropout=0.0)
    summary = Trainer(task, _cfg(tmp_path, steps=50, time_budget_s=1e-9)).fit()
    assert summary["stopped_early"] and summary["step"] == 1
    assert (tmp_path / "run" / "latest").read_text().strip() == "step-0000001"
    again = Trainer(ReverseTask(n_examples=32, micro=8, dropout=0.0), _cfg(tmp_path, steps=3), resume=True)
    assert again.step == 1
    assert again.fit()["step"] == 3
    with pytest.raises(ValueError, match="accum_steps"):
        Trainer(ReverseTask(n_examples=32, micro=8), _cfg(tmp_path, steps=5, accum_steps=2), resume=True)
    with pytest.raises(FileNotFoundError):
        Trainer(ReverseTask(n_examples=32, micro=8), _cfg(tmp_path / "x"), resume=tmp_path / "nowhere")
    with pytest.raises(ValueError, match="resume=True"):  # a fresh run must not mix with old checkpoints
        Trainer(ReverseTask(n_examples=32, micro=8), _cfg(tmp_path, steps=5))
    gc = Trainer(ReverseTask(n_examples=32, micro=8), _cfg(tmp_path / "gc", grad_checkpointing=True))
    assert gc.model.gradient_checkpointing is True


def test_bf16_on_cpu_trains_and_fp16_on_cpu_is_refused(tmp_path):
    task = ReverseTask(n_examples=16, micro=8, dropout=0.0)
    summary = Trainer(task, _cfg(tmp_path, steps=2, precision="bf16")).fit()
    assert math.isfinite(summary["loss"])
    with pytest.raises(ValueError, match="fp16"):
        Trainer(ReverseTask(16, 8), _cfg(tmp_path / "h", precision="fp16"))


@pytest.mark.parametrize("field,value,match", [
    ("steps", 0, "steps"), ("lr", -1.0, "lr"), ("accum_steps", 0, "accum_steps"), ("schedule", "linear", "schedule"),
    ("precision", "fp8", "precision"), ("clip_norm", 0.0, "clip_norm"), ("betas", (0.9, 1.0), "betas"),
    ("best_mode", "up", "best_mode"), ("warmup_steps", -1, "warmup_steps"), ("min_lr_ratio", 2.0, "min_lr_ratio"),
    ("time_budget_s", 0.0, "time_budget_s")])
def test_config_validation(tmp_path, field, value, match):
    with pytest.raises(ValueError, match=match):
        _cfg(tmp_path, **{field: value})


def test_noam_config_needs_warmup(tmp_path):
    with pytest.raises(ValueError, match="warmup"):
        _cfg(tmp_path, schedule="noam", warmup_steps=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cuda_mixed_precision_and_resume(tmp_path, precision):
    cfg = lambda steps: _cfg(tmp_path, steps=steps, device="cuda", precision=precision, lr=1.0,  # noqa: E731
                             schedule="noam", warmup_steps=4, accum_steps=2, save_every=2)
    task = ReverseTask(n_examples=32, micro=4, dropout=0.1)
    summary = Trainer(task, cfg(4)).fit()
    assert math.isfinite(summary["loss"])
    state = json.loads((tmp_path / "run" / "step-0000004" / "trainer_state.json").read_text())
    assert state["rng"][0]["cuda"] and (state["scaler"] is not None) == (precision == "fp16")
    resumed = Trainer(ReverseTask(n_examples=32, micro=4, dropout=0.1), cfg(6), resume=True)
    assert resumed.step == 4
    assert resumed.fit()["step"] == 6
