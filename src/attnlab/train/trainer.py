"""One Trainer for every attnlab model, through a small Task protocol.

    task = MyTask(...)                        # holds .model; plans batches; computes the loss
    cfg = TrainConfig(out_dir="runs/x", steps=1000, lr=3e-4, schedule="cosine", warmup_steps=100)
    Trainer(task, cfg, resume=True).fit()     # resume=True continues from runs/x/latest if any

Loss normalisation (accumulation and ranks train as one large batch). ``Task.loss`` returns the SUM of the loss over a
micro-batch's target tokens and their number. Each optimizer step runs ``accum_steps``
micro-batches per rank and backpropagates the sums; then the gradients are multiplied by
``W / N``, N being the total target tokens of the step over all micro-batches and all W
ranks (DDP has already averaged over ranks, hence the W). The update is therefore the
gradient of the mean loss per target token over the whole global batch, whatever the
split: one batch of B, or accumulation, or W ranks.

Exact resume (weights bit-identical to an uninterrupted run). Checkpoints are written only at optimizer-step boundaries and
hold the step, the epoch, the position in the epoch's plan, optimizer, scheduler,
GradScaler and every RNG state (per rank). The plan of an epoch is regenerated from
(epoch, seed) and already-done micro-batches are skipped; RNG states are restored last,
right before training continues. ``Task.plan`` and ``Task.evaluate`` run with the global
RNGs set aside (plan under a fixed seed derived from (seed, epoch)), so neither perturbs
the training stream. On CPU a run killed at any point and resumed ends with weights
bit-identical to an uninterrupted run. Another number of processes may resume a run if
processes x ``accum_steps`` stays (the same micro-batches make each step; each rank's RNG
streams then start again from the seed).

Interruption (SIGINT, i.e. Ctrl-C, and SIGTERM, which job schedulers and torchrun send).
During :meth:`Trainer.fit` the first such signal lets the running optimizer step finish,
writes a checkpoint there, says where on stderr and raises :class:`TrainingInterrupted`
(a KeyboardInterrupt carrying the checkpoint and the exit status 128 + signal: 130, 143);
``resume=True`` then continues exactly as after any other checkpoint. A second signal stops
at once. Under several processes the stop is agreed on at the next step's all-reduce.
"""
from __future__ import annotations

import json
import logging
import math
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from ..nn.precision import asked_bf16, native_bf16
from .budget import BudgetPlanner, fit_schedule
from .checkpoint import (SHARDS_DIR, CheckpointManager, capture_rng_state, load_checkpoint, resolve_resume,
                         restore_rng_state)
from .ema import ExponentialMovingAverage, applied, resume_average, with_training_weights
from .distributed import (all_gather_bytes, all_reduce_sum, barrier, init_distributed, shard_plan, shutdown,
                          wrap_model)
from .interrupt import TrainingInterrupted, catch_stop_signals
from .lock import lock_run
from .metrics import plot_metrics
from .optim import OPTIMIZERS, build_optimizer, param_groups, split_decay
from .progress import LogWindow, progress_bar
from .rng import isolated_rng, seed_everything
from .schedules import SCHEDULES, make_schedule
from .sharded import load_sharded, save_sharded, shard_model, skip_gradient_sync

__all__ = ["Task", "TrainConfig", "Trainer", "TrainingInterrupted", "split_decay", "param_groups", "build_optimizer",
           "isolated_rng", "PRECISIONS"]

log = logging.getLogger("attnlab.train")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")


class Task(Protocol):
    """What the Trainer needs from a model + data pair.

    ``model``: the nn.Module to train (the Trainer moves it to the device).
    ``plan(epoch, seed)``: the epoch's micro-batches (tensors, tuples/dicts of tensors, or
        any descriptor ``loss`` understands), deterministic in (epoch, seed). Under W ranks
        each rank trains entries rank, rank + W, ... so give micro-batches of
        global_batch / (W * accum_steps) examples.
    ``loss(model, batch)`` -> (loss_sum, n_tokens, extra): the SUM of the loss over the
        batch's target tokens (padding excluded), the number of those tokens, and a dict of
        extra scalar SUMS (e.g. {"correct": 17}); the Trainer logs each extra divided by
        the step's token count. Tensors in ``batch`` arrive on the training device. Call
        ``model(...)`` (its forward): under DDP ``model`` is the DDP wrapper.
    ``evaluate(model)`` (optional) -> dict of validation metrics, e.g. {"val_loss": 2.1};
        called on rank 0 in eval mode under torch.no_grad().
    ``save_assets(directory)`` (optional): write tokenizers etc. into each checkpoint
        directory (names model.safetensors, optimizer.safetensors, trainer_state.json are taken).
    """

    model: nn.Module

    def plan(self, epoch: int, seed: int) -> list: ...

    def loss(self, model: nn.Module, batch: Any) -> tuple[Tensor, int, dict]: ...


@dataclass
class TrainConfig:
    """Training settings. Intervals count optimizer steps; 0 turns the periodic action off
    (a final checkpoint and a final evaluation still happen)."""
    out_dir: str | Path
    steps: int
    lr: float = 1e-3                      # peak lr; for "noam" a scale on the paper's rate (1.0 = paper)
    weight_decay: float = 0.01            # decoupled (AdamW); never on norms, biases, embeddings
    optimizer: str = "adamw"              # "adamw" | "adafactor" (T5's; attnlab.train.optim.build_optimizer)
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-9
    schedule: str = "constant"            # "noam" | "cosine" | "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0             # cosine: final lr / peak lr
    d_model: int | None = None            # noam: None reads model.config.d_model
    clip_norm: float | None = 1.0         # max global grad norm; None = no clipping
    accum_steps: int = 1                  # micro-batches per optimizer step (per rank)
    precision: str = "auto"               # "auto" | "fp32" | "bf16" | "fp16" (fp16: CUDA only)
    grad_checkpointing: bool = False
    ema_decay: float | None = None        # evaluate and save an average of the weights (attnlab.train.ema)
    eval_every: int = 0
    save_every: int = 0
    keep_last: int = 3
    best_metric: str | None = "val_loss"  # eval metric that selects best/
    best_mode: str = "min"                # "min" (losses) | "max" (BLEU, accuracy)
    log_every: int = 10
    seed: int = 0
    time_budget_s: float | None = None    # stop cleanly (with a checkpoint) after this much wall time
    progress: bool = True
    device: str | None = None             # None: cuda:LOCAL_RANK if available, else cpu
    find_unused_parameters: bool = False  # DDP option for models that skip parameters
    shard: bool = False                   # FSDP2 under torchrun, sharded checkpoints (attnlab.train.sharded)
    # A schedule sized by the time budget (attnlab.train.budget): ``steps`` is then only a cap; the
    # mean time of the last ``budget_measure`` steps, and of the evaluations and checkpoints so far
    # (a ``budget_reserve`` share of the budget until one is timed), predicts how many steps fit in
    # ``time_budget_s``, planned again whenever the prediction drifts (every plan recorded in the
    # checkpoints, so a resumed run repeats them); ``budget_evals`` > 0 spreads that many
    # evaluations and checkpoints over the schedule instead of ``eval_every`` / ``save_every``.
    budget_schedule: bool = False
    budget_measure: int = 20
    budget_reserve: float = 0.1
    budget_evals: int = 0

    def __post_init__(self):
        self.out_dir = Path(self.out_dir)
        self.betas = tuple(self.betas)
        positive = {"steps": self.steps, "accum_steps": self.accum_steps, "keep_last": self.keep_last,
                    "log_every": self.log_every, "lr": self.lr, "eps": self.eps}
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"TrainConfig: {name} must be positive, got {value}")
        for name in ("warmup_steps", "eval_every", "save_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig: {name} must be >= 0, got {getattr(self, name)}")
        if self.weight_decay < 0:
            raise ValueError(f"TrainConfig: weight_decay must be >= 0, got {self.weight_decay}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"TrainConfig: betas must be two numbers in [0, 1), got {self.betas}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"TrainConfig: optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"TrainConfig: schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.schedule == "noam" and self.warmup_steps < 1:
            raise ValueError("TrainConfig: the noam schedule needs warmup_steps >= 1")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"TrainConfig: min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"TrainConfig: clip_norm must be positive or None, got {self.clip_norm}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"TrainConfig: precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.best_mode not in ("min", "max"):
            raise ValueError(f"TrainConfig: best_mode must be 'min' or 'max', got {self.best_mode!r}")
        if self.ema_decay is not None and (not 0.0 < self.ema_decay < 1.0 or self.shard):
            raise ValueError(f"TrainConfig: ema_decay must be in (0, 1) and without shard, got {self.ema_decay}")
        if self.time_budget_s is not None and not self.time_budget_s > 0:
            raise ValueError(f"TrainConfig: time_budget_s must be positive or None, got {self.time_budget_s}")
        if self.budget_schedule and (self.time_budget_s is None or self.budget_measure < 1
                                     or not 0.0 <= self.budget_reserve < 1.0 or self.budget_evals < 0):
            raise ValueError("TrainConfig: budget_schedule needs time_budget_s, budget_measure >= 1, "
                             "0 <= budget_reserve < 1 and budget_evals >= 0")

    def to_json(self) -> dict:
        d = asdict(self)
        d["out_dir"] = str(self.out_dir)
        return d


# ----------------------------------------------------------------------------- helpers
# below this many parameters a CPU model's matmuls are too small for bf16 autocast to pay: on a CPU with
# native bf16 the 0.7M-parameter main job ran no faster in bf16 and ended 0.5 BLEU lower, while the 7.6M
# Multi30k model gained ~10 % and a 10.7M GPT 1.4x (benchmarks/results/code.md)
AUTO_BF16_MIN_PARAMS = 2_000_000


def _resolve_precision(precision: str, device: torch.device, model: nn.Module | None = None) -> tuple[str, str]:
    """(the precision to train in, why, in words). "auto" is bf16 autocast where the device computes
    bf16 natively (a GPU that supports it; a CPU with AVX512-BF16 or AMX-BF16, where a large bf16
    matmul is ~4x an fp32 one, for a model of at least AUTO_BF16_MIN_PARAMS parameters) and fp32
    elsewhere (an emulated bf16 is slower than fp32). Weights, gradients, optimizer state and
    checkpoints stay fp32 in every case: autocast only runs the matmuls and attention in bf16."""
    cuda = device.type == "cuda"
    if precision == "auto":
        native, why = native_bf16(device)
        if not native:
            return "fp32", f"auto: {why}"
        n = None if model is None or cuda else sum(p.numel() for p in model.parameters())
        if n is not None and n < AUTO_BF16_MIN_PARAMS:
            return "fp32", (f"auto: {why}, but {n / 1e6:.2f}M parameters are too few for bf16 matmuls to pay "
                            f"(below {AUTO_BF16_MIN_PARAMS / 1e6:g}M)")
        return "bf16", f"auto: {why}"
    if precision == "fp16" and not cuda:
        raise ValueError(f"TrainConfig: precision 'fp16' needs a CUDA device (GradScaler), got {device}; "
                         "use 'bf16' or 'fp32'")
    if precision == "bf16" and cuda and not torch.cuda.is_bf16_supported():
        raise ValueError(f"TrainConfig: this GPU ({device}) does not support bf16; use 'fp16' or 'fp32'")
    return precision, (asked_bf16(device) if precision == "bf16" else "asked for")


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) tuple/list/dict to ``device``; other values unchanged."""
    if isinstance(batch, Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(to_device(v, device) for v in batch)
    if hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(to_device(v, device) for v in batch))
    return batch


# ----------------------------------------------------------------------------- the trainer
class Trainer:
    """Trains ``task.model`` on ``task``'s plan; see the module docstring for the guarantees.

    ``resume``: False (start afresh), True (continue from ``out_dir/latest`` if it exists,
    else start afresh) or a path (a checkpoint directory or a run directory; must exist).
    ``clock``: seconds as a float (default ``time.perf_counter``), read for the time budget,
    tokens/s and progress; tests give one whose steps take known times.
    """

    def __init__(self, task: Task, config: TrainConfig, resume: bool | str | Path = False, clock=None):
        self.task, self.config = task, config
        self.clock = clock or time.perf_counter
        self.env = init_distributed(config.device)
        self.device = self.env.device
        self.precision, self.precision_reason = _resolve_precision(config.precision, self.device, task.model)
        if self.env.is_main:
            log.info("precision: %s (%s)%s", self.precision, self.precision_reason,
                     "; fp32 weights, optimizer state and checkpoints" if self.precision != "fp32" else "")
        self.model = task.model.to(self.device)
        if config.grad_checkpointing and hasattr(self.model, "gradient_checkpointing"):
            self.model.gradient_checkpointing = True
        self.ddp_model = (shard_model(self.model, self.env, self.precision) if config.shard
                          else wrap_model(self.model, self.env, config.find_unused_parameters))
        self.optimizer = build_optimizer(self.model, config)
        self.ema = ExponentialMovingAverage(self.model, config.ema_decay) if config.ema_decay else None
        d_model = config.d_model or getattr(getattr(self.model, "config", None), "d_model", None)
        if config.schedule == "noam" and d_model is None:
            raise ValueError("TrainConfig: the noam schedule needs d_model (the model has no config.d_model)")
        self.scheduler = make_schedule(config.schedule, self.optimizer, warmup=config.warmup_steps,
                                       total_steps=None if config.budget_schedule else config.steps,
                                       min_lr_ratio=config.min_lr_ratio, d_model=d_model)
        self._planner = BudgetPlanner(config.time_budget_s, config.budget_measure, config.budget_reserve,
                                      config.budget_evals, config.steps, (config.eval_every, config.save_every)
                                      ) if config.budget_schedule else None
        self.scaler = torch.amp.GradScaler("cuda") if self.precision == "fp16" else None
        # one run per directory, from before the manager's clean-up (which would sweep away another
        # run's half-written checkpoint) until close(); see attnlab.train.lock
        self._lock = lock_run(config.out_dir) if self.env.is_main else None
        self.checkpoints = CheckpointManager(config.out_dir, config.keep_last) if self.env.is_main else None
        self.metrics_path = Path(config.out_dir) / "metrics.jsonl"
        self.step = self.epoch = self.batch_pos = 0
        self.best: dict | None = None
        self.records: list[dict] = []
        self.elapsed_before = 0.0
        self.last_checkpoint: Path | None = None
        self._rng_to_restore: dict | None = None
        self._window = LogWindow()   # sums since the last log line
        self.interrupted: int | None = None     # the signal received during fit, if any
        if resume:
            self._resume(resume)
        else:
            if (Path(config.out_dir) / "latest").exists():
                raise ValueError(f"Trainer: {config.out_dir} already holds checkpoints; pass resume=True to "
                                 "continue that run, or choose a new out_dir")
            if self.env.is_main:
                self.metrics_path.write_text("")
        barrier(self.env)

    # ------------------------------------------------------------------ resume / save
    def _resume(self, resume: bool | str | Path) -> None:
        where = self.config.out_dir if resume is True else Path(resume)
        ckpt, skipped = resolve_resume(where)
        for damaged, why in skipped if self.env.is_main else ():
            log.warning("resume: skipped %s, damaged (%s); resuming from %s", damaged.name, why, ckpt.name)
        if ckpt is None:
            if resume is not True:
                raise FileNotFoundError(f"Trainer: nothing to resume at {where} (no checkpoint, no 'latest' file)")
            log.info("no checkpoint in %s: starting afresh", where)
            if self.env.is_main:
                self.metrics_path.write_text("")
            return
        # a sharded checkpoint loads into any number of sharded processes, or whole into one process
        sharded = self.config.shard or ((ckpt / SHARDS_DIR).is_dir() and not self.env.active)
        state = (load_sharded if sharded else load_checkpoint)(ckpt, self.model, self.optimizer)
        self.ema, why = resume_average(ckpt, self.model, self.config.ema_decay)
        if why and self.env.is_main:
            log.warning("%s", why)
        self._check_resumable(ckpt, state)
        if state["step"] > self.config.steps:
            raise ValueError(f"Trainer: {ckpt} is at step {state['step']}, beyond the {self.config.steps} steps asked "
                             f"for (--steps); give at least {state['step']} to resume it")
        if self._planner is not None and state.get("budget_plan"):
            self._planner.load_state(state["budget_plan"], ckpt)
            self._apply_budget_plan(resumed=True)
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        # batch_pos counts one rank's micro-batches: as many global ones go to W ranks as to W' ranks
        self.step, self.epoch = state["step"], state["epoch"]
        self.batch_pos = state["batch_pos"] * state["world_size"] // self.env.world_size
        self.best, self.records, self.elapsed_before = state["best"], state["metrics"], state["elapsed_s"]
        # each rank's RNG streams are its own: a rank the saving run did not have starts its own seed
        rng = state["rng"]
        self._rng_to_restore = rng[self.env.rank] if len(rng) == self.env.world_size else None
        if len(rng) != self.env.world_size and self.env.is_main:
            log.warning("resume: %d processes saved %s, this run has %d: the data position and the weights carry "
                        "over, the random streams (dropout) start again from the seed", len(rng), ckpt.name,
                        self.env.world_size)
        self._window = LogWindow(**state["log_window"])
        self.last_checkpoint = ckpt
        log.info("resuming from %s (step %d, epoch %d)", ckpt, self.step, self.epoch)
        barrier(self.env)        # every rank has read the checkpoint before rank 0 removes what follows it
        if self.env.is_main:
            if ckpt.parent.resolve() == self.checkpoints.out_dir.resolve():
                self.checkpoints.discard_after(self.step)  # the abandoned future of a killed run
            self.metrics_path.write_text("".join(json.dumps(r) + "\n" for r in self.records))

    def _check_resumable(self, ckpt: Path, state: dict) -> None:
        """Refuse changes that would move the data position; warn about settings the checkpoint overrides."""
        saved = state["config"]
        # a step trains micro-batches [k G, (k + 1) G) of the epoch's plan, G = processes x accum_steps
        then, now = state["world_size"] * saved["accum_steps"], self.env.world_size * self.config.accum_steps
        if then != now:
            raise ValueError(f"Trainer: {ckpt} was written by {state['world_size']} processes x accum_steps "
                             f"{saved['accum_steps']} ({then} micro-batches a step), this run has {self.env.world_size}"
                             f" x {self.config.accum_steps}; keep processes x accum_steps (--accum) at {then} to "
                             "keep the data position")
        if saved["seed"] != self.config.seed:
            raise ValueError(f"Trainer: {ckpt} was trained with seed={saved['seed']}, this run asks for "
                             f"{self.config.seed}; the data position would not match")
        before = saved.get("optimizer", "adamw")          # checkpoints from before the choice: AdamW
        if before != self.config.optimizer:
            raise ValueError(f"Trainer: {ckpt} was trained with the {before} optimizer, "
                             f"this run asks for {self.config.optimizer}; its state would not carry over")
        for key in ("lr", "weight_decay", "betas", "eps"):
            now = list(self.config.betas) if key == "betas" else getattr(self.config, key)
            if saved[key] != now:
                log.warning("resume: %s=%s from the checkpoint's optimizer state is kept (config says %s)",
                            key, saved[key], now)

    def _trainer_state(self, rng: list[dict], elapsed: float) -> dict:
        sched = self.scheduler.state_dict()
        sched["lr_lambdas"] = [None] * len(sched["lr_lambdas"])  # the config decides the factors
        return {"step": self.step, "epoch": self.epoch, "batch_pos": self.batch_pos,
                "world_size": self.env.world_size, "scheduler": sched, "precision": self.precision,
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "rng": rng, "best": self.best, "config": self.config.to_json(), "metrics": self.records,
                "log_window": asdict(self._window), "elapsed_s": elapsed,
                "budget_plan": self._planner.state() if self._planner is not None else None}

    def save(self, elapsed: float, is_best: bool = False) -> None:
        """Checkpoint the current step (collective: every rank calls it; rank 0 writes)."""
        rng = [json.loads(b) for b in all_gather_bytes(json.dumps(capture_rng_state()).encode(), self.env)]
        assets, state = getattr(self.task, "save_assets", None), self._trainer_state(rng, elapsed)
        if self.ema is not None:   # the average goes in model.safetensors, the training weights beside it
            assets = with_training_weights(self.ema, assets)
        if self.config.shard:      # every rank writes its shards, rank 0 completes the step
            self.last_checkpoint = save_sharded(self.checkpoints, self.config.out_dir, self.step, self.model,
                                                self.optimizer, state, assets, is_best, self.env)
        elif self.env.is_main:
            with applied(self.ema, self.model):
                self.last_checkpoint = self.checkpoints.save(self.step, self.model, self.optimizer, state, assets,
                                                             is_best)
            log.info("saved %s", self.last_checkpoint)
        barrier(self.env)

    # ------------------------------------------------------------------ one step
    def _autocast(self):
        if self.precision == "fp32":
            return nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16 if self.precision == "bf16" else torch.float16)

    def accumulate(self, micro_batches: list, over_budget: bool = False) -> tuple[float, float, bool, dict]:
        """Forward/backward over this rank's micro-batches of one step and normalise the
        gradients by the step's global token count. Returns the global (loss sum, tokens,
        any rank over its time budget, extra sums)."""
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)  # tensors: no GPU sync per micro-batch
        tokens, extras = 0, {}
        for i, batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            sync = skip_gradient_sync(self.ddp_model) if self.env.active and not last else nullcontext()
            with sync:  # DDP all-reduces every gradient in the last backward, so all stay in sync
                with self._autocast():
                    loss, n, extra = self.task.loss(self.ddp_model, to_device(batch, self.device))
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            loss_sum += loss.detach().double()
            tokens += int(n)
            for k, v in (extra or {}).items():
                extras[k] = extras.get(k, 0.0) + torch.as_tensor(v, device=self.device).detach().double()
        keys = sorted(extras)
        head = torch.tensor([tokens, float(over_budget)], dtype=torch.float64, device=self.device)
        totals = torch.cat([loss_sum.reshape(1), head] + [torch.as_tensor(extras[k]).reshape(1) for k in keys])
        totals = all_reduce_sum(totals, self.env).tolist()   # [loss sum, tokens, over budget, *extras]
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        factor = self.env.world_size / max(totals[1], 1.0)
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(factor)
        return totals[0], totals[1], totals[2] > 0, dict(zip(keys, totals[3:]))

    def _optimizer_step(self) -> float:
        lr = self.optimizer.param_groups[0]["lr"]
        if self.config.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.clip_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return lr

    # ------------------------------------------------------------------ the loop
    def _epoch_plan(self, epoch: int) -> list:
        with isolated_rng(self.config.seed * 1_000_003 + epoch):
            plan = list(self.task.plan(epoch, self.config.seed))
        mine = shard_plan(plan, self.env.rank, self.env.world_size)
        if len(mine) < self.config.accum_steps:
            raise ValueError(f"Trainer: epoch {epoch} plans {len(plan)} micro-batches, {len(mine)} per rank, "
                             f"fewer than accum_steps={self.config.accum_steps}")
        return mine

    def fit(self) -> dict:
        """Train to ``config.steps`` (or the time budget); returns a summary dict."""
        cfg = self.config
        if self._rng_to_restore is not None:   # last, after model/optimizer/plan set-up
            restore_rng_state(self._rng_to_restore)
            self._rng_to_restore = None
        else:
            seed_everything(cfg.seed + self.env.rank)
        start = mark = self.clock()       # mark: the end of the previous step, its evaluation and save included
        unplanned = self._planner is not None and self.budget_plan is None     # the step count is only a cap
        bar = progress_bar(None if unplanned else cfg.steps, initial=self.step, desc="train",
                           enabled=cfg.progress and self.env.is_main, clock=self.clock)
        self.ddp_model.train()
        stopped = False
        self.interrupted = None
        restore_signals = catch_stop_signals(self._interrupt, announce=self.env.is_main)
        try:
            while self.step < cfg.steps and not stopped:
                plan = self._epoch_plan(self.epoch)
                while self.batch_pos + cfg.accum_steps <= len(plan) and self.step < cfg.steps and not stopped:
                    t0 = self.clock()
                    budget_hit = cfg.time_budget_s is not None and t0 - start >= cfg.time_budget_s
                    micro = plan[self.batch_pos: self.batch_pos + cfg.accum_steps]
                    loss, tokens, stopped, extras = self.accumulate(micro, budget_hit or self.interrupted is not None)
                    lr = self._optimizer_step()
                    if self.ema is not None:
                        self.ema.update(self.model)
                    if self.interrupted is not None and not self.env.active:
                        stopped = True              # a signal during this step: it ends here, with a checkpoint
                    self.batch_pos += cfg.accum_steps
                    self.step += 1
                    bar.update(1)
                    t1 = self.clock()
                    w = self._window
                    w.loss, w.tokens, w.seconds = w.loss + loss, w.tokens + tokens, w.seconds + t1 - t0
                    for k, v in extras.items():
                        w.extras[k] = w.extras.get(k, 0.0) + v
                    self._after_step(lr, start, t1 - mark, stopped, bar)
                    mark = self.clock()
                if self.batch_pos + cfg.accum_steps > len(plan):
                    self.epoch, self.batch_pos = self.epoch + 1, 0
        finally:
            bar.close()
            restore_signals()
        if self.env.is_main and self.records:
            plot_metrics(self.metrics_path, Path(cfg.out_dir) / "loss.png")
        barrier(self.env)
        if self.interrupted is not None and self.step < cfg.steps:
            if self.env.is_main:
                print(f"\n{signal.Signals(self.interrupted).name}: stopped after step {self.step}; checkpoint "
                      f"saved in {self.last_checkpoint} (resume=True / --resume continues from it)", file=sys.stderr)
            raise TrainingInterrupted(self.interrupted, self.last_checkpoint)
        last = next((r["loss"] for r in reversed(self.records) if r.get("kind") == "train"), None)
        return {"step": self.step, "epoch": self.epoch, "loss": last, "stopped_early": self.step < cfg.steps,
                "best": self.best, "checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
                "precision": self.precision}

    def _interrupt(self, signum: int) -> None:
        self.interrupted = signum

    def _after_step(self, lr: float, start: float, step_s: float, stopped: bool, bar) -> None:
        """Log, evaluate and save as the step number asks; re-plan a budget-sized schedule (after
        the evaluation, whose time counts, and before the save, which records the plan)."""
        cfg = self.config
        final = self.step == cfg.steps
        elapsed = self.elapsed_before + self.clock() - start
        window = self._window
        if self.step % cfg.log_every == 0 or final or stopped:
            tokens = max(window.tokens, 1.0)
            record = {"kind": "train", "step": self.step, "loss": window.loss / tokens, "lr": lr,
                      "tokens_per_s": window.tokens / max(window.seconds, 1e-9), "elapsed": elapsed,
                      **{k: v / tokens for k, v in window.extras.items()}}
            self._record(record)
            bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{lr:.2e}", tok_s=f"{record['tokens_per_s']:.0f}")
            self._window = LogWindow()
        planned = self.budget_plan is not None and self.step in self.budget_plan.get("eval_at", ())
        evaluate = bool(cfg.eval_every and self.step % cfg.eval_every == 0) or final or planned
        save = bool(cfg.save_every and self.step % cfg.save_every == 0) or final or stopped or planned
        t = self.clock()
        is_best = self._evaluate(elapsed) if evaluate else False
        save = save or is_best
        now = self.clock()
        self._replan(step_s, now - t if evaluate or save else None, self.elapsed_before + now - start, bar,
                     last=final or stopped)
        if save:
            self.save(self.elapsed_before + now - start, is_best)
            if self._planner is not None:
                self._planner.add_stop_seconds(self.clock() - now)

    # ------------------------------------------------------------------ a schedule sized by the budget
    @property
    def budget_plan(self) -> dict | None:
        """The plan in force of a budget-sized schedule (None before the first, or without one)."""
        return self._planner.plan if self._planner is not None else None

    def _replan(self, step_s: float, stop_s: float | None, elapsed: float, bar, last: bool) -> None:
        """Give the planner this step's timings (rank 0's, on every rank: the same plans
        everywhere) and apply the plan it makes, if any (none after the ``last`` step)."""
        if self._planner is None:
            return
        facts = torch.tensor([step_s, -1.0 if stop_s is None else stop_s, elapsed], dtype=torch.float64)
        if self.env.active:
            facts = facts.to(self.device)
            torch.distributed.broadcast(facts, 0)
        step_s, stop_s, elapsed = facts.tolist()
        was = self.budget_plan
        self._planner.observe(self.step, step_s, None if stop_s < 0 else stop_s)
        plan = None if last else self._planner.decide(self.step, elapsed)
        if plan is None:
            return
        self._apply_budget_plan()
        log.info("time budget: %.3f s per step over the last %d%s -> %d steps in all", plan["measured_s_per_step"],
                 self.config.budget_measure, "" if was is None else f" (re-planned at step {self.step}, was "
                 f"{was['steps']})", plan["steps"])
        bar.total = self.config.steps
        bar.refresh()

    def _apply_budget_plan(self, resumed: bool = False) -> None:
        """Apply the planner's plan: the step cap, the evaluation and checkpoint intervals it chose
        (its own evaluation steps replace the intervals) and the lr schedule's length (:func:`attnlab.train.budget.fit_schedule`)."""
        plan = self._planner.plan
        self.config.steps = plan["steps"]
        if "eval_at" in plan:              # the plan's evaluations replace the intervals
            self.config.eval_every = self.config.save_every = 0
        fit_schedule(plan, self.scheduler, self.step, resumed=resumed)

    def _record(self, record: dict) -> None:
        self.records.append(record)
        if self.env.is_main:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        log.debug("%s", record)

    def _evaluate(self, elapsed: float) -> bool:
        """Run Task.evaluate on rank 0; returns whether the best metric improved (on all ranks)."""
        evaluate = getattr(self.task, "evaluate", None)
        if evaluate is None:
            return False
        improved = torch.zeros(1, dtype=torch.float64, device=self.device)
        if self.env.is_main or self.config.shard:   # a sharded forward is collective: every rank evaluates
            self.model.eval()
            with isolated_rng(), torch.no_grad(), self._autocast(), applied(self.ema, self.model):
                metrics = evaluate(self.model) or {}
            self.model.train()
        if self.env.is_main:
            metrics = {k: float(v) for k, v in metrics.items()}
            if metrics:
                self._record({"kind": "eval", "step": self.step, "elapsed": elapsed, **metrics})
            value = metrics.get(self.config.best_metric) if self.config.best_metric else None
            if value is not None and math.isfinite(value) and self._better(value):
                self.best = {"metric": self.config.best_metric, "value": value, "step": self.step}
                improved += 1
        return bool(all_reduce_sum(improved, self.env).item() > 0)

    def _better(self, value: float) -> bool:
        if self.best is None:
            return True
        return value < self.best["value"] if self.config.best_mode == "min" else value > self.best["value"]

    def close(self) -> None:
        """Leave the process group if this Trainer created it, and let go of the run directory."""
        shutdown(self.env)
        if self._lock is not None:
            self._lock.release()
