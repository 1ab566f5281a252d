"""The embedded spoken corpus: the English side of the numbers corpus (:mod:`attnlab.data.numbers`),
spoken by Debian's ``espeak-ng`` in several voices and at several speeds, as 16 kHz WAV files.

Nothing is downloaded: the sentences come from the grammar and the sound from the synthesizer, so
the corpus is the same on every machine with the same espeak-ng for a given seed (espeak-ng
itself is deterministic). Each utterance is written once into a cache folder under a name that
hashes what made it (text, voice, speed, rate, espeak-ng's version), so a second run, or a run
with more sentences, reuses what is there.

The splits follow the numbers corpus's (disjoint by sentence). Training and validation sentences
are spoken by :data:`TRAIN_VOICES`; the test sentences by :data:`HELD_OUT_VOICE`, a voice and
accent the training never hears, so a word error rate on them measures how well a model
generalises to a new speaker, not how well it remembers one.

espeak-ng writes 22,050 Hz; :func:`resample` brings it to 16 kHz with a windowed-sinc low-pass
filter (cut at the new Nyquist frequency) evaluated at each output sample's time.
"""
from __future__ import annotations

import hashlib
import math
import os
import random
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from ..processors import read_wav, write_wav
from .numbers import number_corpus

__all__ = ["SpeechSynthesisError", "Utterance", "SpokenSplits", "TRAIN_VOICES", "HELD_OUT_VOICE", "SPEEDS",
           "SAMPLING_RATE", "espeak_ng", "speak", "resample", "spoken_numbers", "default_cache"]

SAMPLING_RATE = 16000
# espeak-ng voice+variant names: accents of English with male and female variants
# ("en-gb+m3" would be plain "en-gb": that name takes no variant, "en" does)
TRAIN_VOICES = ("en-us", "en-us+f3", "en+m3", "en+f2", "en-gb-scotland+m5", "en-029+f4")
HELD_OUT_VOICE = "en-gb-x-rp+m7"          # received pronunciation, a variant no training voice has
SPEEDS = (140, 165, 190)                  # words per minute
INSTALL = "install it with 'sudo apt-get install espeak-ng' (scripts/setup.sh does)"


class SpeechSynthesisError(RuntimeError):
    """espeak-ng is missing or failed; the message is one line saying what to do."""


class Utterance(NamedTuple):
    """One spoken sentence: its WAV file (16 kHz, 16-bit PCM), its text, who spoke it and how fast."""
    path: Path
    text: str
    voice: str
    speed: int


class SpokenSplits(NamedTuple):
    """Train / validation utterances in the training voices, test utterances in the held-out voice."""
    train: list[Utterance]
    valid: list[Utterance]
    test: list[Utterance]


def espeak_ng() -> str:
    """The espeak-ng executable; SpeechSynthesisError (one line) when it is not installed."""
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise SpeechSynthesisError(f"the spoken corpus needs espeak-ng, which is not installed: {INSTALL}")
    return exe


def _version(exe: str) -> str:
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, check=False).stdout
    return out.split("Data at")[0].strip()


def resample(x: Tensor, from_rate: int, to_rate: int, half_width: int = 16) -> Tensor:
    """Samples (N,) at ``from_rate`` -> samples at ``to_rate``: each output sample is the sum of
    the input samples within ``half_width`` periods of the lower rate, each weighted by a sinc
    low-pass at the lower rate's Nyquist frequency times a Hann window. The output times fall
    on ``to_rate / gcd`` distinct fractions of an input period, so the weights are computed once
    per fraction."""
    if from_rate == to_rate:
        return x.clone()
    g = math.gcd(from_rate, to_rate)
    up, down = to_rate // g, from_rate // g                  # output n sits at input time n * down / up
    cutoff = min(1.0, up / down)                             # of the input's Nyquist frequency
    reach = int(math.ceil(half_width / cutoff))
    offsets = torch.arange(-reach + 1, reach + 1, dtype=torch.float64)
    phase = (torch.arange(up, dtype=torch.float64) * down % up) / up                    # (up,) fractions
    d = phase[:, None] - offsets                                                        # (up, 2 reach)
    window = torch.where(d.abs() < reach, 0.5 + 0.5 * torch.cos(math.pi * d / reach), torch.zeros(()))
    weights = (cutoff * torch.sinc(cutoff * d) * window).float()
    n = torch.arange(x.numel() * up // down)
    taps = (n * down // up)[:, None] + offsets.long()                                   # (n_out, 2 reach)
    inside = (taps >= 0) & (taps < x.numel())
    values = x.float()[taps.clamp(0, max(x.numel() - 1, 0))] * inside
    return (values * weights[n % up]).sum(1)


def speak(text: str, voice: str, speed: int, rate: int = SAMPLING_RATE) -> Tensor:
    """``text`` spoken by espeak-ng in ``voice`` at ``speed`` words per minute -> samples (N,)
    float32 at ``rate`` Hz."""
    exe = espeak_ng()
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "out.wav"
        done = subprocess.run([exe, "-v", voice, "-s", str(speed), "-w", str(file), text], capture_output=True,
                              text=True, check=False)
        if done.returncode != 0 or not file.is_file():
            raise SpeechSynthesisError(f"espeak-ng -v {voice} failed: {(done.stderr or '').strip() or done.returncode}")
        samples, native = read_wav(file)
    return resample(samples, native, rate)


@dataclass(frozen=True)
class _Plan:
    text: str
    voice: str
    speed: int


def _file(cache: Path, plan: _Plan, version: str) -> Path:
    key = f"{version}\n{plan.voice}\n{plan.speed}\n{SAMPLING_RATE}\n{plan.text}"
    return cache / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.wav"


def _make(cache: Path, plan: _Plan, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(suffix=".wav.tmp", dir=cache)       # atomic: never a half-written file
    os.close(fd)
    try:
        write_wav(tmp, speak(plan.text, plan.voice, plan.speed), SAMPLING_RATE)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _render(cache: Path, plans: list[_Plan], version: str) -> list[Utterance]:
    """The utterances of ``plans``, each file made where it is missing (espeak-ng processes run
    side by side: each file depends on its plan alone, so the result does not depend on the order)."""
    from concurrent.futures import ThreadPoolExecutor
    paths = [_file(cache, plan, version) for plan in plans]
    missing = {path: plan for path, plan in zip(paths, plans) if not path.is_file()}
    if missing:
        with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
            for done in [pool.submit(_make, cache, plan, path) for path, plan in missing.items()]:
                done.result()
    return [Utterance(path, plan.text, plan.voice, plan.speed) for path, plan in zip(paths, plans)]


def default_cache() -> Path:
    """Where the spoken corpus is kept unless told: $XDG_CACHE_HOME/attnlab/spoken-numbers (~/.cache by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attnlab" / "spoken-numbers"


def spoken_numbers(cache: str | Path | None = None, n_train: int = 2000, n_valid: int = 100, n_test: int = 100,
                   seed: int = 0, max_words: int = 8, voices: tuple[str, ...] = TRAIN_VOICES,
                   held_out_voice: str = HELD_OUT_VOICE, speeds: tuple[int, ...] = SPEEDS) -> SpokenSplits:
    """The spoken corpus (see the module docstring), its WAV files made where missing in ``cache``
    (:func:`default_cache` if None). Sentences of 3 to ``max_words`` words; each training and
    validation sentence gets a voice of ``voices`` and a speed of ``speeds`` drawn with ``seed``,
    each test sentence ``held_out_voice`` at a drawn speed. Deterministic for a seed."""
    if held_out_voice in voices:
        raise ValueError(f"spoken_numbers: the held-out voice {held_out_voice!r} is one of the training voices")
    if not voices or not speeds:
        raise ValueError("spoken_numbers: give at least one voice and one speed")
    exe = espeak_ng()
    cache = Path(cache) if cache is not None else default_cache()
    cache.mkdir(parents=True, exist_ok=True)
    train, valid, test = number_corpus(n_train, n_valid, n_test, seed=seed, max_words=max_words)
    rng = random.Random(f"spoken-numbers {seed}")
    plans = [[_Plan(en, rng.choice(voices), rng.choice(speeds)) for en, _ in split] for split in (train, valid)]
    plans.append([_Plan(en, held_out_voice, rng.choice(speeds)) for en, _ in test])
    version = _version(exe)
    return SpokenSplits(*(_render(cache, p, version) for p in plans))
