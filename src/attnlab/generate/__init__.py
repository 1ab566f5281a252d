"""Decoding: sampling filters, greedy and beam search for encoder-decoder models, translate,
and causal-LM generation with speculative decoding.

Glossary: B sources, K beams, S source length, t tokens generated so far, V vocabulary;
for causal LMs N live rows, L cache slots, k draft tokens.

An encoder-decoder model is anything with ``encode(src, src_padding_mask) -> memory``,
``new_cache() -> LayerCaches`` and ``decode(tgt, memory, src_padding_mask, cache=cache) ->
(logits, _)`` (see attnlab.models.transformer). Generation lives here, outside the model:
the source is encoded once, then one loop asks :class:`Seq2SeqState` for the next-token
logits, picks tokens and appends them. With the cache the decoder sees only the new token
each step; without it the whole prefix is recomputed (kept for the equality tests).

Conventions shared by every function here:

- outputs never contain BOS and contain EOS where the model produced it; a hypothesis that
  reaches ``max_len`` without EOS ends there;
- ``max_len`` counts generated tokens, EOS included; it may be one int or one per source,
  so that a source decodes the same alone or in any batch;
- the source padding mask is (B, S) bool, True for real tokens; when it is None and the
  model's config has a ``pad_id``, it is derived from the ids (as ``Transformer.forward`` does).

The sampling filters are pure functions of a (..., V) logits tensor, for every decoder.

A causal LM (:class:`attnlab.models.CausalLM`) generates with :func:`generate`: one prefill,
then one cached step per token, left-padded batches, repetition penalty, EOS stopping, a
streamer, and speculative decoding with a draft model (Leviathan et al. 2023; Chen et al.
2023), whose rejected tokens are dropped from both caches by :func:`truncate_cache`.
"""
from .sampling import top_k_filter, top_p_filter, token_probs, sample, seen_tokens, apply_repetition_penalty
from .seq2seq import Seq2SeqState, greedy_decode, Hypothesis, beam_search, beam_search_nbest, translate
from .causal import GenerationStats, truncate_cache, generate

__all__ = ["top_k_filter", "top_p_filter", "token_probs", "sample", "seen_tokens",
           "apply_repetition_penalty", "Seq2SeqState", "greedy_decode", "Hypothesis", "beam_search",
           "beam_search_nbest", "translate", "GenerationStats", "truncate_cache", "generate"]
