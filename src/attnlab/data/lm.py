"""Causal language modelling: a text corpus + a tokenizer + a decoder-only LM, for the Trainer.

    setup = prepare_lm(LMOptions(data=None))       # None: the embedded corpus (Python's own source)
    Trainer(setup.task, TrainConfig(...)).fit()
    lm = load_lm("runs/lm")                         # best/ or latest checkpoint, or a Hugging Face dir
    out = complete(lm, encode_prompt(lm, "def main("), 100, temperature=0.8)
    text_perplexity(lm, open("held_out.txt").read())   # {"tokens", "loss", "ppl", "bits_per_byte"}

Data. The embedded corpus exists on every machine without a download: the ``*.py`` files of
the Python standard library this interpreter runs (the directory of the ``os`` module, minus
site-packages, dist-packages and test directories), sorted by relative path, read until
``max_bytes``; files that are not UTF-8 or are empty are skipped. Every 20th file is held out
for validation, so training and validation share no file. It is deterministic for one Python
version (another version has another standard library). Each file is one document: an EOS
token follows it. A text file (``--data``) is one document, split as nanoGPT splits
Shakespeare: the first 90% of its characters train, the last 10% validate (or a separate
``valid`` file). The tokenizer is trained on the training text only.

Batches (nanoGPT's sampling). ``plan(epoch, seed)`` draws ``steps_per_epoch`` micro-batches of
``batch_size`` random window starts i with a generator seeded by (seed, epoch); the window is
x = ids[i : i+T], y = ids[i+1 : i+T+1], T = the model's context. Only the starts are planned,
so an epoch's plan is small whatever the corpus size.

Checkpoint layout (one layout: attnlab's). A checkpoint directory of an LM run holds

    model.safetensors     the Trainer's weights under attnlab's parameter names
    lm.json               {"task": "lm", "format": 1, "model_type": "gpt2" | "llama" | "mixtral",
                           "config": the model config's fields, "context": T,
                           "tokenizer": "lm_tokenizer.json"}
    lm_tokenizer.json     the attnlab tokenizer (char or BPE)
    optimizer.safetensors, trainer_state.json   the Trainer's (for --resume)

:func:`load_lm` reads such a checkpoint, a run directory (its best/, else its latest), or a
Hugging Face model directory (config.json + weights + tokenizer.json). A trained model becomes
a Hugging Face directory with ``load_lm(path).model.save_pretrained(dir)``.
"""
from __future__ import annotations

import json
import math
import os
import sys
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..generate import GenerationStats
from ..models.causal_lm import CausalLM
from ..models.convert import spec_for, spec_for_type
from ..models.gpt import GPT, GPTConfig
from ..models.llama import Llama, LlamaConfig
from ..models.mixtral import Mixtral, MixtralConfig
from ..nn.linear import optimize_for_inference
from ..nn.mlp import SparseMoE
from ..tokenizer import BOS_ID, EOS_ID, Tokenizer, load_tokenizer
from ..train.checkpoint import load_checkpoint, resolve_checkpoint
from .files import DataFormatError

__all__ = ["TextCorpus", "stdlib_corpus", "read_text_file", "text_file_corpus", "encode_documents", "LMOptions",
           "LMSetup", "build_model", "prepare_lm", "LanguageModelTask", "LoadedLM", "is_language_model", "load_lm",
           "encode_prompt",
           "TextStreamer", "Completion", "complete", "text_perplexity", "META", "TOKENIZER_FILE"]

META, TOKENIZER_FILE, FORMAT = "lm.json", "lm_tokenizer.json", 1
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


# ----------------------------------------------------------------------------- corpora
@dataclass
class TextCorpus:
    """Training and validation documents, and where they came from."""
    train: list[str]
    valid: list[str]
    train_names: list[str]
    valid_names: list[str]
    source: str                      # a description for progress messages
    eos_between: bool                # an EOS token ends each document (separate files)


def stdlib_corpus(max_bytes: int = 2_000_000, valid_every: int = 20) -> TextCorpus:
    """The standard library's own source (see the module docstring): the first ``max_bytes`` of
    UTF-8 ``*.py`` files in relative-path order; file i goes to validation when
    ``i % valid_every == valid_every // 2`` (at least one file does)."""
    if max_bytes <= 0 or valid_every < 2:
        raise ValueError(f"stdlib_corpus: need max_bytes > 0 and valid_every >= 2, got {max_bytes}, {valid_every}")
    root = Path(os.__file__).resolve().parent
    names, texts, total = [], [], 0
    for name, path in _python_files(root):
        if total >= max_bytes:
            break
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text.strip():
            names.append(name)
            texts.append(text)
            total += len(raw)
    if len(texts) < 2:
        raise ValueError(f"stdlib_corpus: found fewer than 2 source files under {root}")
    held = {i for i in range(len(texts)) if i % valid_every == valid_every // 2} or {len(texts) - 1}
    train, valid = [i for i in range(len(texts)) if i not in held], sorted(held)
    version = ".".join(map(str, sys.version_info[:3]))
    return TextCorpus([texts[i] for i in train], [texts[i] for i in valid], [names[i] for i in train],
                      [names[i] for i in valid], f"Python {version} standard library, {len(texts)} files, "
                      f"{total / 1e6:.1f} MB", eos_between=True)


def _python_files(root: Path) -> list[tuple[str, Path]]:
    """(relative posix path, path) of the ``*.py`` files under ``root``, sorted, skipping
    _SKIPPED_DIRS and the build-configuration directory (config-3.x-...)."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIPPED_DIRS and not d.startswith("config-")]
        found += [Path(folder, f) for f in files if f.endswith(".py")]
    return sorted((p.relative_to(root).as_posix(), p) for p in found)


def read_text_file(path: str | os.PathLike) -> str:
    """The whole of a UTF-8 text file (a leading BOM dropped); a non-UTF-8 byte raises
    :class:`DataFormatError` naming the file and the line."""
    path = str(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file")
    raw = Path(path).read_bytes().removeprefix(b"\xef\xbb\xbf")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataFormatError(path, line, f"not valid UTF-8 (byte 0x{raw[e.start]:02x})") from None


def text_file_corpus(path: str, valid: str | None = None, valid_fraction: float = 0.1) -> TextCorpus:
    """One text file: its last ``valid_fraction`` of characters validate, unless ``valid`` names a file."""
    text = read_text_file(path)
    if not text.strip():
        raise ValueError(f"{path}: the file is empty")
    if valid is not None:
        return TextCorpus([text], [read_text_file(valid)], [path], [valid], path, eos_between=False)
    cut = int(len(text) * (1.0 - valid_fraction))
    return TextCorpus([text[:cut]], [text[cut:]], [path], [f"{path} (last {valid_fraction:.0%})"],
                      path, eos_between=False)


def encode_documents(tokenizer, documents: Sequence[str], eos_between: bool) -> Tensor:
    """All documents' ids in one 1-D LongTensor; with ``eos_between`` each document ends with EOS."""
    ids: list[int] = []
    for doc in documents:
        ids.extend(tokenizer.encode(doc))
        if eos_between:
            ids.append(tokenizer.eos_id)
    return torch.tensor(ids, dtype=torch.long)


# ----------------------------------------------------------------------------- models
def _gpt(vocab: int, o: "LMOptions") -> CausalLM:
    return GPT(GPTConfig(vocab_size=vocab, n_positions=o.context, d_model=o.d_model, num_heads=o.num_heads,
                         num_layers=o.num_layers, d_ff=o.d_ff, dropout=o.dropout, bos_token_id=BOS_ID,
                         eos_token_id=EOS_ID))


def _llama_fields(vocab: int, o: "LMOptions") -> dict:
    # SwiGLU has three matrices: 8/3 d (rounded up to 32) keeps the parameters of a 4d two-matrix MLP
    d_ff = o.d_ff or 32 * math.ceil(8 * o.d_model / 3 / 32)
    return dict(vocab_size=vocab, d_model=o.d_model, num_heads=o.num_heads, num_kv_heads=o.num_heads,
                num_layers=o.num_layers, d_ff=d_ff, max_position_embeddings=o.context, attention_dropout=o.dropout,
                bos_token_id=BOS_ID, eos_token_id=EOS_ID)


def _llama(vocab: int, o: "LMOptions") -> CausalLM:
    return Llama(LlamaConfig(**_llama_fields(vocab, o)))


def _mixtral(vocab: int, o: "LMOptions") -> CausalLM:
    return Mixtral(MixtralConfig(**_llama_fields(vocab, o), num_experts=o.num_experts, top_k=o.top_k,
                                 router_aux_loss_coef=o.router_aux_loss_coef))


MODELS: dict[str, Callable[[int, "LMOptions"], CausalLM]] = {"gpt": _gpt, "llama": _llama, "mixtral": _mixtral}


@dataclass
class LMOptions:
    """What to train on and how big a model; ``None`` fields get defaults for the data."""
    data: str | None = None             # UTF-8 text file; None = the embedded corpus
    valid: str | None = None            # validation text file; None = the last 10% of ``data``
    model: str = "gpt"                  # "gpt" | "llama" | "mixtral"
    tokenizer: str | None = None        # "char" | "bpe"; default bpe (embedded) / char (files)
    vocab_size: int | None = None       # cap; default 2000 for BPE, every character for char
    context: int = 128                  # T, the model's context and the training window
    batch_size: int = 16                # windows per micro-batch (per process)
    d_model: int = 128
    num_heads: int = 4
    num_layers: int = 4
    d_ff: int | None = None             # default 4 d (GPT), 8/3 d rounded up to 32 (LLaMA, Mixtral)
    dropout: float = 0.0
    num_experts: int = 4                # Mixtral only
    top_k: int = 2
    router_aux_loss_coef: float = 0.02
    corpus_bytes: int = 2_000_000       # embedded corpus size
    eval_windows: int = 64              # validation windows, evenly spaced
    seed: int = 0

    def __post_init__(self):
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r} (known: {', '.join(MODELS)})")
        if self.tokenizer not in (None, "char", "bpe"):
            raise ValueError(f"language models use a 'char' or 'bpe' tokenizer, not {self.tokenizer!r}")
        for name in ("context", "batch_size", "d_model", "num_heads", "num_layers", "corpus_bytes", "eval_windows"):
            if getattr(self, name) <= 0:
                raise ValueError(f"LMOptions: {name} must be positive, got {getattr(self, name)}")


def build_model(kind: str, vocab_size: int, options: LMOptions) -> CausalLM:
    """A fresh model of ``kind`` ("gpt", "llama", "mixtral") sized by ``options``."""
    if kind not in MODELS:
        raise ValueError(f"unknown model {kind!r} (known: {', '.join(MODELS)})")
    return MODELS[kind](vocab_size, options)


# ----------------------------------------------------------------------------- the task
@contextmanager
def _router_logits(moe_layers: list[nn.Module]) -> Iterator[list[Tensor]]:
    """Collect the (N, X) router logits each SparseMoE layer returns during one forward. Hooks,
    not ``forward_with_router_logits``, so that the call goes through ``model(...)`` (a DDP wrapper
    synchronises gradients only then); they are removed on exit."""
    found: list[Tensor] = []
    handles = [m.register_forward_hook(lambda module, args, out: found.append(out[1])) for m in moe_layers]
    try:
        yield found
    finally:
        for h in handles:
            h.remove()


class LanguageModelTask:
    """The Trainer's view of next-token prediction (see :class:`attnlab.train.Task`).

    ``loss`` = the cross-entropy SUM over the B*T predicted tokens, n = B*T. A mixture-of-experts
    model adds ``router_aux_loss_coef * aux_loss * n`` (so after the Trainer divides by the step's
    tokens it is coef * aux, pitfall 20) and reports extras ``aux_loss`` (aux * n) and
    ``expert_{e}`` (tokens routed to expert e, averaged over layers, divided by top_k): the Trainer
    logs them divided by the tokens, i.e. the aux loss and each expert's share of the routing
    (1/X each when balanced).
    """

    def __init__(self, model: CausalLM, tokenizer, train_ids: Tensor, valid_ids: Tensor, *, context: int,
                 batch_size: int, steps_per_epoch: int | None = None, eval_windows: int = 64):
        self.model, self.tokenizer = model, tokenizer
        self.train_ids, self.valid_ids = train_ids.long().cpu(), valid_ids.long().cpu()
        self.context, self.batch_size, self.eval_windows = context, batch_size, eval_windows
        if context > model.config.max_seq_len:
            raise ValueError(f"LanguageModelTask: context {context} exceeds the model's {model.config.max_seq_len}")
        for name, ids in (("training", self.train_ids), ("validation", self.valid_ids)):
            if ids.dim() != 1 or len(ids) < context + 1:
                raise ValueError(f"the {name} text has {len(ids)} tokens, fewer than context + 1 = {context + 1}; "
                                 "use a smaller context or more text")
        per_epoch = len(self.train_ids) // (batch_size * context)
        self.steps_per_epoch = steps_per_epoch or max(64, min(4096, per_epoch))
        self.moe = [m for m in model.modules() if isinstance(m, SparseMoE)]
        self._offsets = torch.arange(context + 1)

    def windows(self, ids: Tensor, starts: Tensor) -> tuple[Tensor, Tensor]:
        """Starts (B,) -> x = ids[i : i+T] and y = ids[i+1 : i+T+1], each (B, T)."""
        w = ids[starts.cpu()[:, None] + self._offsets]
        return w[:, :-1], w[:, 1:]

    def plan(self, epoch: int, seed: int) -> list[dict]:
        state = np.random.SeedSequence([seed, epoch]).generate_state(2, np.uint32)
        g = torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))
        high = len(self.train_ids) - self.context               # starts in [0, len - T - 1]
        starts = torch.randint(0, high, (self.steps_per_epoch, self.batch_size), generator=g)
        return [{"start": s} for s in starts]

    def loss(self, model: nn.Module, batch: dict) -> tuple[Tensor, int, dict]:
        device = batch["start"].device
        x, y = (t.to(device) for t in self.windows(self.train_ids, batch["start"]))
        with _router_logits(self.moe) as router_logits:
            logits = model(x)
        n = y.numel()
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
        if not self.moe:
            return loss, n, {}
        aux = self.model.aux_loss(router_logits)
        loss = loss + self.model.config.router_aux_loss_coef * aux * n
        return loss, n, {"aux_loss": aux.detach() * n, **self._expert_counts(router_logits)}

    def _expert_counts(self, router_logits: list[Tensor]) -> dict[str, Tensor]:
        X, k = self.model.config.num_experts, self.model.config.top_k
        counts = sum(torch.bincount(r.detach().float().softmax(-1).topk(k, dim=-1).indices.flatten(), minlength=X)
                     for r in router_logits)
        shares = counts.double() / (len(router_logits) * k)
        return {f"expert_{e}": shares[e] for e in range(X)}

    def eval_starts(self) -> Tensor:
        """The validation windows' starts: ``eval_windows`` evenly spaced, the same every time."""
        last = len(self.valid_ids) - self.context - 1
        n = min(self.eval_windows, last + 1)
        return torch.arange(n) * last // max(n - 1, 1)     # integers: exact for any corpus size

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict:
        device = next(model.parameters()).device
        nll, tokens = 0.0, 0
        for starts in self.eval_starts().split(self.batch_size):
            x, y = (t.to(device) for t in self.windows(self.valid_ids, starts))
            nll += float(F.cross_entropy(model(x).float().flatten(0, 1), y.flatten(), reduction="sum"))
            tokens += y.numel()
        loss = nll / tokens
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}

    def save_assets(self, directory: Path) -> None:
        directory = Path(directory)
        self.tokenizer.save(directory / TOKENIZER_FILE)
        meta = {"task": "lm", "format": FORMAT, "model_type": spec_for(self.model).model_type,
                "config": asdict(self.model.config), "context": self.context, "tokenizer": TOKENIZER_FILE}
        (directory / META).write_text(json.dumps(meta, indent=1))


@dataclass
class LMSetup:
    task: LanguageModelTask
    corpus: TextCorpus
    resumed: bool = False              # model and tokenizer came from the run's checkpoint


def _saved_run(path: str | Path | None):
    """(lm.json dict, tokenizer) of the checkpoint a run would resume from, or None."""
    if path is None:
        return None
    ckpt = resolve_checkpoint(path)
    if ckpt is None or not (ckpt / META).is_file():
        return None
    meta = _read_meta(ckpt)
    return meta, load_tokenizer(ckpt / meta["tokenizer"])


def prepare_lm(o: LMOptions, resume_from: str | Path | None = None) -> LMSetup:
    """Read the corpus, train the tokenizer, build the model and the task. With ``resume_from``
    (a run directory holding a checkpoint) the checkpoint's tokenizer, model config and context
    are reused, so the options' sizes do not matter."""
    corpus = stdlib_corpus(o.corpus_bytes) if o.data is None else text_file_corpus(o.data, o.valid)
    saved = _saved_run(resume_from)
    if saved is not None:
        meta, tok = saved
        model, context = _model_from_meta(meta), meta["context"]
    else:
        kind = o.tokenizer or ("bpe" if o.data is None else "char")
        vocab = o.vocab_size if o.vocab_size is not None else (2000 if kind == "bpe" else None)
        tok = Tokenizer.registry[kind].train(corpus.train, vocab)
        model, context = build_model(o.model, tok.vocab_size, o), o.context
    train = encode_documents(tok, corpus.train, corpus.eos_between)
    valid = encode_documents(tok, corpus.valid, corpus.eos_between)
    task = LanguageModelTask(model, tok, train, valid, context=context, batch_size=o.batch_size,
                             eval_windows=o.eval_windows)
    return LMSetup(task, corpus, resumed=saved is not None)


# ----------------------------------------------------------------------------- loading
class _HFText:
    """A Hugging Face ``tokenizers.Tokenizer`` behind attnlab's encode/decode interface."""

    def __init__(self, hf):
        self.hf = hf

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text).ids              # the tokenizer's own special tokens (e.g. BOS)

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def vocabulary(self) -> dict:
        return self.hf.get_vocab(with_added_tokens=True)


@dataclass
class LoadedLM:
    """A causal LM ready to generate: the model (eval mode), a text codec and its special ids."""
    model: CausalLM
    tokenizer: object                  # encode(text) -> ids, decode(ids) -> text
    eos_ids: list[int]                 # generation stops at any of these
    start_id: int | None               # the token an empty prompt begins with
    path: Path
    kind: str                          # "attnlab" | "huggingface"

    @property
    def context(self) -> int:
        return self.model.config.max_seq_len

    def vocabulary(self):
        tok = self.tokenizer
        return tok.vocabulary() if hasattr(tok, "vocabulary") else tok.tokens(range(tok.vocab_size))


def _read_meta(ckpt: Path) -> dict:
    meta = json.loads((ckpt / META).read_text())
    if meta.get("task") != "lm" or meta.get("format") != FORMAT:
        raise ValueError(f"{ckpt / META}: not an attnlab LM checkpoint of format {FORMAT}")
    return meta


def _model_from_meta(meta: dict) -> CausalLM:
    spec = spec_for_type(meta["model_type"], META)
    return spec.model_cls(spec.config_cls(**meta["config"]))


def _lm_checkpoint(path: Path) -> Path | None:
    for candidate in (path, path / "best"):
        if (candidate / META).is_file():
            return candidate
    ckpt = resolve_checkpoint(path)
    return ckpt if ckpt is not None and (ckpt / META).is_file() else None


def is_language_model(path: str | Path) -> bool:
    """Whether :func:`load_lm` would read ``path`` as a language model: an attnlab LM checkpoint or
    run directory, or a Hugging Face directory (config.json)."""
    path = Path(path)
    return path.exists() and (_lm_checkpoint(path) is not None or (path / "config.json").is_file())


def load_lm(path: str | Path, device: str | torch.device | None = None) -> LoadedLM:
    """An LM checkpoint, an LM run directory (best/, else latest) or a Hugging Face directory, in eval
    mode and with :func:`attnlab.nn.optimize_for_inference` applied (faster gradient-free CPU calls)."""
    from ..hub import from_pretrained, load_tokenizer as load_hf_tokenizer
    path = Path(path)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not path.exists():
        raise FileNotFoundError(f"no model at {path}")
    ckpt = _lm_checkpoint(path)
    if ckpt is not None:
        meta = _read_meta(ckpt)
        model = _model_from_meta(meta)
        load_checkpoint(ckpt, model)
        tok = load_tokenizer(ckpt / meta["tokenizer"])
        return LoadedLM(optimize_for_inference(model.to(device).eval()), tok, [tok.eos_id], tok.eos_id, ckpt, "attnlab")
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: neither an attnlab LM checkpoint (no {META}) nor a Hugging Face model "
                         "directory (no config.json)")
    model = from_pretrained(path)
    if not isinstance(model, CausalLM):
        raise ValueError(f"{path}: {type(model).__name__} is not a causal language model")
    hf_tok = load_hf_tokenizer(path)
    V = model.config.vocab_size
    eos = model.config.eos_token_id
    eos = [i for i in ([eos] if isinstance(eos, int) else eos or []) if 0 <= i < V]
    bos = model.config.bos_token_id
    start = bos if bos is not None and 0 <= bos < V else (eos[0] if eos else None)
    return LoadedLM(optimize_for_inference(model.to(device).eval()), _HFText(hf_tok), eos, start, path, "huggingface")


# ----------------------------------------------------------------------------- generation
def encode_prompt(lm: LoadedLM, prompt: str, draft: LoadedLM | None = None) -> list[int]:
    """The prompt's ids (an empty prompt: the start token); ValueError if they fill the context
    of the model (or of the draft) or if the draft's vocabulary differs."""
    if draft is not None and draft.vocabulary() != lm.vocabulary():
        raise ValueError(f"the draft model {draft.path} has a different tokenizer from {lm.path}")
    ids = lm.tokenizer.encode(prompt) if prompt else []
    if not ids:
        if lm.start_id is None:
            raise ValueError(f"{lm.path}: no BOS or EOS token to start from; give a prompt")
        ids = [lm.start_id]
    context = min(m.context for m in (lm, draft) if m is not None)
    if len(ids) >= context:
        raise ValueError(f"the prompt is {len(ids)} tokens long, but the model's context is {context} tokens "
                         f"(a prompt may have at most {context - 1})")
    return ids


class TextStreamer:
    """Turns generated token columns into text as they come: decodes prompt + new tokens, hands
    ``emit`` the text not yet emitted, and holds back a trailing U+FFFD (the first bytes of a
    character that a byte-level tokenizer spreads over several tokens)."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int], emit: Callable[[str], None] | None = None):
        self.tokenizer, self.ids, self.emit = tokenizer, list(prompt_ids), emit
        self.prefix = tokenizer.decode(self.ids)
        self.sent = 0
        self.text = ""

    def __call__(self, column: Tensor) -> None:
        self.ids.append(int(column[0]))
        self._push(final=False)

    def _push(self, final: bool) -> None:
        full = self.tokenizer.decode(self.ids)
        self.text = full[len(self.prefix):] if full.startswith(self.prefix) else full
        if not final and self.text.endswith("\ufffd"):
            return
        if self.emit is not None and len(self.text) > self.sent:
            self.emit(self.text[self.sent:])
        self.sent = max(self.sent, len(self.text))

    def end(self) -> str:
        self._push(final=True)
        return self.text


@dataclass
class Completion:
    text: str                          # the continuation only
    new_tokens: int
    max_new_tokens: int                # after capping at the context
    stats: GenerationStats = field(default_factory=GenerationStats)


def complete(lm: LoadedLM, prompt_ids: list[int], max_new_tokens: int, *, temperature: float = 0.8,
             top_k: int | None = None, top_p: float | None = None, repetition_penalty: float = 1.0, seed: int = 0,
             draft: LoadedLM | None = None, num_draft_tokens: int = 4,
             on_text: Callable[[str], None] | None = None) -> Completion:
    """Continue ``prompt_ids`` (from :func:`encode_prompt`) by up to ``max_new_tokens`` (capped so
    that prompt + new tokens fit the context), stopping at EOS; ``on_text`` gets the text as it
    is produced. ``draft`` turns on speculative decoding."""
    context = min(m.context for m in (lm, draft) if m is not None)
    budget = min(max_new_tokens, context - len(prompt_ids))
    device = next(lm.model.parameters()).device
    generator = torch.Generator(device).manual_seed(seed)
    streamer = TextStreamer(lm.tokenizer, prompt_ids, on_text)
    stats = GenerationStats()
    out = lm.model.generate(torch.tensor([prompt_ids], device=device), budget, temperature, top_k, top_p,
                            eos_token_id=lm.eos_ids or None, draft_model=None if draft is None else draft.model,
                            repetition_penalty=repetition_penalty, generator=generator,
                            num_draft_tokens=num_draft_tokens, streamer=streamer, stats=stats)
    return Completion(streamer.end(), out.size(1) - len(prompt_ids), budget, stats)


# ----------------------------------------------------------------------------- evaluation
@torch.no_grad()
def text_perplexity(lm: LoadedLM, text: str, *, stride: int | None = None, batch_size: int = 8,
                    max_tokens: int | None = None, progress: bool = False) -> dict:
    """Perplexity of ``text`` under ``lm`` (the tokens of one document), with sliding windows.

    The text's ids are cut into windows of the model's context T that start every ``stride``
    tokens (default T // 2); each window scores only the tokens that no earlier window scored,
    so every token but the first is predicted exactly once, with at least T - stride tokens of
    left context (except in the first window). stride = T - 1: nearly disjoint windows, the
    cheapest; stride 1: full context for every token, T times the work. ``max_tokens`` keeps
    the first that many ids. Returns ``tokens`` (scored), ``loss`` (mean negative
    log-likelihood, nats per token), ``ppl`` = exp(loss) and ``bits_per_byte`` (the total
    negative log-likelihood in bits over the scored part's UTF-8 bytes, an approximation when
    ``max_tokens`` cuts the text: comparable across tokenizers).
    """
    ids = list(lm.tokenizer.encode(text))
    cut = max_tokens is not None and len(ids) > max_tokens
    if max_tokens is not None and max_tokens < 2:
        raise ValueError(f"max_tokens must be at least 2, got {max_tokens}")
    if cut:
        ids = ids[:max_tokens]
    n = len(ids)
    if n < 2:
        raise ValueError(f"the text has {n} token(s); a perplexity needs at least 2")
    T = lm.context
    stride = T // 2 if stride is None else stride
    if not 1 <= stride <= T - 1:
        raise ValueError(f"stride must be in [1, context - 1] = [1, {T - 1}], got {stride}")
    V = lm.model.config.vocab_size
    if max(ids) >= V:
        raise ValueError(f"the tokenizer produced id {max(ids)}, beyond the model's vocabulary of {V}")
    # window k: ids[b_k : e_k], b_k = k * stride, e_k = min(b_k + T, n); it scores targets ids[s_k : e_k]
    # from the logits at s_k - 1 ... e_k - 2, where s_k = e_{k-1} (s_0 = 1)
    windows, scored_to = [], 1
    for b in range(0, n, stride):
        e = min(b + T, n)
        windows.append((b, e, scored_to))
        scored_to = e
        if e == n:
            break
    ids_t = torch.tensor(ids, dtype=torch.long, device=next(lm.model.parameters()).device)
    per_call = max(1, min(batch_size, (256 << 20) // max(1, T * V * 4)))     # logits of one call <= ~256 MiB
    short = len(windows) > 1 and windows[-1][1] - windows[-1][0] != T          # a short last window goes alone
    full = windows[:-1] if short else windows
    groups = [full[i:i + per_call] for i in range(0, len(full), per_call)] + ([windows[-1:]] if short else [])
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=n - 1, unit="tok", desc="perplexity", file=sys.stderr, leave=False)
    total = ids_t.new_zeros((), dtype=torch.float64)                 # summed on the device: one sync at the end
    for group in groups:
        logits = lm.model(torch.stack([ids_t[b:e] for b, e, _ in group]))
        for row, (b, e, s) in enumerate(group):
            total += F.cross_entropy(logits[row, s - 1 - b:e - 1 - b].float(), ids_t[s:e], reduction="sum")
            if bar is not None:
                bar.update(e - s)
    if bar is not None:
        bar.close()
    nll, tokens = float(total), n - 1
    loss = nll / tokens
    text_bytes = len((lm.tokenizer.decode(ids) if cut else text).encode("utf-8"))
    return {"tokens": tokens, "loss": loss, "ppl": math.exp(min(loss, 50.0)),
            "bits_per_byte": nll / math.log(2) / max(1, text_bytes), "windows": len(windows), "stride": stride,
            "context": T}
