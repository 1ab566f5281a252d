"""Distilling a language model: a student trained on a teacher's soft targets and the hard labels.

    attnlab train lm --teacher runs/big --kd-temperature 2 --kd-alpha 0.5 --d-model 64 --layers 2 --out runs/small
    attnlab train lm --teacher SmolLM2-135M.gguf --data book.txt --d-model 128 --layers 4 --out runs/student

What ``attnlab train lm`` does once ``--teacher`` names a model (an LM run, a Hugging Face
causal-LM directory or a GGUF file: whatever ``attnlab generate`` takes):

- the student is built as any LM run's model (``--model``, ``--d-model``, ``--layers`` ...), with the
  teacher's tokenizer: ``--tokenizer`` or ``--vocab-size`` that disagree with it are refused, and so
  is a teacher whose output vocabulary differs from the student's, in one line naming both sizes;
- each step's loss is :func:`attnlab.train.losses.distillation_loss` (Hinton et al. 2015):
  ``alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T)) + (1 - alpha) * CE(student, labels)``
  per predicted token, KL summed over the vocabulary, both terms averaged over the step's real
  target tokens (the Trainer divides the sum by their number); padding targets count in neither
  term (an LM window over a corpus has none; the loss excludes them wherever they occur);
- the teacher runs in eval mode under ``torch.no_grad``, on the student's device, and is no part of
  the student: its weights are in no checkpoint. Each checkpoint's run.json records its identity
  (``task_options["teacher"]``: path, vocabulary and the SHA-256 of its weights), and ``--resume``
  refuses a teacher whose weights differ from the recorded ones (another path is refused as any
  changed option is);
- validation is the student's own perplexity on the held-out text, as for any LM run.

This module sits below :mod:`attnlab.tasks.lm` and is handed its loader (``load_lm``).
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor, nn

from ..train.losses import distillation_loss
from .base import Option, positive
from .run import RunError, load_tokenizers, resume_point
from .settings import Settings
from .sft import fine_tuning

__all__ = ["DISTILL_OPTIONS", "Teacher", "check_distillation", "weights_sha256"]

_K = "distillation from a teacher"
DEFAULT_TEMPERATURE, DEFAULT_ALPHA = 2.0, 0.5      # Hinton et al.'s soft term at a moderate temperature


def _unit(v) -> str | None:
    return None if 0 <= v <= 1 else "must be in [0, 1]"


DISTILL_OPTIONS = [
    Option("teacher", str, None, "distil from this model: an LM run, a Hugging Face causal-LM directory or a GGUF "
           "file (the student takes its tokenizer)", metavar="MODEL_OR_RUN", group=_K),
    Option("kd_temperature", float, None, f"temperature T of the soft targets softmax(logits / T) (default "
           f"{DEFAULT_TEMPERATURE:g} with --teacher)", check=positive, metavar="T", group=_K),
    Option("kd_alpha", float, None, "weight of the soft-target term; 1 - alpha weighs the labels' cross-entropy "
           f"(default {DEFAULT_ALPHA:g} with --teacher)", check=_unit, metavar="A", group=_K),
]


def check_distillation(s: Settings) -> None:
    """ValueError if --kd-temperature or --kd-alpha is given without --teacher."""
    for name in ("kd_temperature", "kd_alpha"):
        if getattr(s, name) is not None and s.teacher is None:
            raise ValueError(f"--{name.replace('_', '-')} applies with --teacher (distillation), which is not given")


def weights_sha256(model: nn.Module) -> str:
    """SHA-256 over the model's state dict in key order: each name, dtype, shape and raw bytes."""
    digest = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}\0".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def _vocab(model: nn.Module) -> int:
    """The vocabulary a causal LM reads and predicts over, as its family states it."""
    from ..models.registry import input_limits
    return int(input_limits(model)["vocab_size"])


class Teacher:
    """The teacher of a distilled LM run: its model (eval mode, no gradients), tokenizer and identity."""

    def __init__(self, lm, identity: dict, temperature: float, alpha: float):
        self.model, self.tokenizer, self.path = lm.model, lm.tokenizer, str(lm.path)
        self.identity, self.temperature, self.alpha = identity, temperature, alpha
        self.model.eval().requires_grad_(False)

    @classmethod
    def load(cls, s: Settings, resume_from: Path | None, load_lm: Callable) -> "Teacher":
        """The teacher ``--teacher`` names, loaded by ``load_lm`` (attnlab.tasks.lm's) in fp32 on the
        CPU; on ``--resume``, RunError unless its weights are those the run was distilled from."""
        if fine_tuning(s):
            raise RunError("--teacher trains a new student; it does not combine with --init, --lora or a chat file")
        try:
            lm = load_lm(s.teacher, "cpu", "fp32")
        except (FileNotFoundError, RunError) as e:       # no model there, or not a causal LM: said for --teacher
            raise RunError(f"--teacher: {e}") from None
        identity = {"path": str(Path(s.teacher).resolve()), "vocab_size": _vocab(lm.model),
                    "sha256": weights_sha256(lm.model)}
        saved = None if resume_from is None else resume_point(resume_from, "lm")
        if saved is not None:
            student = load_tokenizers(saved)["text"].vocab_size
            if student != identity["vocab_size"]:
                raise RunError(f"--teacher {s.teacher}: its vocabulary has {identity['vocab_size']} tokens, the "
                               f"student's in {resume_from} {student}; a student distils only from a teacher of its "
                               "own tokenizer")
            was = saved.task_options.get("teacher") or {}
            if was.get("sha256") != identity["sha256"]:
                raise RunError(f"--resume: the teacher {s.teacher} is not the one {resume_from} was distilled from "
                               f"(weights SHA-256 {identity['sha256'][:12]}, the run's {str(was.get('sha256'))[:12]}"
                               f" from {was.get('path')}); restore that teacher, or start a new run with another --out")
        for name, default in (("kd_temperature", DEFAULT_TEMPERATURE), ("kd_alpha", DEFAULT_ALPHA)):
            if getattr(s, name) is None:                # config.yaml holds what was used
                setattr(s, name, default)
        return cls(lm, identity, s.kd_temperature, s.kd_alpha)

    def student_tokenizer(self, s: Settings):
        """The teacher's tokenizer, which the student takes; ValueError if ``--tokenizer`` or
        ``--vocab-size`` ask for another."""
        tok, V = self.tokenizer, self.tokenizer.vocab_size
        if s.vocab_size is not None and s.vocab_size != V:
            raise ValueError(f"--vocab-size {s.vocab_size}: the teacher {self.path} has a vocabulary of {V} "
                             f"tokens, the student would have {s.vocab_size}; a distilled student takes its "
                             "teacher's tokenizer: leave --vocab-size out")
        if s.tokenizer is not None and s.tokenizer != tok.kind:
            raise ValueError(f"--tokenizer {s.tokenizer}: the teacher {self.path} has a {tok.kind} tokenizer of "
                             f"{V} tokens; a distilled student takes its teacher's tokenizer: leave --tokenizer out")
        return tok

    def check_student(self, student: nn.Module) -> "Teacher":
        """ValueError in one line unless the student predicts over the teacher's vocabulary."""
        mine, theirs = _vocab(student), self.identity["vocab_size"]
        if mine != theirs:
            raise ValueError(f"--teacher {self.path}: its vocabulary has {theirs} tokens and the student's {mine}; "
                             "a student distils only from a teacher of its own tokenizer")
        return self

    @torch.no_grad()
    def logits(self, x: Tensor) -> Tensor:
        """The teacher's logits (B, T, V) for the student's inputs x (B, T), on x's device."""
        if next(self.model.parameters()).device != x.device:
            self.model.to(x.device)
        return self.model(x)

    def loss(self, x: Tensor, logits: Tensor, y: Tensor) -> Tensor:
        """The distillation loss SUM over the targets ``y`` (B, T) of the student's ``logits`` for ``x``."""
        return distillation_loss(logits, self.logits(x), y, self.temperature, self.alpha)

    def run_options(self) -> dict:
        """What each checkpoint's run.json records of the teacher."""
        return {"teacher": dict(self.identity)}

    def describe(self) -> str:
        n = sum(p.numel() for p in self.model.parameters())
        return (f"teacher: {self.path}, {type(self.model).__name__}, {n / 1e6:.2f}M parameters, vocab "
                f"{self.identity['vocab_size']}; loss {self.alpha:g} x T^2 x KL at T = {self.temperature:g} + "
                f"{1 - self.alpha:g} x cross-entropy")
