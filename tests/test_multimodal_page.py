"""docs/multimodal.md: the numbers it quotes are those its measured figures' runs gave (kept in
docs/figures/manifest.json by scripts/figures.py's clip_space and vlm_attention), the commands it
shows are attnlab's, and it carries the figures and its forward reference to speech."""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = (ROOT / "docs" / "multimodal.md").read_text(encoding="utf-8")
MANIFEST = json.loads((ROOT / "docs" / "figures" / "manifest.json").read_text())


def test_the_page_quotes_what_the_clip_run_measured():
    m = MANIFEST["clip_space"]
    assert m["page"] == "multimodal.md" and "--steps 1500" in m["source"]
    assert f"After 1,500 steps the run classifies {m['zero_shot_accuracy']:.1f} % of the 200 held-out digits" in PAGE
    assert f"own digit's images is {m['diagonal_cosine']:.2f}, to the other digits' {m['off_diagonal_cosine']:.2f}" \
        in PAGE
    assert m["diagonal_cosine"] > m["off_diagonal_cosine"] + 0.3         # what the page reads off the figure


def test_the_page_quotes_what_the_vlm_run_measured():
    m = MANIFEST["vlm_attention"]
    assert m["page"] == "multimodal.md" and "--steps 1000" in m["source"]
    assert f"After 1,000 steps the run answers {m['accuracy']:.1f} % of the 200 held-out digits right" in PAGE
    first, second = (100 * s for s in m["answer_position_image_share"])
    assert f"{first:.1f} % of its attention in the first layer and {second:.1f} % in the second" in PAGE
    even = m["image_tokens"] / m["prompt_tokens"]
    assert (m["image_tokens"], m["prompt_tokens"]) == (16, 20) and "16/20 = 80 %" in PAGE
    assert min(m["answer_position_image_share"]) > even                   # "more than an even spread"
    assert m["answer"] == str(m["digit"])


@pytest.mark.parametrize("command", re.findall(r"^attnlab (\w+)", PAGE, re.MULTILINE))
def test_every_command_the_page_shows_exists(command):
    from attnlab.cli import COMMANDS
    assert command in COMMANDS


def test_the_page_shows_its_figures_and_points_to_speech():
    assert "](figures/clip_space.png)" in PAGE and "](figures/vlm_attention.png)" in PAGE
    assert "## Frames as tokens: speech" in PAGE and "log-mel" in PAGE and "attnlab train speech" in PAGE


def test_the_page_quotes_what_the_speech_run_measured():
    m = MANIFEST["speech_attention"]
    flat = " ".join(PAGE.split())                                         # the prose with its line breaks undone
    assert m["page"] == "multimodal.md" and "--time-budget 40" in m["source"]
    assert f'"{m["sentence"]}" came out as "{m["heard"]}"' in flat
    assert m["frames_per_position"] == 2.0 and "each encoder position after the stride-2 convolution covers 40 ms of audio" in flat
    assert f"moves forward at {100 * m['peaks_moving_forward']:.0f} % of the words' steps" in flat
    assert m["peaks_moving_forward"] > 0.5                                 # "the stretches move forward"
    assert f"over the {m['test_sentences']} test sentences in the unseen voice is {m['test_wer']:.1f} %" in flat
    assert "](figures/speech_attention.png)" in PAGE
