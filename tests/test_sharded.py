"""Sharded training (FSDP2, ``TrainConfig(shard=True)`` / ``--shard``) and its distributed checkpoints.

The runs are tests/_train_worker.py's NextTokenTask (a tiny GPT-2 with its tied head, or a tiny
LLaMA, on random padded sequences) and its ReverseTask (the 2017 Transformer, encoder and decoder
sharing one embedding tied to the head, label smoothing 0.1), two processes under torchrun with gloo on CPU against one
process without sharding and the same global batch of 8 sequences: 2 ranks x accumulation 2 x
micro-batches of 2, gradient clipping at 0.1 (below the gradient norm, so it acts every step).
A checkpoint written by 2 processes loads into 3 (torch.distributed.checkpoint re-shards it).

Tolerances: the loss of every step within 1e-5 relative (fp32; the order of the gradient sums
differs between one process and a reduce-scatter); the final weights within 1e-5 absolute after
4 steps of lr 1e-2 (measured: ~5e-7), all but the key projection's bias, whose gradient is zero
in exact arithmetic, so that AdamW's normalisation turns its rounding noise into steps of up to
the lr (measured: 1e-5 to 2e-3). Resuming a sharded run, killed during a save, is bit-identical
to the run that was not interrupted.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from attnlab.models.gpt import GPT, GPTConfig
from attnlab.train import TrainConfig, Trainer
from attnlab.train.checkpoint import CheckpointManager
from attnlab.train.sharded import load_gathered, load_sharded, transformer_blocks

from test_train import BIN, WORKER, _env, _worker  # noqa: E402  (tests/ is on sys.path under pytest)

COMMON = ["--n-examples", "32", "--lr", "1e-2", "--schedule", "constant", "--warmup", "0", "--clip", "0.1",
          "--dump-weights"]


def _torchrun(out: Path, *args: str, nproc: int = 2) -> subprocess.Popen:
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", str(nproc), str(WORKER), "--out", str(out),
           *args]
    return subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=300)
    return out.decode()[-3000:]


def _losses(run: Path) -> list[float]:
    records = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return [r["loss"] for r in records if r["kind"] == "train"]


def _without_key_bias(name: str, t: torch.Tensor) -> torch.Tensor | None:
    """``t`` less the key projection's bias, which gets no gradient in exact arithmetic (it shifts
    all of a query's scores by one constant, which the softmax removes): its rounding noise,
    normalised by AdamW, moves it by up to lr a step, one way or the other."""
    if name.endswith("k_proj.bias"):
        return None
    if name.endswith("qkv_proj.bias"):
        third = t.shape[0] // 3
        return torch.cat([t[:third], t[2 * third:]])
    return t


@pytest.mark.parametrize("family", ["gpt2", "llama", pytest.param("reverse", marks=pytest.mark.slow)])
def test_two_sharded_processes_equal_one_process(tmp_path, family):
    args = ["--model", family, "--steps", "4", "--dropout", "0", *COMMON]
    sharded = _torchrun(tmp_path / "fsdp", "--shard", "--micro", "2", "--accum", "2", *args)
    single = subprocess.run(_worker(tmp_path / "one", "--micro", "8", *args), env=_env(), capture_output=True,
                            timeout=300)
    assert single.returncode == 0, single.stderr.decode()[-3000:]
    log = _finish(sharded)
    assert sharded.returncode == 0, log
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "fsdp")
    assert len(one) == len(two) == 4
    for a, b in zip(one, two):
        assert abs(a - b) <= 1e-5 * abs(a), (one, two)
    ref, got = load_file(tmp_path / "one" / "rank0.safetensors"), load_file(tmp_path / "fsdp" / "rank0.safetensors")
    assert set(ref) <= set(got)
    for k in ref:
        a, b = _without_key_bias(k, ref[k]), _without_key_bias(k, got[k])
        assert a is None or (a - b).abs().max() <= 1e-5, k
    if family == "gpt2":    # the head stayed tied to the token embedding: one tensor, trained as one
        assert torch.equal(got["lm_head.weight"], got["token_embedding.weight"])
        unclipped = subprocess.run(_worker(tmp_path / "free", "--micro", "8", *args, "--clip", "0"), env=_env(),
                                   capture_output=True, timeout=300)
        assert unclipped.returncode == 0, unclipped.stderr.decode()[-3000:]
        assert abs(_losses(tmp_path / "free")[-1] - one[-1]) > 1e-4   # the clipping acted, and equally
    # the sharded checkpoint: every rank's shards and the metadata, vouched for by the manifest
    step = tmp_path / "fsdp" / "step-0000004"
    manifest = json.loads((step / "manifest.json").read_text())["files"]
    shards = sorted(name for name in manifest if name.startswith("shards/"))
    assert shards == [f"shards/shard-0000{r}-model-00001-of-00001.safetensors" for r in (1, 2)], shards
    assert "trainer_state.json" in manifest and not (step / "model.safetensors").exists()
    # gathered in one process, without a process group, they are the whole weights
    if family == "llama":
        from _train_worker import NextTokenTask
        model = NextTokenTask("llama").model
        load_gathered(step, model)
        assert all(torch.equal(p, got[k]) for k, p in model.state_dict().items()), "gathered weights differ"


@pytest.mark.slow
def test_bf16_shards_compute_in_bf16_reduce_and_keep_fp32_and_match_one_process_autocast(tmp_path):
    """--precision bf16 under --shard: FSDP's MixedPrecisionPolicy gathers a block's weights in bf16
    for its forward, while the stored (sharded) weights, their gradients and AdamW's moments stay
    fp32; the losses follow one process under bf16 autocast within 5e-3 relative (measured 6e-4; bf16
    keeps 8 bits, and autocast leaves the norms and the embedding fp32 where the policy casts them)."""
    args = ["--model", "llama", "--steps", "4", "--precision", "bf16", *COMMON]
    sharded = _torchrun(tmp_path / "fsdp", "--shard", "--micro", "2", "--accum", "2", "--record", *args)
    single = subprocess.run(_worker(tmp_path / "one", "--micro", "8", *args), env=_env(), capture_output=True,
                            timeout=300)
    assert single.returncode == 0, single.stderr.decode()[-3000:]
    log = _finish(sharded)
    assert sharded.returncode == 0, log
    seen = json.loads((tmp_path / "fsdp" / "record.json").read_text())
    assert seen == {"compute": "torch.bfloat16", "stored": "torch.float32", "grad": "torch.float32",
                    "optimizer": ["torch.float32"], "block_forwards": 9}, seen    # 4 x 2 + the evaluation
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "fsdp")
    assert len(one) == len(two) == 4
    assert all(abs(a - b) <= 5e-3 * abs(a) for a, b in zip(one, two)), (one, two)     # measured: 6e-4


@pytest.mark.slow
def test_activation_checkpointing_under_shard_recomputes_each_block_with_equal_losses(tmp_path):
    """--grad-checkpointing (the models' own per-block activation checkpointing) under --shard: the
    first block runs forward twice a micro-batch (the second time in the backward, its weights
    gathered again by FSDP), and the losses and final weights equal those of the sharded run
    without it to fp32 round-off (1e-6 relative, 1e-6 absolute)."""
    args = ["--model", "llama", "--shard", "--micro", "2", "--accum", "2", "--steps", "4", "--record", *COMMON]
    plain, recompute = _torchrun(tmp_path / "plain", *args), _torchrun(tmp_path / "ac", *args, "--grad-checkpointing")
    for proc in (plain, recompute):
        log = _finish(proc)
        assert proc.returncode == 0, log
    runs = [json.loads((tmp_path / name / "record.json").read_text()) for name in ("plain", "ac")]
    assert [r["block_forwards"] for r in runs] == [9, 17], runs   # 4 steps x 2 micro-batches a rank, + the evaluation
    a, b = _losses(tmp_path / "plain"), _losses(tmp_path / "ac")
    assert len(a) == 4 and all(abs(x - y) <= 1e-6 * abs(x) for x, y in zip(a, b)), (a, b)
    wa, wb = load_file(tmp_path / "plain" / "rank0.safetensors"), load_file(tmp_path / "ac" / "rank0.safetensors")
    assert all((wa[k] - wb[k]).abs().max() <= 1e-6 for k in wa)


@pytest.fixture
def one_rank_group():
    """A gloo group of this one process, for fully_shard in the test process (the short versions
    of the two-process tests); shard_model's guard reads the DistEnv, so it is told of 2 ranks."""
    import torch.distributed as dist

    from attnlab.train.distributed import DistEnv
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DistEnv(world_size=2)
    finally:
        dist.destroy_process_group()


def _sharded_llama(env, precision: str = "fp32"):
    from _train_worker import NextTokenTask
    from attnlab.train.sharded import shard_model
    task = NextTokenTask("llama")
    return task, shard_model(task.model, env, precision)


def test_sharded_bf16_computes_in_bf16_and_keeps_fp32_weights_and_gradients(one_rank_group):
    """The short version of the two-process bf16 test: under shard_model(..., "bf16") a block's
    linear layer computes with bf16 weights; its stored weight and its gradient are fp32."""
    task, model = _sharded_llama(one_rank_group, "bf16")
    linear = next(m for m in model.layers[0].modules() if isinstance(m, nn.Linear))
    seen = []
    linear.register_forward_pre_hook(lambda m, a: seen.append(m.weight.dtype))      # append returns None
    task.loss(model, task.plan(0, 0)[0])[0].backward()
    assert seen == [torch.bfloat16]
    assert linear.weight.dtype == torch.float32 and linear.weight.grad.dtype == torch.float32


def test_sharded_activation_checkpointing_recomputes_with_equal_gradients(one_rank_group):
    """The short version of the two-process test: with gradient_checkpointing a sharded block runs
    forward twice (the second time in the backward) and every gradient equals the one without
    (1e-6 absolute)."""
    grads, calls = [], []
    for recompute in (False, True):
        task, model = _sharded_llama(one_rank_group)
        model.gradient_checkpointing = recompute
        count = []
        model.layers[0].register_forward_pre_hook(lambda m, a: count.append(1))      # append returns None
        task.loss(model, task.plan(0, 0)[0])[0].backward()
        grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
        calls.append(len(count))
    assert calls == [1, 2]
    assert all((grads[0][n] - grads[1][n]).abs().max() <= 1e-6 for n in grads[0])


def test_the_policy_casts_only_under_bf16():
    from attnlab.train.sharded import mixed_precision
    assert (mixed_precision("bf16").param_dtype, mixed_precision("bf16").reduce_dtype) == (torch.bfloat16,
                                                                                           torch.float32)
    for precision in ("fp32", "fp16"):
        assert (mixed_precision(precision).param_dtype, mixed_precision(precision).reduce_dtype) == (None, None)


def test_killed_during_sharded_save_resumes_bit_identical(tmp_path):
    """Rank 1 is SIGKILLed after writing its shards of step 4, before rank 0 completes the step: the
    run resumes from step 2, and its weights at step 6 are those of the uninterrupted run."""
    args = ["--model", "llama", "--shard", "--micro", "2", "--accum", "2", "--steps", "6", "--save-every", "2",
            *COMMON]
    whole = _torchrun(tmp_path / "whole", *args)
    killed = _torchrun(tmp_path / "run", *args, "--kill-after-shards-at", "4")
    log = _finish(killed)
    assert killed.returncode != 0, log
    run = tmp_path / "run"
    assert (run / "latest").read_text().strip() == "step-0000002"
    assert (run / ".tmp-step-0000004-sharded" / "shards").is_dir() and not (run / "step-0000004").exists()
    shutil.copytree(run, tmp_path / "one")          # for test_a_two_process_run_resumes_under_one_and_four
    resumed = _torchrun(run, *args, "--resume")
    log = _finish(resumed)
    assert resumed.returncode == 0, log
    log = _finish(whole)
    assert whole.returncode == 0, log
    assert not any(p.name.startswith(".tmp") for p in run.iterdir())
    want, b = load_file(tmp_path / "whole" / "rank0.safetensors"), load_file(run / "rank0.safetensors")
    assert set(want) == set(b) and all(torch.equal(want[k], b[k]) for k in want)
    assert _losses(tmp_path / "whole") == _losses(run)
    # the same killed run resumed in one process (no --shard: the shards are gathered into the whole
    # model and AdamW state) with accumulation 4, the same 8 micro-batches a step
    one = tmp_path / "one"
    single = subprocess.run(_worker(one, *[a for a in args if a != "--shard"], "--accum", "4", "--resume"),
                            env=_env(), capture_output=True, timeout=300)
    assert single.returncode == 0, single.stderr.decode()[-3000:]
    _assert_continues(_losses(tmp_path / "whole"), _losses(one), want, load_file(one / "rank0.safetensors"))
    assert (one / "step-0000006" / "model.safetensors").is_file()     # one process writes a whole checkpoint


def _assert_continues(want: list[float], got: list[float], weights: dict, got_weights: dict) -> None:
    """The resumed run's losses equal the uninterrupted run's, all 6 steps (the first two recorded
    before the save), within 1e-5 relative, and its final weights within 1e-5 absolute."""
    assert len(want) == len(got) == 6, (want, got)
    assert all(abs(x - y) <= 1e-5 * abs(x) for x, y in zip(want, got)), (want, got)
    assert set(weights) == set(got_weights)
    for k, v in weights.items():
        assert (v - got_weights[k]).abs().max() <= 1e-5, k


@pytest.mark.slow
def test_a_two_process_sharded_run_resumes_under_four(tmp_path):
    """A checkpoint of 2 sharded processes x accumulation 2, resumed by 4 sharded processes x 1 (the
    same micro-batches a step; torch.distributed.checkpoint re-shards on load), continues with the
    losses and weights of the uninterrupted 2-process run (1e-5 relative, 1e-5 absolute)."""
    args = ["--model", "llama", "--shard", "--micro", "2", "--steps", "6", "--save-every", "2", *COMMON]
    whole = _torchrun(tmp_path / "whole", *args, "--accum", "2")
    first = _torchrun(tmp_path / "four", *args, "--accum", "2", "--steps", "2")
    for proc in (whole, first):
        log = _finish(proc)
        assert proc.returncode == 0, log
    four = _torchrun(tmp_path / "four", *args, "--accum", "1", "--resume", nproc=4)
    log = _finish(four)
    assert four.returncode == 0, log
    _assert_continues(_losses(tmp_path / "whole"), _losses(tmp_path / "four"),
                      load_file(tmp_path / "whole" / "rank0.safetensors"),
                      load_file(tmp_path / "four" / "rank0.safetensors"))


def test_resuming_with_another_global_batch_is_refused(tmp_path):
    """A run of accumulation 2 cannot continue with 1 in as many processes: its steps would train
    other micro-batches; the message names both products (processes x accum_steps)."""
    from _train_worker import ReverseTask
    cfg = dict(out_dir=tmp_path / "run", lr=1e-3, device="cpu", progress=False, seed=7)
    Trainer(ReverseTask(n_examples=32, micro=4), TrainConfig(steps=1, accum_steps=2, **cfg)).fit()
    with pytest.raises(ValueError, match=r"written by 1 processes x accum_steps 2 \(2 micro-batches a step\), this "
                                         r"run has 1 x 1; keep processes x accum_steps \(--accum\) at 2"):
        Trainer(ReverseTask(n_examples=32, micro=4), TrainConfig(steps=2, accum_steps=1, **cfg), resume=True)


def test_a_rank_that_cannot_write_its_shards_stops_every_rank_in_one_line(tmp_path):
    """``attnlab train lm --shard`` under torchrun, rank 1's storage refusing the shards of step 4
    (EROFS, as a read-only directory would): both processes end within the timeout (none waits at a
    barrier), each with exit status 2 and the same one line naming rank 1, the step, the system's
    error and the intact checkpoint of step 2; latest still names step 2."""
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    run = tmp_path / "lm"
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", str(WORKER), "cli", "1", "4", "train",
           "lm", "--data", str(text), "--out", str(run), "--shard", "--steps", "6", "--save-every", "2",
           "--eval-every", "2", "--d-model", "16", "--heads", "2", "--layers", "2", "--context", "16",
           "--batch-size", "4", "--sample-tokens", "0", "--no-progress"]
    failed = subprocess.run(cmd, env=_env(), capture_output=True, timeout=240)
    err = failed.stderr.decode()
    lines = [line for line in err.splitlines() if line.startswith("attnlab train: error:")]
    assert failed.returncode != 0 and len(lines) == 2 and lines[0] == lines[1], err[-3000:]
    assert lines[0] == (f"attnlab train: error: {run}: rank 1 could not write its part of the checkpoint of step 4 "
                        f"([Errno 30] Read-only file system: '{run}/.tmp-step-0000004-sharded/shards'); every rank "
                        f"stopped, {run}/step-0000002 is intact and --resume continues from it"), lines[0]
    assert "exitcode  : 2" in err
    assert (run / "latest").read_text().strip() == "step-0000002"


def test_every_family_trains_sharded_with_its_tied_weights_kept_tied(tmp_path):
    """One torchrun launch of 2 processes wraps the tiny preset of every registered causal-lm,
    seq2seq, classifier and image-classifier family (tests/_shard_families.py) and trains it 2 steps
    through the Trainer with --shard: a parameter registered under two names (GPT-2's and Mamba's
    head and token embedding, T5's head and shared embedding) is still one parameter after
    wrapping, and equal in the gathered weights after training; before training the wrapped model's
    outputs equal an unwrapped copy's (1e-5 relative to their scale); the losses are finite and
    the weights move."""
    import math

    import attnlab.models  # noqa: F401
    from attnlab.models.registry import architectures
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", str(Path(__file__).parent /
           "_shard_families.py"), str(tmp_path)]
    done = subprocess.run(cmd, env=_env(), capture_output=True, timeout=400)
    assert done.returncode == 0, done.stdout.decode()[-3000:] + done.stderr.decode()[-3000:]
    results = json.loads((tmp_path / "families.json").read_text())
    kinds = ("causal-lm", "seq2seq", "classifier", "image-classifier")
    # attnlab's own families: the worker registers no other, and a test elsewhere in this process may have
    assert set(results) == {f"{a.model_type}/{a.name}" for a in architectures()
                            if a.kind in kinds and a.model_cls.__module__.startswith("attnlab.")}
    assert {"gpt2/GPT2LMHeadModel", "mamba/MambaForCausalLM", "t5/T5ForConditionalGeneration"} <= {
        name for name, r in results.items() if r["tied"]}
    for name, r in results.items():
        assert all(r["still_tied"]) and r["tied_after_training"] == [True] * len(r["tied"]), (name, r)
        assert r["output_diff"] <= 1e-5, (name, r)
        assert len(r["losses"]) == 2 and all(math.isfinite(x) for x in r["losses"]) and r["trained"], (name, r)


def test_shard_without_torchrun_is_refused(tmp_path, capsys):
    model = GPT(GPTConfig(vocab_size=13, n_positions=8, d_model=8, num_heads=2, num_layers=1, dropout=0.0))
    task = type("T", (), {"model": model, "plan": lambda self, e, s: [], "loss": None})()
    with pytest.raises(ValueError, match=r"--shard\) splits the model over several processes.*torchrun"):
        Trainer(task, TrainConfig(out_dir=tmp_path / "run", steps=1, shard=True, device="cpu", progress=False))
    from attnlab.cli import main
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    code = main(["train", "lm", "--data", str(text), "--out", str(tmp_path / "lm"), "--shard", "--steps", "1",
                 "--d-model", "16", "--heads", "2", "--layers", "1", "--context", "16", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("attnlab train: error: TrainConfig: shard=True (--shard) splits"), err


def test_blocks_are_the_layer_lists_entries_and_a_tied_block_is_left_to_the_root():
    model = GPT(GPTConfig(vocab_size=13, n_positions=8, d_model=8, num_heads=2, num_layers=3, dropout=0.0))
    assert transformer_blocks(model) == list(model.layers)
    model.layers[1].ff.linear1.weight = nn.Parameter(torch.zeros(32, 8))
    model.extra = nn.Linear(8, 32)
    model.extra.weight = model.layers[1].ff.linear1.weight       # used by a module outside its block
    assert transformer_blocks(model) == [model.layers[0], model.layers[2]]
    nested = nn.Module()        # a list of lists (ALBERT's groups of layers): the inner entries
    nested.groups = nn.ModuleList([nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]), nn.ModuleList([nn.Linear(2, 2)])])
    assert transformer_blocks(nested) == [*nested.groups[0], *nested.groups[1]]


def test_a_sharded_checkpoint_is_refused_by_the_unsharded_loader(tmp_path):
    from attnlab.train.checkpoint import load_checkpoint
    manager = CheckpointManager(tmp_path)
    staged = tmp_path / ".tmp-step-0000001-sharded"
    (staged / "shards").mkdir(parents=True)
    (staged / "shards" / "__0_0.distcp").write_bytes(b"x")
    manager.finalise(1, staged, {"step": 1})
    assert (tmp_path / "latest").read_text().strip() == "step-0000001"
    with pytest.raises(ValueError, match=r"written by a sharded run \(--shard\).*resume it with --shard"):
        load_checkpoint(tmp_path, nn.Linear(2, 2))
    plain = tmp_path / "plain"
    CheckpointManager(plain).save(1, nn.Linear(2, 2), None, {"step": 1})
    with pytest.raises(ValueError, match=r"written by a run without --shard.*resume it without --shard"):
        load_sharded(plain, nn.Linear(2, 2))


def test_attnlab_train_shard_under_torchrun_then_export_to_transformers(tmp_path, capsys):
    """``attnlab train lm --shard`` under torchrun (the run's closing sample generates from the sharded
    checkpoint, gathered), then ``attnlab export``: transformers' logits equal those of a GPT-2 whose
    weights are the rank shards concatenated along the first dimension (FSDP2 splits dim 0 in rank
    order), read with safetensors alone. fp32, 1e-5 relative to the logits' scale."""
    import transformers

    from attnlab.cli import main
    from attnlab.tasks.run import build_model, open_run
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    run = tmp_path / "lm"
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", "-m", "attnlab.cli", "train", "lm",
           "--data", str(text), "--out", str(run), "--shard", "--steps", "3", "--d-model", "16", "--heads", "2",
           "--layers", "2", "--context", "16", "--batch-size", "4", "--sample-tokens", "8", "--no-progress"]
    trained = subprocess.run(cmd, env=_env(), capture_output=True, timeout=300)
    assert trained.returncode == 0, trained.stderr.decode()[-3000:]
    assert b"sample (the start of the validation text" in trained.stdout
    step = run / "step-0000003"
    assert (step / "shards").is_dir() and not (step / "model.safetensors").exists()
    assert main(["export", str(run), str(tmp_path / "hf")]) == 0, capsys.readouterr().err
    parts = [load_file(f) for f in sorted((step / "shards").glob("*.safetensors"))]
    whole = {k[len("model."):]: torch.cat([p[k] for p in parts]) for k in parts[0] if k.startswith("model.")}
    info = open_run(step)
    ours = build_model(info.model_type, info.config, info.architecture)
    missing, unexpected = ours.load_state_dict(whole, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected      # the tied head is stored once, as the embedding
    assert torch.equal(ours.lm_head.weight, whole["token_embedding.weight"])
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, ours.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = ref(ids).logits, ours.eval()(ids)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
    # --resume in one process without --no-shard: --shard comes from the saved run, so the message names
    # the flags that work here rather than "leave out --shard", which the user never gave
    assert main(["train", "lm", "--out", str(run), "--resume", "--steps", "4", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "trained sharded (--shard) over 2 processes" in err and "--no-shard --accum 2" in err, err
    assert "leave out --shard" not in err
    # --resume in one process: --no-shard, and --accum 2 for the 2 micro-batches a step of 2 x 1
    assert main(["train", "lm", "--out", str(run), "--resume", "--steps", "4", "--accum", "3", "--no-progress",
                 "--no-shard"]) == 2
    assert "keep processes x accum_steps (--accum) at 2" in capsys.readouterr().err
    assert main(["train", "lm", "--out", str(run), "--resume", "--steps", "4", "--accum", "2", "--no-progress",
                 "--no-shard", "--sample-tokens", "0"]) == 0, capsys.readouterr().err
    assert (run / "step-0000004" / "model.safetensors").is_file()


def test_a_checkpoint_of_two_processes_loads_resharded_into_three(tmp_path):
    """Written by 2 processes (even halves), loaded by 3 (rows 5, 5, 3 of the 13-token embedding):
    every weight and every AdamW moment gathered after the load equals the one saved, bit for bit,
    the reference being the two rank files concatenated along the first dimension."""
    args = ["--model", "llama", "--shard", "--micro", "2", "--accum", "2", "--steps", "2", *COMMON]
    trained = _torchrun(tmp_path / "two", *args)
    log = _finish(trained)
    assert trained.returncode == 0, log
    step = tmp_path / "two" / "step-0000002"
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "3", str(WORKER), "--out",
           str(tmp_path / "three"), "--model", "llama", "--load-resharded", str(step)]
    loaded = subprocess.run(cmd, env=_env(), capture_output=True, timeout=300)
    assert loaded.returncode == 0, loaded.stdout.decode()[-3000:] + loaded.stderr.decode()[-3000:]
    parts = [load_file(f) for f in sorted((step / "shards").glob("*.safetensors"))]
    got = load_file(tmp_path / "three" / "loaded.safetensors")
    saved = {k: torch.cat([p[k] for p in parts]) for k in parts[0] if parts[0][k].ndim and k in got}
    assert len(saved) == len(got) and any(k.endswith("exp_avg_sq") for k in saved)
    for k, v in saved.items():
        assert torch.equal(v, got[k]), k


def test_a_sharded_checkpoint_with_other_param_groups_is_refused(tmp_path):
    manager = CheckpointManager(tmp_path)         # (a new manager sweeps temporaries away: first)
    staged = tmp_path / ".tmp-step-0000001-sharded"
    (staged / "shards").mkdir(parents=True)
    state = {"step": 1, "optimizer": {"param_groups": [{"lr": 1.0}, {"lr": 1.0}], "scalars": {}}}
    manager.finalise(1, staged, state)
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"step-0000001: 2 optimizer param groups, the optimizer has 1"):
        load_sharded(tmp_path, model, torch.optim.AdamW(model.parameters()))
