"""Whisper against transformers' WhisperForConditionalGeneration, both ways, on a small random
config: logits on real log-mel features (attnlab's front end), greedy tokens against a greedy loop
over transformers' forward, cached decoding against the full forward, and the model's input errors.
(tests/test_contract.py also holds the family to the whole contract.)"""
import numpy as np
import pytest
import torch
from transformers import WhisperConfig as HFConfig
from transformers import WhisperForConditionalGeneration as HFWhisper

import attnlab
from attnlab.generate import greedy_decode
from attnlab.models.whisper import WHISPER, WhisperForConditionalGeneration, sinusoids
from attnlab.processors import LogMelFeatureExtractor
from _tolerance import FP32, assert_close_scaled

SIZES = dict(vocab_size=61, num_mel_bins=20, d_model=48, encoder_layers=2, encoder_attention_heads=4,
             encoder_ffn_dim=80, decoder_layers=3, decoder_attention_heads=6, decoder_ffn_dim=96,
             max_source_positions=50, max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             decoder_start_token_id=1)
START, EOS = 1, 2


def _features(B=3):
    """Log-mel frames of real-looking sound: tones and noise through attnlab's front end (1 s, 100 frames)."""
    g = np.random.default_rng(0)
    t = np.arange(16000) / 16000
    waves = [np.sin(2 * np.pi * (200 + 300 * b) * t * (1 + t)) * 0.5 + 0.05 * g.standard_normal(16000)
             for b in range(B)]
    return LogMelFeatureExtractor(feature_size=SIZES["num_mel_bins"], chunk_length=1)(waves)


def _hf_model(seed=0):
    torch.manual_seed(seed)
    hf = HFWhisper(HFConfig(**SIZES, begin_suppress_tokens=None)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():                      # weights of order 0.2, norms about 1: every mapping error shows
        for name, p in hf.named_parameters():
            if "embed_positions" not in name or "decoder" in name:
                base = 1.0 if p.dim() == 1 and "layer_norm" in name and name.endswith("weight") else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
    return hf


def _ids(B=3, T=9, seed=1):
    ids = torch.randint(3, SIZES["vocab_size"], (B, T), generator=torch.Generator().manual_seed(seed))
    ids[:, 0] = START
    return ids


def _hf_greedy(hf, features, steps):
    """Greedy decoding with transformers' forward alone: the argmax after the whole prefix, each step."""
    out = torch.full((features.size(0), 1), START)
    with torch.no_grad():
        for _ in range(steps):
            nxt = hf(input_features=features, decoder_input_ids=out, use_cache=False).logits[:, -1].argmax(-1)
            out = torch.cat([out, nxt[:, None]], 1)
    return out[:, 1:]


def test_loads_transformers_directory_with_equal_logits_and_tokens(tmp_path):
    hf = _hf_model()
    hf.save_pretrained(tmp_path)
    ours = attnlab.from_pretrained(tmp_path)
    assert type(ours) is WhisperForConditionalGeneration
    x, ids = _features(), _ids()
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0                                              # a padded row: the real tokens are unchanged
    with torch.no_grad():
        want = hf(input_features=x, decoder_input_ids=ids, decoder_attention_mask=mask).logits
        got = ours(x, ids, decoder_attention_mask=mask)
    assert_close_scaled(got, want, FP32, "logits from a transformers directory")
    assert_close_scaled(ours.encode(x), hf.model.encoder(x).last_hidden_state, FP32, "encoder output")
    # greedy tokens: a loop over transformers' forward against attnlab's decoding, with and without the cache
    steps = 12
    want_tokens = _hf_greedy(hf, x, steps)
    for cache in (True, False):
        got_tokens = greedy_decode(ours, x, max_len=steps, bos_id=START, eos_id=EOS, pad_id=0, use_cache=cache)
        for row, want_row in zip(got_tokens.tolist(), want_tokens.tolist()):
            n = want_row.index(EOS) + 1 if EOS in want_row else steps
            assert row[:n] == want_row[:n] and all(t == 0 for t in row[n:]), (cache, row, want_row)


def test_saved_directory_read_by_transformers(tmp_path):
    torch.manual_seed(0)
    ours = WHISPER.default.build(WHISPER.config_cls(**SIZES)).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    ours.save_pretrained(tmp_path)
    hf, info = HFWhisper.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    x, ids = _features(), _ids(seed=4)
    with torch.no_grad():
        assert_close_scaled(ours(x, ids), hf.eval()(input_features=x, decoder_input_ids=ids).logits, FP32,
                            "logits in transformers")
    # the encoder's fixed table travelled as it is, and a fresh model's equals transformers' own
    assert torch.equal(hf.model.encoder.embed_positions.weight, ours.encoder_positions)
    assert_close_scaled(sinusoids(50, 48), HFWhisper(HFConfig(**SIZES)).model.encoder.embed_positions.weight,
                        1e-6, "sinusoids")


def test_cached_decoding_equals_the_full_forward():
    torch.manual_seed(0)
    model = WHISPER.default.build(WHISPER.config_cls(**SIZES)).eval()
    x, ids = _features(2), _ids(2, 10)
    with torch.no_grad():
        memory = model.encode(x)
        full = model.decode(ids, memory)
        cache = model.new_cache()
        steps = [model.decode(ids[:, :4], memory, cache=cache)] + \
                [model.decode(ids[:, i:i + 1], memory, cache=cache) for i in range(4, 10)]
    assert_close_scaled(torch.cat(steps, 1), full, FP32, "cached vs full")


def test_bad_inputs_name_the_problem():
    model = WHISPER.default.build(WHISPER.config_cls(**SIZES)).eval()
    ids = _ids(1, 3)
    with pytest.raises(ValueError, match="101 frames, the encoder takes at most 100"):
        model(torch.zeros(1, 20, 101), ids)
    with pytest.raises(ValueError, match=r"input_features must be a float \(batch, 20 mel bins, frames\)"):
        model(torch.zeros(1, 80, 100), ids)
    with pytest.raises(ValueError, match="33 decoder positions, the model has 32"):
        model(torch.zeros(1, 20, 100), torch.ones(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match=r"ids in \[0, 61\)"):
        model(torch.zeros(1, 20, 100), torch.full((1, 2), 61))
    with pytest.raises(ValueError, match="unsupported|not supported"):
        WHISPER.config_from_hf({**SIZES, "tie_word_embeddings": False})
