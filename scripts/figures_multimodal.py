"""The multimodal lesson's figures (docs/multimodal.md), measured from trained runs: on the embedded
digits a contrastive image-text model (``attnlab train clip``) and a vision-language model
(``attnlab train vlm``), and a speech recogniser on the spoken numbers (``attnlab train speech``).
Each is ``--clip-run DIR`` / ``--vlm-run DIR`` / ``--speech-run DIR`` or trained here with
:data:`CLIP_COMMAND` / :data:`VLM_COMMAND` / :data:`SPEECH_COMMAND` (seeded; a few minutes each on
one core for the first two, the speech run's 40-minute budget for the third). Their manifest
entries keep the numbers the page quotes (tests/test_multimodal_page.py checks the page against them).
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from figure_common import plt, save_figure

ROOT = Path(__file__).resolve().parent.parent
CLIP_COMMAND = ["train", "clip", "--steps", "1500", "--seed", "0", "--no-progress"]
VLM_COMMAND = ["train", "vlm", "--steps", "1000", "--seed", "0", "--no-progress"]
SPEECH_COMMAND = ["train", "speech", "--time-budget", "40", "--seed", "0", "--no-progress"]
QUESTION = "what digit is this?"
SHOWN_DIGIT = 3                       # the held-out digit whose attention vlm_attention draws
_RUNS: dict = {}


def _run(name: str, command: list[str], run: Path | None) -> tuple[Path, str]:
    """``run``, else one trained here with ``command`` (once per process)."""
    if name not in _RUNS:
        if run is None:
            run = Path(tempfile.mkdtemp(prefix="attnlab-figures-")) / name
            subprocess.run([sys.executable, "-m", "attnlab.cli", *command, "--out", str(run)], check=True, cwd=ROOT,
                           stdout=subprocess.DEVNULL)
        _RUNS[name] = run, "attnlab " + " ".join(command)
    return _RUNS[name]


def _held_out():
    from attnlab.data.digits import digits_split
    x, y = digits_split()["test"]
    return [a for a in x[:, 0].numpy()], y


def clip_space(path: Path, run: Path | None = None) -> dict:
    """The shared embedding space of a trained contrastive run: the 200 held-out digits' image
    vectors and the ten captions' text vectors projected on the image vectors' two main axes, and
    the mean cosine of each caption to each digit's images."""
    from attnlab.tasks import get_task, open_run
    run, source = _run("clip", CLIP_COMMAND, run)
    clf = get_task("clip").load(open_run(run))
    images, labels = _held_out()
    v = clf.image_vectors(images)                                       # (200, P), unit length
    t = clf.text_vectors([clf.template.format(d) for d in clf.labels])  # (10, P)
    cos = torch.stack([(t @ v[labels == d].t()).mean(1) for d in range(10)], 1)    # caption x digit
    accuracy = 100.0 * float(((v @ t.t()).argmax(1) == labels).float().mean())
    centre = v.mean(0)
    _, _, axes2 = torch.linalg.svd(v - centre, full_matrices=False)
    pv, pt = (v - centre) @ axes2[:2].t(), (t - centre) @ axes2[:2].t()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4.3))
    colours = plt.get_cmap("tab10")
    for d in range(10):
        a.scatter(pv[labels == d, 0], pv[labels == d, 1], s=9, color=colours(d), alpha=0.6)
        a.scatter(pt[d, 0], pt[d, 1], s=160, marker="*", color=colours(d), edgecolors="black", linewidths=0.8)
        a.annotate(str(d), (float(pt[d, 0]), float(pt[d, 1])), xytext=(5, 5), textcoords="offset points", fontsize=9)
    a.set_title("held-out digits (dots) and captions (stars), one space", fontsize=9)
    a.set_xlabel("first principal axis of the image vectors", fontsize=8)
    a.set_ylabel("second", fontsize=8)
    im = b.imshow(cos.numpy(), cmap="viridis")
    b.set_xticks(range(10), [str(d) for d in range(10)])
    b.set_yticks(range(10), [f"'{clf.template.format(d)}'" for d in range(10)], fontsize=7)
    b.set_xlabel("the held-out images of digit", fontsize=8)
    b.set_title("mean cosine, caption to images", fontsize=9)
    fig.colorbar(im, ax=b, fraction=0.046)
    save_figure(fig, path)
    diagonal = float(cos.diagonal().mean())
    off = float((cos.sum() - cos.diagonal().sum()) / 90)
    return {"source": source, "zero_shot_accuracy": round(accuracy, 1), "diagonal_cosine": round(diagonal, 3),
            "off_diagonal_cosine": round(off, 3)}


def vlm_attention(path: Path, run: Path | None = None) -> dict:
    """Where the text of a trained vision-language run looks in a held-out digit (what ``attnlab
    viz RUN "what digit is this?" --image FILE`` draws), with the accuracy on the 200 held-out digits
    and, over them, the share of attention on the image at the position that predicts the answer
    (the question's last word), per layer, against the image tokens' share of that prompt."""
    from attnlab.tasks import get_task, open_run
    from attnlab.viz import TokenLabels
    from attnlab.viz.image_text import draw_image_text_attention, image_text_attention
    run, source = _run("vlm", VLM_COMMAND, run)
    vlm = get_task("vlm").load(open_run(run))
    images, labels = _held_out()
    answers = vlm.answer(images, QUESTION)
    accuracy = 100.0 * sum(a == str(int(y)) for a, y in zip(answers, labels)) / len(answers)
    prompt = vlm.prompt_ids(QUESTION)
    shares = []
    for image in images:
        a = image_text_attention(vlm.model, prompt, vlm.processor([image]))
        shares.append(a.image_share[:, :, -1].mean(1))                 # (L,): the last prompt position
    share = torch.stack(shares).mean(0)
    i = int((labels == SHOWN_DIGIT).nonzero()[0])
    shown = vlm.processor.resized(images[i])
    reply = answers[i]
    ids = prompt + vlm.tokenizer.encode(reply)
    a = image_text_attention(vlm.model, ids, vlm.processor.finish(shown)[None])
    draw_image_text_attention(a, shown.permute(1, 2, 0).numpy(), TokenLabels(vlm.tokenizer, ids)(), path)
    return {"source": source, "accuracy": round(accuracy, 1), "digit": SHOWN_DIGIT, "answer": reply,
            "image_tokens": len(prompt) - len(QUESTION.split()), "prompt_tokens": len(prompt),
            "answer_position_image_share": [round(float(s), 3) for s in share]}


@torch.no_grad()
def speech_attention(path: Path, run: Path | None = None) -> dict:
    """Frames as tokens: the log-mel frames of the first held-out test sentence (spoken in the voice
    the run never heard) and, below them on the same time axis, where each word the trained speech
    run writes looks among the encoder's positions (cross-attention, mean of layers and heads)."""
    from attnlab.data.speech import spoken_numbers
    from attnlab.tasks import get_task, open_run
    from attnlab.tasks.speech import BOS_ID, transcribe, word_error_rate
    from attnlab.viz.record import record_attention
    run, source = _run("speech", SPEECH_COMMAND, run)
    import yaml
    info = open_run(run)
    s = yaml.safe_load((Path(run) / "config.yaml").read_text())["settings"]     # the corpus the run trained on
    heard = get_task("speech").load(info, "cpu")
    test = spoken_numbers(s.get("audio_cache"), n_train=s["sentences"], n_valid=s["eval_size"],
                          n_test=s["test_size"], seed=s["seed"], max_words=s["max_words"]).test
    features = heard.features([u.path for u in test])                        # (N, F, M)
    hypotheses = transcribe(heard.model, heard.tokenizer, features)
    wer = word_error_rate(hypotheses, [u.text for u in test])
    x, said, reply = features[:1], test[0].text, hypotheses[0]
    ids = heard.tokenizer.encode(reply)
    model = heard.model.eval()
    memory = model.encode(x)
    with record_attention(model) as record:
        model.decode(torch.tensor([[BOS_ID] + ids]), memory)
    cross = record.stack("cross")[:, 0].mean(dim=(0, 1))                      # (T + 1, S)
    extractor = heard.extractor
    seconds_per_frame = extractor.hop_length / extractor.sampling_rate
    from attnlab.processors import read_wav
    wave, _ = read_wav(test[0].path)
    shown = min(x.size(-1), int(len(wave) / extractor.hop_length) + 10)      # the sentence and 0.2 s after it
    frames = x[0][:, :shown]
    stride = x.size(-1) / memory.size(1)                                      # frames per encoder position
    cut = max(1, int(round(frames.size(1) / stride)))
    words = heard.tokenizer.decode(ids).split() + ["</s>"]
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 5.2), sharex=True, gridspec_kw={"height_ratios": [1, 1.3]})
    end = frames.size(1) * seconds_per_frame
    a.imshow(frames.numpy(), origin="lower", aspect="auto", cmap="magma", extent=(0, end, 0, frames.size(0)))
    a.set_ylabel("mel bin", fontsize=8)
    a.set_title(f"log-mel frames of '{said}' (a voice the run never heard)", fontsize=9)
    b.imshow(cross[:len(words), :cut].numpy(), aspect="auto", cmap="viridis", extent=(0, end, len(words) - 0.5, -0.5))
    b.set_yticks(range(len(words)), words, fontsize=8)
    b.set_xlabel("seconds", fontsize=8)
    b.set_title(f"heard: '{reply}' - each word's cross-attention over the audio", fontsize=9)
    save_figure(fig, path)
    peaks = cross[:len(words) - 1, :cut].argmax(-1)
    forward = float((peaks[1:] >= peaks[:-1]).float().mean()) if peaks.numel() > 1 else 1.0
    return {"source": source, "sentence": said, "heard": reply, "test_wer": round(wer, 1),
            "test_sentences": len(test), "frames_per_position": round(float(stride), 2),
            "peaks_moving_forward": round(forward, 2)}


__all__ = ["clip_space", "vlm_attention", "speech_attention", "CLIP_COMMAND", "VLM_COMMAND", "SPEECH_COMMAND", "np"]
