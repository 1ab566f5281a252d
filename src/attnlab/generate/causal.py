"""Causal-LM generation: :func:`generate` sets up a :class:`CausalState` and runs one of the
shared loops (greedy / sampling, beam search, speculative decoding) over it."""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .sampling import _check_sampling, seen_tokens
from .search import GenerationStats, Rows, Sampling, check_beam_options, run_beam_search, run_sampling
from .speculative import run_speculative
from .state import CausalState, context_of
from ..nn.kv_cache import KVCacheKind


def _ids_list(name: str, value, V: int) -> list[int]:
    values = [value] if isinstance(value, int) and not isinstance(value, bool) else list(value)
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < V for v in values):
        raise ValueError(f"generate: {name} must be a token id (or ids) in [0, vocab_size={V}), got {value!r}")
    return values


def _check_causal(model, draft_model, input_ids, attention_mask, max_new_tokens: int, opts: dict) -> Tensor:
    """Validate :func:`generate`'s arguments; return the (B, T) bool attention mask."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or 0 in input_ids.shape \
            or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool or input_ids.is_complex():
        raise ValueError(f"generate: input_ids must be a non-empty integer (batch, seq) tensor, got "
                         f"{getattr(input_ids, 'dtype', type(input_ids).__name__)} "
                         f"{tuple(getattr(input_ids, 'shape', ()))}")
    V = model.config.vocab_size
    lo, hi = (int(v) for v in input_ids.aminmax())
    if lo < 0 or hi >= V:
        raise ValueError(f"generate: token id {hi if hi >= V else lo} is out of range [0, vocab_size={V})")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask
    if not isinstance(mask, Tensor) or mask.shape != input_ids.shape or mask.is_floating_point() \
            and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(f"generate: attention_mask must be a 0/1 or bool tensor of shape {tuple(input_ids.shape)}")
    mask = mask.bool().to(input_ids.device)
    if not bool(mask[:, -1].all()):
        raise ValueError("generate: every prompt must end with a real token: pad batched prompts on the LEFT")
    longest = int(mask.sum(-1).max())
    kind = KVCacheKind.of(opts["kv_cache"])
    chunk = opts["prefill_chunk"]
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"generate: prefill_chunk must be an int >= 1 or None, got {chunk!r}")
    if (chunk is not None or kind.kind != "full") and not opts["use_cache"]:
        raise ValueError("generate: kv_cache and prefill_chunk need use_cache=True")
    for who, m in (("the model", model), ("the draft model", draft_model)):
        context = None if m is None else context_of(m)          # None: no positions, no limit
        if m is model and kind.kind == "sink":
            context = None                          # positions inside the cache: never past s + window
        if context is not None and longest + max_new_tokens > context:
            raise ValueError(f"generate: {longest} prompt + {max_new_tokens} new tokens exceed {who}'s context of "
                             f"{context} tokens")
    if draft_model is not None:
        if draft_model.config.vocab_size != V:
            raise ValueError(f"generate: the draft model's vocab_size {draft_model.config.vocab_size} differs from "
                             f"the model's {V}")
        k = opts["num_draft_tokens"]
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"generate: num_draft_tokens must be an int >= 1, got {k!r}")
        if not opts["use_cache"]:
            raise ValueError("generate: speculative decoding (draft_model) needs use_cache=True")
    _check_sampling("generate", opts["temperature"], opts["top_k"], opts["top_p"])
    penalty = opts["repetition_penalty"]
    if not (isinstance(penalty, (int, float)) and math.isfinite(penalty) and penalty > 0):
        raise ValueError(f"generate: repetition_penalty must be a finite number > 0, got {penalty!r}")
    if opts["streamer"] is not None and not callable(opts["streamer"]):
        raise ValueError("generate: streamer must be a callable taking a (batch,) tensor of token ids")
    _check_beams(opts, draft_model)
    return mask


def _check_beams(opts: dict, draft_model) -> None:
    """Beam search ranks whole hypotheses by log-probability: it neither samples nor streams."""
    check_beam_options("generate", opts["num_beams"], opts["length_penalty"], "num_beams")
    if opts["num_beams"] == 1:
        return
    clashes = [name for name, on in (("temperature > 0", opts["temperature"] > 0), ("top_k", opts["top_k"]),
                                     ("top_p", opts["top_p"]), ("repetition_penalty",
                                                                opts["repetition_penalty"] != 1.0),
                                     ("draft_model", draft_model is not None),
                                     ("streamer", opts["streamer"] is not None)) if on]
    if clashes:
        raise ValueError(f"generate: beam search (num_beams={opts['num_beams']}) does not combine with "
                         f"{', '.join(clashes)}")


@torch.no_grad()
def generate(model, input_ids: Tensor, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, eos_token_id: int | Sequence[int] | None = None, draft_model=None, *,
             attention_mask: Tensor | None = None, repetition_penalty: float = 1.0,
             generator: torch.Generator | None = None, num_draft_tokens: int = 4, streamer=None,
             pad_token_id: int | None = None, use_cache: bool = True, stats: GenerationStats | None = None,
             num_beams: int = 1, length_penalty: float = 1.0, kv_cache=None,
             prefill_chunk: int | None = None) -> Tensor:
    """Continue the prompts ``input_ids`` (B, T) of a causal LM -> (B, T + n), n <= max_new_tokens.

    ``model`` is a :class:`~attnlab.models.CausalLM`, or any model with ``forward(ids,
    attention_mask=, cache=) -> (B, T, V)``, ``new_cache()`` (a KV cache or a recurrent state, see
    :class:`attnlab.nn.cache.DecodingState`) and ``config.vocab_size``; its context
    (:func:`attnlab.generate.state.context_of`: as its family states it), where it has one, caps
    prompt + new tokens (a model without positions has none).
    One prefill of the prompts, then one cached step per token. Prompts of different lengths are
    LEFT-padded with ``attention_mask`` (B, T) (1 = real token); the mask grows by one column per
    token and the model takes positions from its cumulative sum, so a row generates what its
    prompt alone would.

    Each token is drawn from :func:`token_probs` of the logits after ``repetition_penalty`` (CTRL:
    for tokens already in the row, prompt included, padding excluded); temperature 0 is greedy.
    A row ends at ``eos_token_id`` (one id or several) or after ``max_new_tokens``; a finished row
    emits ``pad_token_id`` (default: the EOS id) until every row has finished, then the loop stops.
    ``streamer(column)`` gets each output column (B,) once every row has produced it.

    ``num_beams`` > 1 is beam search (:func:`attnlab.generate.run_beam_search`): each row becomes
    its best hypothesis by log-prob sum / length ** ``length_penalty`` (length counting the new
    tokens, EOS included), padded with ``pad_token_id``; the search stops only when no live beam
    can still win, so it never returns a shorter-but-worse hypothesis. Each step keeps K
    unfinished beams besides the hypotheses that end, as transformers' ``generate(num_beams=K,
    length_penalty=..., early_stopping="never")`` does, which gives the same tokens; its default
    ``early_stopping=False`` stops on a heuristic bound that can return a shorter, worse
    hypothesis. Beam search is deterministic: no sampling, penalty, draft model or streamer.

    ``draft_model`` (same vocabulary) turns on speculative decoding: it proposes
    ``num_draft_tokens`` tokens per round, the model scores them in one pass, and the accept /
    resample rule keeps the output distribution the model's own; greedy output is identical to
    plain greedy. Both models' states must be able to rewind (``can_rewind``: a KV cache, or a
    recurrent state that keeps snapshots); one that cannot is refused before any forward pass.

    ``kv_cache`` chooses what the model's attention layers keep (:mod:`attnlab.nn.kv_cache`): a
    :class:`~attnlab.nn.kv_cache.KVCacheKind` or a kind's name (``"full"``, ``"sliding"``,
    ``"sink"``, ``"int8"``, ``"int4"``); None, the model's own full cache. The draft model keeps
    its own. With a sink cache positions stay inside the cache, so prompt + new tokens may run
    past the model's context. ``prefill_chunk`` feeds a long prompt to the model that many slots
    at a time (the same logits; the memory of one chunk's activations instead of the prompt's). ``stats`` (a
    :class:`GenerationStats`) counts forward passes. ``use_cache=False`` recomputes the whole
    prefix each step (for tests). Models keep their train/eval mode: call ``.eval()`` first, or
    dropout makes every pass random.
    """
    opts = dict(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
                num_draft_tokens=num_draft_tokens, use_cache=use_cache, streamer=streamer, num_beams=num_beams,
                length_penalty=length_penalty, kv_cache=kv_cache, prefill_chunk=prefill_chunk)
    mask = _check_causal(model, draft_model, input_ids, attention_mask, max_new_tokens, opts)
    V = model.config.vocab_size
    eos = None if eos_token_id is None else _ids_list("eos_token_id", eos_token_id, V)
    fill = _ids_list("pad_token_id", pad_token_id, V)[0] if pad_token_id is not None else eos[0] if eos else 0
    input_ids = input_ids.long()
    stats = GenerationStats() if stats is None else stats
    state = CausalState(model, input_ids, mask, use_cache, kv_cache, prefill_chunk)
    if num_beams > 1:
        out = _beam_output(run_beam_search(state, [max_new_tokens] * input_ids.size(0), eos or [],
                                           beam_size=num_beams, length_penalty=length_penalty, stats=stats), fill)
    else:
        limits = torch.full((input_ids.size(0),), max_new_tokens, device=mask.device)
        rows = Rows(limits, None if eos is None else torch.tensor(eos, device=mask.device), fill, repetition_penalty,
                    seen_tokens(input_ids, V, mask) if repetition_penalty != 1.0 else None)
        sampling = Sampling(temperature, top_k, top_p, repetition_penalty)
        if draft_model is None:
            out = run_sampling(state, rows, sampling, generator, stats, streamer)
        else:
            draft = CausalState(draft_model, input_ids, mask, prefill_chunk=prefill_chunk)
            out = run_speculative(state, draft, rows, num_draft_tokens, sampling, generator, stats, streamer)
    stats.new_tokens += out.size(1)
    return torch.cat([input_ids, out.to(input_ids.device)], dim=1)


def _beam_output(nbest: list, fill: int) -> Tensor:
    """The best hypothesis of each row as a (B, n) tensor padded with ``fill``."""
    best = [hyps[0].tokens for hyps in nbest]
    out = torch.full((len(best), max(len(b) for b in best)), fill, dtype=torch.long)
    for i, tokens in enumerate(best):
        out[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    return out
