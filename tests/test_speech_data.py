"""The spoken corpus (attnlab.data.speech): espeak-ng's sentences as cached 16 kHz WAV files,
deterministic for a seed, the held-out voice only in the test split; the resampler against
sampled sines; one line when espeak-ng is missing."""
import math

import pytest
import torch

from attnlab.data.numbers import number_corpus
from attnlab.data.speech import (HELD_OUT_VOICE, TRAIN_VOICES, SpeechSynthesisError, espeak_ng, resample, speak,
                                 spoken_numbers)
from attnlab.processors import read_wav


@pytest.mark.parametrize("freq", [220.0, 1000.0, 3500.0, 7000.0])
@pytest.mark.parametrize("rates", [(22050, 16000), (16000, 22050), (48000, 16000)])
def test_resample_equals_the_sine_sampled_at_the_new_rate(freq, rates):
    src, dst = rates
    # the sines in float64: float32 times lose 1e-3 of a 7 kHz sine's phase within a second
    x = torch.sin(2 * math.pi * freq * torch.arange(src, dtype=torch.float64) / src).float()
    y = resample(x, src, dst)
    want = torch.sin(2 * math.pi * freq * torch.arange(dst, dtype=torch.float64) / dst)
    assert y.shape == want.shape
    inner = slice(dst // 20, -dst // 20)                    # away from the ends, where the window runs out
    # the filter's transition band starts below the lower Nyquist frequency: 2e-2 at 7 kHz, far less lower down
    assert (y - want)[inner].abs().max() < (2e-2 if freq > 5000 else 3e-4)


def test_resample_removes_what_the_new_rate_cannot_hold():
    x = torch.sin(2 * math.pi * 10000 * torch.arange(22050) / 22050)      # above 8 kHz: would alias to 6 kHz
    assert resample(x, 22050, 16000)[800:-800].abs().max() < 1e-2


def test_voices_are_distinct_and_speak_at_16_khz():
    sounds = [speak("twenty-one dogs", v, 165) for v in TRAIN_VOICES + (HELD_OUT_VOICE,)]
    for i, a in enumerate(sounds):
        assert a.dtype == torch.float32 and 0.1 < a.abs().max() <= 1.01 and 8000 < a.numel() < 48000
        for b in sounds[:i]:                                 # a voice name espeak-ng ignores would repeat another
            assert a.shape != b.shape or not torch.equal(a, b)


def test_corpus_is_cached_and_deterministic(tmp_path):
    splits = spoken_numbers(tmp_path, n_train=5, n_valid=2, n_test=3, seed=4, max_words=6)
    train, valid, test = number_corpus(5, 2, 3, seed=4, max_words=6)
    assert [u.text for u in splits.train] == [en for en, _ in train]
    assert [u.text for u in splits.test] == [en for en, _ in test]
    assert {u.voice for u in splits.test} == {HELD_OUT_VOICE}
    assert {u.voice for u in splits.train + splits.valid} <= set(TRAIN_VOICES)
    for u in splits.train + splits.valid + splits.test:
        x, rate = read_wav(u.path)
        assert rate == 16000 and x.numel() > 4000
    stamps = {u.path: u.path.stat().st_mtime_ns for u in splits.train}
    again = spoken_numbers(tmp_path, n_train=5, n_valid=2, n_test=3, seed=4, max_words=6)
    assert again == splits and all(u.path.stat().st_mtime_ns == stamps[u.path] for u in again.train)
    assert not list(tmp_path.glob("*.tmp"))
    other = spoken_numbers(tmp_path, n_train=5, n_valid=2, n_test=3, seed=5, max_words=6)
    assert [u.text for u in other.train] != [u.text for u in splits.train]


def test_missing_espeak_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SpeechSynthesisError, match="needs espeak-ng, which is not installed: install it with") as e:
        spoken_numbers(tmp_path, n_train=2, n_valid=1, n_test=1)
    assert "\n" not in str(e.value)
    monkeypatch.undo()
    assert espeak_ng().endswith("espeak-ng")
    with pytest.raises(ValueError, match="is one of the training voices"):
        spoken_numbers(tmp_path, voices=("en-us",), held_out_voice="en-us")
