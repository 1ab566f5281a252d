"""Decoding, written once over a small state protocol: greedy, sampling, beam search and
speculative decoding for every model that provides it.

Three layers:

- the model's decoding state (:mod:`attnlab.nn.cache`): a KV cache or a recurrent state with
  ``length``, ``reorder(index)``, ``can_rewind``, ``mark(length)`` and ``rewind(keep, length)``
  (a KV cache truncates, a recurrent state restores per-row snapshots);
- one adaptor per kind of model (:mod:`attnlab.generate.state`), owning that state and the
  token history: :class:`CausalState` (left-padded prompts, a growing attention mask,
  positions from its cumulative sum, holes for rejected drafts) and :class:`Seq2SeqState`
  (memory encoded once, BOS start, memory rows following the cache's);
- one set of loops over any adaptor: :func:`run_sampling` (greedy when temperature is 0),
  :func:`run_beam_search` and :func:`run_speculative` (Leviathan et al. 2023; Chen et al. 2023).

Front doors: :func:`generate` for causal LMs (sampling, ``num_beams``, ``draft_model``);
:func:`greedy_decode`, :func:`sample_decode`, :func:`speculative_decode`, :func:`beam_search`,
:func:`beam_search_nbest` and :func:`translate` for encoder-decoder models (anything with ``encode(src, src_padding_mask) ->
memory``, ``new_cache()`` and ``decode(tgt, memory, src_padding_mask, cache=) -> logits``).

Glossary: B sources or prompts, K beams, S source length, t tokens generated so far,
V vocabulary, N live rows, L slots, k draft tokens.

Conventions of the encoder-decoder functions:

- outputs never contain BOS and contain EOS where the model produced it; a hypothesis that
  reaches ``max_len`` without EOS ends there;
- ``max_len`` counts generated tokens, EOS included; it may be one int or one per source,
  so that a source decodes the same alone or in any batch;
- the source padding mask is (B, S) bool, True for real tokens; when it is None and the
  model's config has a ``pad_id``, it is derived from the ids (as ``Transformer.forward`` does).

The sampling filters are pure functions of a (..., V) logits tensor, for every decoder.
"""
from .sampling import top_k_filter, top_p_filter, token_probs, sample, seen_tokens, apply_repetition_penalty
from .state import CausalState, Seq2SeqState
from .search import GenerationStats, Hypothesis, Rows, Sampling, run_beam_search, run_sampling
from .speculative import run_speculative
from .seq2seq import greedy_decode, sample_decode, speculative_decode, beam_search, beam_search_nbest, translate
from .causal import generate
from .stream import stream_logits, stream_nll

__all__ = ["top_k_filter", "top_p_filter", "token_probs", "sample", "seen_tokens", "apply_repetition_penalty",
           "CausalState", "Seq2SeqState", "GenerationStats", "Hypothesis", "Rows", "Sampling", "run_beam_search",
           "run_sampling", "run_speculative", "greedy_decode", "sample_decode", "speculative_decode", "beam_search",
           "beam_search_nbest", "translate", "generate", "stream_logits", "stream_nll"]
