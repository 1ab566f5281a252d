"""Fine-tuning a pretrained language model: LoRA adapters, and supervised fine-tuning on chats.

    attnlab train lm --init SmolLM2/ --data chats.jsonl --lora --lora-rank 8 --lora-targets q,v --out runs/sft
    attnlab train lm --init runs/lm --data more.txt --lora          # text: next-token prediction, adapters only

What ``attnlab train lm`` does once ``--init`` names a model (a Hugging Face causal-LM directory or
an LM run): the model, its tokenizer and its chat template are the checkpoint's; ``--lora`` puts
adapters on the ``--lora-targets`` layers (:mod:`attnlab.adapters`) and trains them alone. A
``--data`` file of chats (JSONL of ``{"messages": [...]}``) trains on the assistant's tokens only
(:mod:`attnlab.data.chats`); any other file is text, trained as the task trains text.

Runs. Every checkpoint holds the whole model (base and adapters) as any LM run does, the adapter in
PEFT's layout under ``adapter/``, and in run.json the adapters' settings and the chat template, so
that ``--resume``, ``attnlab generate``, ``attnlab serve`` and ``attnlab export [--merge]`` rebuild
the same model. ChatTask's loss: the cross-entropy SUM over the reply tokens of a batch and their
count (the Trainer divides), so a step's loss is the mean over the replies' tokens, however the
conversations are padded.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data.chats import ChatTemplate, encode_chat, is_chat_file, read_chat_file
from .settings import Settings
from .base import Option, Setup, fraction, positive
from .run import RunError, build_model, inspect_path, load_model, load_tokenizers, model_context, resume_point, write_run

__all__ = ["FINE_TUNING_OPTIONS", "fine_tuning", "prepare_fine_tuning", "ChatTask", "lora_options"]

_F = "fine-tuning a pretrained model"
FINE_TUNING_OPTIONS = [
    Option("init", str, None, "start from this model: a Hugging Face causal-LM directory or an LM run (its "
           "tokenizer and chat template too)", metavar="DIR", group=_F),
    Option("lora", bool, False, "train LoRA adapters only (the base weights stay frozen)", group=_F),
    Option("lora_rank", int, 8, "the adapters' rank r", check=positive, group=_F),
    Option("lora_alpha", float, 16.0, "the adapters' alpha: the update is scaled by alpha / r", check=positive,
           group=_F),
    Option("lora_targets", str, "q,v", "the layers that get adapters, by their Hugging Face names or q, k, v, o, "
           "gate, up, down (comma-separated)", group=_F),
    Option("lora_dropout", float, 0.0, "dropout on the adapters' input", check=fraction, group=_F),
]
# defaults of a fine-tuning run (flags win): a short schedule, LoRA's usual lr, AdamW's for full weights
CHAT_SIZES = dict(batch_size=8, context=1024, dropout=0.0, warmup=None, steps=200)
LORA_LR, FULL_LR = 2e-4, 2e-5


def fine_tuning(s: Settings) -> bool:
    """Whether these settings fine-tune a pretrained model (``--init``, ``--lora`` or a chat file)."""
    return bool(s.init or s.lora or is_chat_file(s.data))


def lora_options(model: nn.Module) -> dict | None:
    """What run.json records of the adapters (PEFT's names), or None without any."""
    from ..adapters import lora_layers, lora_summary
    if not lora_layers(model):
        return None
    summary = lora_summary(model)
    return {k: summary[k] for k in ("r", "lora_alpha", "lora_dropout", "target_modules")}


def apply_recorded_lora(model: nn.Module, recorded: dict | None) -> nn.Module:
    """The adapters run.json records (:func:`lora_options`) put back on a freshly built model."""
    if recorded:
        from ..adapters import add_lora
        add_lora(model, recorded["target_modules"], int(recorded["r"]), float(recorded["lora_alpha"]),
                 float(recorded.get("lora_dropout", 0.0)))
    return model


class ChatTask:
    """The Trainer's view of supervised fine-tuning on conversations (see the module docstring).

    ``train`` / ``valid``: (ids, reply mask) per conversation, cut to ``context`` + 1 tokens. A
    batch is right-padded: padding comes after every real token, so causal attention never lets
    a real token see it, and its positions carry no loss."""

    def __init__(self, model: nn.Module, tokenizer, template: ChatTemplate, train: list, valid: list, *,
                 context: int, batch_size: int):
        self.model, self.tokenizer, self.template = model, tokenizer, template
        self.context, self.batch_size = context, batch_size
        keep = [(ids[:context + 1], mask[:context + 1]) for ids, mask in train]
        self.train = [(i, m) for i, m in keep if any(m[1:])]
        self.valid = [(ids[:context + 1], mask[:context + 1]) for ids, mask in valid]
        self.valid = [(i, m) for i, m in self.valid if any(m[1:])]
        if not self.train:
            raise ValueError(f"no conversation has an assistant token within the first {context} tokens")
        self.steps_per_epoch = max(1, math.ceil(len(self.train) / batch_size))
        # the report's sample: the first held-out conversation up to its first reply
        first = (self.valid or self.train)[0]
        start = first[1].index(True) if True in first[1] else len(first[0])
        self.valid_ids = torch.tensor(first[0][:max(1, start)])

    def plan(self, epoch: int, seed: int) -> list[dict]:
        state = np.random.SeedSequence([seed, epoch]).generate_state(2, np.uint32)
        g = torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))
        order = torch.randperm(len(self.train), generator=g)
        batches = [order[i:i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        return [{"index": b} for b in batches]

    def batch(self, examples: list) -> tuple[Tensor, Tensor, Tensor]:
        """(inputs (B, T), targets (B, T), reply mask of the targets (B, T)), right-padded with 0."""
        T = max(len(ids) for ids, _ in examples) - 1
        x = torch.zeros(len(examples), T, dtype=torch.long)
        y, keep = torch.zeros_like(x), torch.zeros(len(examples), T, dtype=torch.bool)
        for row, (ids, mask) in enumerate(examples):
            n = len(ids) - 1
            x[row, :n], y[row, :n] = torch.tensor(ids[:-1]), torch.tensor(ids[1:])
            keep[row, :n] = torch.tensor(mask[1:])
        return x, y, keep

    def _nll(self, model: nn.Module, examples: list, device) -> tuple[Tensor, int]:
        x, y, keep = (t.to(device) for t in self.batch(examples))
        logits = model(x)
        losses = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none")
        return (losses * keep.flatten()).sum(), int(keep.sum())

    def loss(self, model: nn.Module, batch: dict) -> tuple[Tensor, int, dict]:
        loss, n = self._nll(model, [self.train[int(i)] for i in batch["index"]], batch["index"].device)
        return loss, n, {}

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict:
        if not self.valid:
            return {}
        device = next(model.parameters()).device
        nll, n = 0.0, 0
        for i in range(0, len(self.valid), self.batch_size):
            part, count = self._nll(model, self.valid[i:i + self.batch_size], device)
            nll, n = nll + float(part), n + count
        loss = nll / max(n, 1)
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}

    def save_assets(self, directory: Path) -> None:
        save_run_assets(directory, self.model, self.tokenizer, self.context, self.template)


def save_run_assets(directory: Path, model: nn.Module, tokenizer, context: int, template: ChatTemplate | None):
    """run.json (with the adapters' settings and the chat template) and, with adapters, ``adapter/``."""
    recorded = lora_options(model)
    options = {"context": context, "lora": recorded, "chat_template": None if template is None else template.source}
    write_run(directory, "lm", model, {"text": tokenizer}, options)
    if recorded:
        from ..adapters import save_adapter
        save_adapter(model, Path(directory) / "adapter")


def _base(s: Settings, resume_from: Path | None):
    """(model, tokenizer, chat template, where it came from) of the run being resumed or of --init."""
    saved = None if resume_from is None else resume_point(resume_from, "lm")
    if saved is not None:
        model = apply_recorded_lora(build_model(saved.model_type, saved.config, saved.architecture),
                                    saved.task_options.get("lora"))
        tok = load_tokenizers(saved)["text"]
        source = saved.task_options.get("chat_template")
        return model, tok, ChatTemplate(source) if source else None, "the checkpoint"
    if not s.init:
        raise RunError("--lora and chat files fine-tune a pretrained model: give it with --init DIR")
    info = inspect_path(s.init)
    if info.kind == "run":
        if info.run.task != "lm":
            raise RunError(f"--init {s.init}: {info.describe()}, not a language model")
        model, tok = load_model(info.run), load_tokenizers(info.run)["text"]
        source = info.run.task_options.get("chat_template")
        template = ChatTemplate(source) if source else ChatTemplate.for_model(None, tok)
        model = _merged(model)
    else:
        from ..hub import from_pretrained, load_tokenizer       # hub's: a GGUF file's tokenizer too
        model, tok = from_pretrained(s.init).train(), load_tokenizer(s.init)
        template = ChatTemplate.for_model(s.init, tok)
    if s.lora:
        from ..adapters import add_lora
        torch.manual_seed(s.seed)              # the adapters' initial A depends on the seed alone
        add_lora(model, [t.strip() for t in s.lora_targets.split(",") if t.strip()], s.lora_rank,
                 s.lora_alpha, s.lora_dropout)
    return model, tok, template, s.init


def _merged(model: nn.Module) -> nn.Module:
    """A fine-tuned run used as a base: its adapters folded in, so new ones can go on top."""
    from ..adapters import lora_layers, merge_lora
    return merge_lora(model) if lora_layers(model) else model


def _held_out(items: list, valid: list | None) -> tuple[list, list]:
    """(training, validation): the --valid file's, else the last tenth (at least one item) of the file."""
    if valid is not None:
        return items, valid
    n = max(1, len(items) // 10) if len(items) > 1 else 0
    return items[:len(items) - n], items[len(items) - n:]


def prepare_fine_tuning(task_def, s: Settings, resume_from: Path | None, text_task_cls) -> Setup:
    """``attnlab train lm``'s Setup when ``--init``, ``--lora`` or a chat file is given."""
    if s.data is None:
        raise RunError("fine-tuning needs --data: a chat file (JSONL of {\"messages\": [...]}) or a text file")
    model, tok, template, source = _base(s, resume_from)
    from ..models.registry import architecture_of
    s.model = architecture_of(model).model_type
    limit = model_context(model)
    chat = is_chat_file(s.data)
    d = dict(CHAT_SIZES, lr=LORA_LR if s.lora else FULL_LR, **({} if chat else {"batch_size": 16,
                                                                                        "context": 256}))
    d["context"] = min(d["context"], limit) if limit else d["context"]
    d = s.given_or(d)
    if limit is not None and d["context"] > limit:
        raise ValueError(f"--context {d['context']} exceeds the model's context of {limit} tokens")
    t = task_def._schedule(s, d)
    s.update(context=d["context"], batch_size=d["batch_size"], lr=t["lr"])
    if not t["budget_schedule"]:
        s.update(steps=t["steps"], warmup=t["warmup_steps"])
    if chat:
        template = template or ChatTemplate.for_model(None, tok)
        train, valid = _held_out(read_chat_file(s.data), read_chat_file(s.valid) if s.valid else None)
        encode = [[encode_chat(tok, template, m) for m in part] for part in (train, valid)]
        task = ChatTask(model, tok, template, *encode, context=d["context"], batch_size=d["batch_size"])
        what = f"{len(task.train)} training and {len(task.valid)} validation conversations (the replies' tokens count)"
    else:
        task = _text_task(text_task_cls, model, tok, template, s, d)
        what = f"{len(task.train_ids):,} training and {len(task.valid_ids):,} validation tokens"
    n = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    lines = [f"data: {s.data}: {what}",
             f"model: {type(model).__name__} from {source}, {n / 1e6:.2f}M parameters, {trainable / 1e6:.3f}M "
             f"trained{' (LoRA adapters)' if s.lora else ''}, context {d['context']}",
             task_def._describe(s, d, t, 0, True)[-1]]
    return Setup(task, lines, schedule=t)


def _text_task(cls, model, tok, template, s: Settings, d: dict):
    """The task's own next-token task over a text file, saving the adapters and template with each checkpoint."""
    from ..data.text import encode_documents, text_file_corpus
    corpus = text_file_corpus(s.data, s.valid)
    train, valid = (encode_documents(tok, part, corpus.eos_between) for part in (corpus.train, corpus.valid))

    class AdaptedText(cls):
        def save_assets(self, directory: Path) -> None:
            save_run_assets(directory, self.model, self.tokenizer, self.context, template)

    return AdaptedText(model, tok, train, valid, context=d["context"], batch_size=d["batch_size"])
