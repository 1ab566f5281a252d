"""The log-mel front end (attnlab.processors.LogMelFeatureExtractor) against transformers'
WhisperFeatureExtractor, on speech made by espeak-ng and on a synthetic chirp; its
preprocessor_config.json both ways; and the WAV reader's one-line errors."""
import json
import shutil
import subprocess
import wave

import numpy as np
import pytest
import torch
from transformers import WhisperFeatureExtractor

from attnlab.processors import (AudioError, ImageProcessor, LogMelFeatureExtractor, load_processor, read_wav,
                                save_processor, write_wav)

RTOL = 1e-5        # relative to the largest |feature|: fp32 STFT and matmul, the same operations in both


def _chirp(seconds=2.3, rate=16000):
    """A rising tone (100 Hz -> 6 kHz) with a beat, some silence at the end."""
    t = np.arange(int(seconds * rate)) / rate
    x = 0.6 * np.sin(2 * np.pi * (100 * t + 0.5 * (6000 - 100) / seconds * t ** 2)) * (0.6 + 0.4 * np.sin(7 * t))
    x[-rate // 4:] = 0.0
    return x.astype(np.float32)


def _speech(tmp_path):
    """Real speech: espeak-ng at 22.05 kHz, taken to 16 kHz by keeping every sample whose time is
    nearest (rough, but the features only need audio with the structure of speech)."""
    exe = shutil.which("espeak-ng")
    assert exe, "espeak-ng is not installed (scripts/setup.sh installs it)"
    file = tmp_path / "s.wav"
    subprocess.run([exe, "-v", "en-us", "-s", "160", "-w", str(file), "three hundred and forty-two"], check=True)
    x, rate = read_wav(file)
    idx = torch.round(torch.arange(int(x.numel() * 16000 / rate)) * (rate / 16000)).long().clamp(max=x.numel() - 1)
    return x[idx].numpy()


def _close(ours, theirs):
    theirs = torch.as_tensor(theirs)
    assert ours.shape == theirs.shape and ours.dtype == torch.float32
    err = (ours - theirs).abs().max() / theirs.abs().max()
    assert err <= RTOL, f"max error {err:.2e} of scale"


@pytest.mark.parametrize("settings", [{}, {"feature_size": 40, "chunk_length": 4}, {"feature_size": 128, "chunk_length": 1},
                                      {"feature_size": 64, "chunk_length": 2, "n_fft": 512, "hop_length": 128,
                                       "padding_value": 0.1}])
@pytest.mark.parametrize("normalize", [False, True])
def test_features_equal_transformers(settings, normalize, tmp_path):
    speech, chirp = _speech(tmp_path), _chirp()
    long = np.concatenate([speech, chirp] * 10)                    # longer than 30 s: cut to the chunk
    batch = [speech, chirp, chirp[:3000], long]
    theirs = WhisperFeatureExtractor(**settings)(batch, sampling_rate=16000, return_tensors="np",
                                                 do_normalize=normalize).input_features
    ours = LogMelFeatureExtractor(**settings)(batch, sampling_rate=16000, do_normalize=normalize)
    _close(ours, theirs)
    assert ours.shape[-1] == LogMelFeatureExtractor(**settings).nb_max_frames
    # one at a time equals in a batch (the 80 dB floor is each example's own)
    _close(LogMelFeatureExtractor(**settings)([chirp[:3000]], do_normalize=normalize)[0], theirs[2])


def test_saved_config_read_by_transformers_and_back(tmp_path):
    ours = LogMelFeatureExtractor(feature_size=40, chunk_length=4, padding_value=0.05)
    assert save_processor(ours, tmp_path) == "preprocessor_config.json"
    theirs = WhisperFeatureExtractor.from_pretrained(tmp_path)
    for name in ("feature_size", "sampling_rate", "hop_length", "chunk_length", "n_fft", "padding_value", "n_samples",
                 "nb_max_frames"):
        assert getattr(theirs, name) == getattr(ours, name), name
    chirp = _chirp()
    _close(ours([chirp]), theirs(chirp, sampling_rate=16000, return_tensors="np").input_features)
    # and transformers' own file is read back as a feature extractor, the modality found from the file
    out = tmp_path / "hf"
    WhisperFeatureExtractor(feature_size=64, chunk_length=2, hop_length=128).save_pretrained(out)
    back = load_processor(out)
    assert isinstance(back, LogMelFeatureExtractor) and back.modality == "audio"
    assert (back.feature_size, back.chunk_length, back.hop_length) == (64, 2, 128)
    assert back == load_processor(out / "preprocessor_config.json", "audio")
    # an image processor's file still reads as one
    (tmp_path / "img").mkdir()
    ImageProcessor(size=8).save(tmp_path / "img")
    assert isinstance(load_processor(tmp_path / "img"), ImageProcessor)


def test_bad_settings_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="dither must be 0.0"):
        LogMelFeatureExtractor(dither=1e-4)
    with pytest.raises(ValueError, match="feature_size must be a positive integer"):
        LogMelFeatureExtractor(feature_size=0)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"feature_extractor_type": "x", "hop_length": -1}))
    with pytest.raises(ValueError, match=r"preprocessor_config.json: LogMelFeatureExtractor: hop_length"):
        load_processor(tmp_path)
    with pytest.raises(ValueError, match="at 8000 Hz, the extractor takes 16000 Hz"):
        LogMelFeatureExtractor()([_chirp()], sampling_rate=8000)


def test_wav_round_trip_and_stereo(tmp_path):
    x = _chirp(0.5)
    write_wav(tmp_path / "a.wav", x, 16000)
    y, rate = read_wav(tmp_path / "a.wav")
    assert rate == 16000 and y.shape == (x.size,)
    assert (y.numpy() - x).__abs__().max() <= 0.5 / 32768 + 1e-7          # 16-bit rounding only
    with wave.open(str(tmp_path / "st.wav"), "wb") as w:                  # stereo: the channels averaged
        w.setnchannels(2), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes(np.array([[1000, 3000], [-2000, 0]], dtype="<i2").tobytes())
    assert read_wav(tmp_path / "st.wav")[0].tolist() == [2000 / 32768, -1000 / 32768]


def test_bad_wav_files_get_one_line(tmp_path):
    def err(path, match):
        with pytest.raises(AudioError, match=match) as e:
            LogMelFeatureExtractor(chunk_length=1).features(path)
        assert "\n" not in str(e.value) and str(path) in str(e.value)

    err(tmp_path / "none.wav", "no such sound file")
    (tmp_path / "text.wav").write_text("hello, not a sound")
    err(tmp_path / "text.wav", "not a 16-bit PCM WAV file")
    with wave.open(str(tmp_path / "u8.wav"), "wb") as w:
        w.setnchannels(1), w.setsampwidth(1), w.setframerate(16000), w.writeframes(bytes(100))
    err(tmp_path / "u8.wav", "8-bit samples; attnlab reads 16-bit PCM")
    write_wav(tmp_path / "r.wav", _chirp(0.2, 8000), 8000)
    err(tmp_path / "r.wav", "sampled at 8000 Hz; the model takes 16000 Hz")
    write_wav(tmp_path / "t.wav", _chirp(0.2), 16000)
    data = (tmp_path / "t.wav").read_bytes()
    (tmp_path / "t.wav").write_bytes(data[:len(data) // 2])
    err(tmp_path / "t.wav", "truncated WAV file")
    write_wav(tmp_path / "empty.wav", np.zeros(0), 16000)
    err(tmp_path / "empty.wav", "holds no samples")
    # a good file gives the features of its samples
    write_wav(tmp_path / "ok.wav", _chirp(0.7), 16000)
    fe = LogMelFeatureExtractor(chunk_length=1)
    assert torch.equal(fe.features(tmp_path / "ok.wav"), fe([read_wav(tmp_path / "ok.wav")[0]])[0])
