"""Encoder-decoder decoding: greedy, sampling and beam search over a :class:`Seq2SeqState`
(the shared loops of :mod:`attnlab.generate.search`), and translate()."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .sampling import _check_sampling
from .search import GenerationStats, Hypothesis, Rows, Sampling, check_beam_options, run_beam_search, run_sampling
from .speculative import run_speculative
from .state import Seq2SeqState, context_of


MaxLen = int | Sequence[int] | Tensor


# ---------------------------------------------------------------------------- checks
def _check_id(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")


def _prepare(model, src: Tensor, src_padding_mask: Tensor | None, max_len: MaxLen, who: str,
             **ids: int) -> tuple[Tensor, Tensor | None, list[int]]:
    """Validate the inputs; return src as long, the source mask and one max_len per source. A
    floating-point src is an encoder's features (batch first, e.g. log-mel frames (B, M, F)),
    passed to ``model.encode`` as they are, without a padding mask."""
    if isinstance(src, Tensor) and src.is_floating_point() and src.dim() >= 2:
        if src_padding_mask is not None:
            raise ValueError(f"{who}: a padding mask goes with token ids, not with features")
        if src.size(0) == 0:
            raise ValueError(f"{who}: src must have at least one row")
        return src, None, _limits(max_len, src.size(0), model, who, **ids)
    if not isinstance(src, Tensor) or src.dim() != 2 or src.dtype.is_floating_point or src.dtype == torch.bool \
            or src.is_complex():
        raise ValueError(f"{who}: src must be a 2-D integer tensor (batch, seq), got "
                         f"{getattr(src, 'dtype', type(src).__name__)} {tuple(getattr(src, 'shape', ()))}")
    B, S = src.shape
    if B == 0 or S == 0:
        raise ValueError(f"{who}: src must have at least one row and one position, got shape {(B, S)}")
    config = getattr(model, "config", None)
    if src_padding_mask is None and getattr(config, "pad_id", None) is not None:
        src_padding_mask = src != config.pad_id
    if src_padding_mask is not None and (not isinstance(src_padding_mask, Tensor) or src_padding_mask.dtype
                                         != torch.bool or src_padding_mask.shape != src.shape):
        raise ValueError(f"{who}: src_padding_mask must be a bool tensor of shape {(B, S)} (True = real token), got "
                         f"{getattr(src_padding_mask, 'dtype', type(src_padding_mask).__name__)} "
                         f"{tuple(getattr(src_padding_mask, 'shape', ()))}")
    return src.long(), src_padding_mask, _limits(max_len, B, model, who, **ids)


def _limits(max_len: MaxLen, B: int, model, who: str, **ids: int) -> list[int]:
    """The special ids checked; one max_len per source, within the model's context."""
    for name, value in ids.items():
        _check_id(f"{who}: {name}", value)
    limits = max_len.tolist() if isinstance(max_len, Tensor) else max_len
    limits = [limits] * B if isinstance(limits, int) and not isinstance(limits, bool) else list(limits)
    if len(limits) != B or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in limits):
        raise ValueError(f"{who}: max_len must be an int >= 1 or one such int per source ({B}), got {max_len!r}")
    longest = context_of(model)
    if longest is not None and max(limits) > longest:
        raise ValueError(f"{who}: max_len {max(limits)} exceeds the model's max_seq_len {longest}")
    return limits


# ---------------------------------------------------------------------------- greedy and sampling
@torch.no_grad()
def sample_decode(model, src: Tensor, src_padding_mask: Tensor | None = None, *, max_len: MaxLen,
                  bos_id: int, eos_id: int, pad_id: int = 0, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None, generator: torch.Generator | None = None,
                  use_cache: bool = True) -> Tensor:
    """Sampled decoding of a batch of sources -> tokens (B, L), L <= max(max_len).

    Each token is drawn from :func:`attnlab.generate.token_probs` (temperature, then top-k,
    then top-p); temperature 0 is greedy. Each row runs up to and including EOS, then
    ``pad_id``. A row stops at EOS or at its own max_len; finished rows leave the batch, and
    the loop ends when none is left. ``use_cache=False`` recomputes the whole prefix every step
    (same result; with a ``generator`` seeded alike, the same draws).
    """
    _check_sampling("sample_decode", temperature, top_k, top_p)
    src, mask, limits = _prepare(model, src, src_padding_mask, max_len, "sample_decode",
                                 bos_id=bos_id, eos_id=eos_id, pad_id=pad_id)
    state = Seq2SeqState(model, model.encode(src, mask), mask, bos_id, use_cache)
    rows = Rows(torch.tensor(limits, device=src.device), torch.tensor([eos_id], device=src.device), pad_id)
    return run_sampling(state, rows, Sampling(temperature, top_k, top_p), generator)


def greedy_decode(model, src: Tensor, src_padding_mask: Tensor | None = None, *, max_len: MaxLen,
                  bos_id: int, eos_id: int, pad_id: int = 0, use_cache: bool = True) -> Tensor:
    """Greedy decoding of a batch of sources -> tokens (B, L), L <= max(max_len): the argmax
    continuation of each row up to and including EOS, then ``pad_id`` (:func:`sample_decode`
    at temperature 0)."""
    return sample_decode(model, src, src_padding_mask, max_len=max_len, bos_id=bos_id, eos_id=eos_id,
                         pad_id=pad_id, temperature=0.0, use_cache=use_cache)


@torch.no_grad()
def speculative_decode(model, draft_model, src: Tensor, src_padding_mask: Tensor | None = None, *,
                       max_len: MaxLen, bos_id: int, eos_id: int, pad_id: int = 0, num_draft_tokens: int = 4,
                       temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                       generator: torch.Generator | None = None, stats: GenerationStats | None = None) -> Tensor:
    """:func:`sample_decode` with speculative decoding -> tokens (B, L): ``draft_model``, an
    encoder-decoder over the same vocabularies, proposes ``num_draft_tokens`` tokens per round
    and ``model`` checks them in one decoder pass (:func:`attnlab.generate.run_speculative`);
    the output distribution is ``model``'s, and greedy output (temperature 0) is
    :func:`greedy_decode`'s. Sources decode one at a time: decoder positions count tokens, so
    rows that accept different numbers of drafts could not stay aligned in one batch.
    """
    _check_sampling("speculative_decode", temperature, top_k, top_p)
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
        raise ValueError(f"speculative_decode: num_draft_tokens must be an int >= 1, got {num_draft_tokens!r}")
    src, mask, limits = _prepare(model, src, src_padding_mask, max_len, "speculative_decode",
                                 bos_id=bos_id, eos_id=eos_id, pad_id=pad_id)
    out = torch.full((src.size(0), max(limits)), pad_id, dtype=torch.long, device=src.device)
    width = 0
    for b in range(src.size(0)):
        one, m = src[b:b + 1], None if mask is None else mask[b:b + 1]
        target = Seq2SeqState(model, model.encode(one, m), m, bos_id)
        draft = Seq2SeqState(draft_model, draft_model.encode(one, m), m, bos_id)
        rows = Rows(torch.tensor([limits[b]], device=src.device), torch.tensor([eos_id], device=src.device), pad_id)
        tokens = run_speculative(target, draft, rows, num_draft_tokens, Sampling(temperature, top_k, top_p),
                                 generator, stats)[0]
        out[b, :tokens.numel()] = tokens
        width = max(width, tokens.numel())
    if stats is not None:
        stats.new_tokens += width
    return out[:, :width]


# ---------------------------------------------------------------------------- beam search
@torch.no_grad()
def beam_search_nbest(model, src: Tensor, src_padding_mask: Tensor | None = None, *, beam_size: int = 4,
                      max_len: MaxLen, bos_id: int, eos_id: int, pad_id: int = 0,
                      length_penalty: float = 1.0, use_cache: bool = True) -> list[list[Hypothesis]]:
    """Beam search over a batch of sources -> per source, every finished hypothesis, best first
    (tokens without BOS). The search is :func:`attnlab.generate.run_beam_search`: ranking by
    score / len**length_penalty, no early stop that could return a shorter-but-worse hypothesis,
    ``beam_size=1`` exactly :func:`greedy_decode`. The source is encoded once and its memory rows
    follow the beams. ``pad_id`` is unused by the search itself (outputs are lists) and accepted
    for symmetry with greedy_decode.
    """
    check_beam_options("beam_search", beam_size, length_penalty)
    src, mask, limits = _prepare(model, src, src_padding_mask, max_len, "beam_search",
                                 bos_id=bos_id, eos_id=eos_id, pad_id=pad_id)
    state = Seq2SeqState(model, model.encode(src, mask), mask, bos_id, use_cache)
    return run_beam_search(state, limits, [eos_id], beam_size=beam_size, length_penalty=length_penalty)


def beam_search(model, src: Tensor, src_padding_mask: Tensor | None = None, *, beam_size: int = 4,
                max_len: MaxLen, bos_id: int, eos_id: int, pad_id: int = 0,
                length_penalty: float = 1.0, use_cache: bool = True) -> list[list[int]]:
    """The best hypothesis of :func:`beam_search_nbest` per source: tokens without BOS, with EOS
    where produced (as :func:`greedy_decode`, without the padding)."""
    nbest = beam_search_nbest(model, src, src_padding_mask, beam_size=beam_size, max_len=max_len, bos_id=bos_id,
                              eos_id=eos_id, pad_id=pad_id, length_penalty=length_penalty, use_cache=use_cache)
    return [hyps[0].tokens for hyps in nbest]


# ---------------------------------------------------------------------------- translate
def _strip(ids: list[int], eos_id: int, pad_id: int) -> list[int]:
    ids = ids[:ids.index(eos_id)] if eos_id in ids else ids
    return [i for i in ids if i != pad_id]


def translate(model, src_tok, tgt_tok, texts: Sequence[str], *, beam_size: int = 1,
              max_len: int | None = None, device: torch.device | str | None = None, batch_size: int = 32,
              src_eos: bool = True, length_penalty: float = 1.0, temperature: float = 0.0,
              top_k: int | None = None, top_p: float | None = None,
              generator: torch.Generator | None = None) -> list[str]:
    """Translate ``texts`` with an encoder-decoder model -> one string per text, in order.

    Sources are ``src_tok.encode(text)``, plus ``src_tok.eos_id`` when ``src_eos``: give the
    source as the model was trained on it. The default (True) suits models trained with a source
    EOS (the convention of fairseq and Marian, and of this module's tests); attnlab's translation
    task trains sources without BOS or EOS (:mod:`attnlab.tasks.translate`), so every call of
    the task (its BLEU evaluation and its Translator, hence ``attnlab translate`` and ``attnlab
    eval``) passes ``src_eos=False``. An empty text translates to "" without
    running the model (there is nothing to translate; a model would invent a sentence). Right-padded with ``src_tok.pad_id`` in batches of similar
    length. ``max_len`` defaults per text to 2 * len(source) + 10, capped by the model's
    context (:func:`attnlab.generate.state.context_of`), so a greedy or beam translation does not depend on its batch.
    beam_size 1 decodes with :func:`sample_decode`: greedy at ``temperature`` 0 (the default),
    sampled otherwise (``top_k``, ``top_p``, ``generator``); beam search does not sample. The
    model runs in eval mode and gets its previous mode back. ``device`` defaults to the model's.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"translate: batch_size must be an int >= 1, got {batch_size!r}")
    _check_sampling("translate", temperature, top_k, top_p)
    check_beam_options("translate", beam_size, length_penalty)
    if beam_size > 1 and (temperature > 0 or top_k is not None or top_p is not None):
        raise ValueError("translate: beam search (beam_size > 1) does not sample: leave temperature 0, "
                         "top_k and top_p None")
    if isinstance(texts, str):
        raise ValueError("translate: texts must be a sequence of strings, not one string")
    if device is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu")) \
            if hasattr(model, "parameters") else torch.device("cpu")
    longest = context_of(model)
    sources = [list(src_tok.encode(t)) + ([src_tok.eos_id] if src_eos else []) for t in texts]
    for i, ids in enumerate(sources):
        if longest is not None and len(ids) > longest:
            raise ValueError(f"translate: text {i} has {len(ids)} source tokens, more than the model's "
                             f"max_seq_len {longest}")
    limits = [max_len if max_len is not None else min(2 * len(ids) + 10, longest or 2 * len(ids) + 10)
              for ids in sources]
    order = sorted((i for i in range(len(texts)) if texts[i].strip()), key=lambda i: len(sources[i]), reverse=True)
    results: list[str] = [""] * len(texts)
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    try:
        for start in range(0, len(order), batch_size):
            batch = order[start:start + batch_size]
            width = max(1, max(len(sources[i]) for i in batch))
            src = torch.full((len(batch), width), src_tok.pad_id, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.bool)
            for row, i in enumerate(batch):
                src[row, :len(sources[i])] = torch.tensor(sources[i], dtype=torch.long)
                mask[row, :len(sources[i])] = True
            common = dict(max_len=[limits[i] for i in batch], bos_id=tgt_tok.bos_id, eos_id=tgt_tok.eos_id,
                          pad_id=tgt_tok.pad_id)
            if beam_size == 1:
                outputs = sample_decode(model, src.to(device), mask.to(device), temperature=temperature,
                                        top_k=top_k, top_p=top_p, generator=generator, **common).tolist()
            else:
                outputs = beam_search(model, src.to(device), mask.to(device), beam_size=beam_size,
                                      length_penalty=length_penalty, **common)
            for i, ids in zip(batch, outputs):
                results[i] = tgt_tok.decode(_strip(ids, tgt_tok.eos_id, tgt_tok.pad_id))
    finally:
        if was_training and hasattr(model, "train"):
            model.train()
    return results
