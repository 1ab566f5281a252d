"""What every recurrent causal LM of attnlab (Mamba, Mamba-2, Mamba-3, RWKV-4, RWKV-7) must do
through the house's decoding loop and training surface, as plain functions that each family's
test module calls with its own model and sizes (tests/contract.py is the same idea over the whole
registry): feeding the sequence in pieces equals the full forward, the state does not grow,
cached decoding equals uncached, a left-padded batch gives each row what it gives alone,
speculative decoding equals greedy with real rejections, beam search runs through the state,
gradient checkpointing changes no gradient, and ``attnlab train lm --model NAME`` trains and
generates. Comparisons are relative to the values' scale (``_tolerance.FP32``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from attnlab.generate import GenerationStats, generate
from _tolerance import FP32, assert_close_scaled  # noqa: E402  (tests/ is on sys.path under pytest)

ROOT = Path(__file__).resolve().parents[1]


def ids(shape, seed: int = 1, vocab: int = 96) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def left_padded(width: int = 6) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """(three prompts of 6, 2 and 4 tokens, the batch of them left-padded to ``width`` with id 0,
    its attention mask)."""
    prompts = [ids((1, n), seed=10 + n)[0] for n in (6, 2, 4)]
    batch, mask = torch.zeros(3, width, dtype=torch.long), torch.zeros(3, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        batch[i, width - len(p):], mask[i, width - len(p):] = p, 1
    return prompts, batch, mask


def check_pieces_equal_the_full_forward(model, tokens: torch.Tensor, cuts: list[int]) -> None:
    """The logits of ``tokens`` fed through one decoding state in the pieces that ``cuts`` mark
    (prefills of several tokens), then one token at a time from the last cut, equal the full
    forward's; the state counts every token."""
    length = tokens.shape[1]
    with torch.no_grad():
        full = model(tokens)
        state = model.new_cache()
        starts = [0, *cuts]
        pieces = [model(tokens[:, a:b], cache=state) for a, b in zip(starts, cuts)]
        pieces += [model(tokens[:, t:t + 1], cache=state) for t in range(cuts[-1], length)]
    assert state.length == length
    assert_close_scaled(torch.cat(pieces, 1), full, FP32, f"logits fed in pieces at {cuts}, then one at a time")


def check_the_state_has_a_constant_size(model, numel: int, steps: int = 20) -> None:
    """After a prompt and every one of ``steps`` single tokens the state holds ``numel`` numbers
    (a batch of 2), the size the family's equations give: nothing grows with the context."""
    sizes = []
    with torch.no_grad():
        state = model.new_cache()
        model(ids((2, 3)), cache=state)
        for t in range(steps):
            model(ids((2, 1), seed=t), cache=state)
            sizes.append(sum(x.numel() for x in state.tensors))
    assert set(sizes) == {numel}, sizes


def check_cached_equals_uncached(model, new_tokens: int = 16) -> None:
    """Greedy decoding through the state runs the model once per new token and writes what
    re-reading the whole sequence each step writes."""
    prompt = ids((3, 5), seed=6)
    stats = GenerationStats()
    cached = generate(model, prompt, new_tokens, stats=stats)
    assert stats.target_passes == new_tokens
    assert torch.equal(cached, generate(model, prompt, new_tokens, use_cache=False))


def check_left_padding_changes_no_row(model, new_tokens: int = 12, alone=None) -> None:
    """A left-padded batch gives each row the logits and the greedy continuation it has alone,
    cached and uncached. ``alone(prompt)`` is the reference logits of one row (default: the model
    itself on the unpadded prompt; a family whose transformers twin ignores masks passes that)."""
    prompts, batch, mask = left_padded()
    width = batch.shape[1]
    alone = alone or (lambda p: model(p[None])[0])
    with torch.no_grad():
        padded = model(batch, attention_mask=mask)
        for i, p in enumerate(prompts):
            assert_close_scaled(padded[i, width - len(p):], alone(p), FP32, f"row {i} logits")
    for use_cache in (True, False):
        out = generate(model, batch, new_tokens, attention_mask=mask, use_cache=use_cache)
        for i, p in enumerate(prompts):
            row = generate(model, p[None], new_tokens)[0, len(p):]
            assert out[i, width:].tolist() == row.tolist(), f"row {i}, use_cache={use_cache}"


def check_speculative_decoding_equals_greedy(model, draft, new_tokens: int = 14, noise: float = 0.1) -> None:
    """Speculative decoding from ``draft`` (perturbed here by ``noise`` so that it disagrees
    sometimes) writes exactly greedy's tokens for a left-padded batch, with some drafts accepted
    and some rejected, for 1 and 3 drafted tokens; a draft that is the model itself changes nothing."""
    _, batch, mask = left_padded()
    plain = generate(model, batch, new_tokens, attention_mask=mask)
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        for p in draft.parameters():
            p.add_(noise * torch.randn(p.shape, generator=g))
    for k in (1, 3):
        stats = GenerationStats()
        got = generate(model, batch, new_tokens, attention_mask=mask, draft_model=draft, num_draft_tokens=k,
                       stats=stats)
        assert torch.equal(got, plain), f"k={k}"
        assert 0 < stats.accepted < stats.drafted, (k, stats)
    assert torch.equal(model.generate(batch, new_tokens, attention_mask=mask, draft_model=model), plain)


def check_beam_search(model, new_tokens: int = 6) -> None:
    """Beam search reorders the recurrent state with its beams: cached equals uncached, and one
    beam is greedy."""
    prompt = ids((2, 4), seed=8)
    beams = generate(model, prompt, new_tokens, num_beams=3)
    assert torch.equal(beams, generate(model, prompt, new_tokens, num_beams=3, use_cache=False))
    assert torch.equal(generate(model, prompt, new_tokens, num_beams=1), generate(model, prompt, new_tokens))


def check_gradient_checkpointing(model, length: int = 30) -> None:
    """Recomputing each layer in the backward (``gradient_checkpointing = True``) gives the
    gradients of storing its activations."""
    model.train()
    tokens = ids((2, length))

    def grads():
        model.zero_grad()
        model(tokens).square().mean().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])
    plain = grads()
    model.gradient_checkpointing = True
    assert_close_scaled(grads(), plain, FP32, "checkpointed gradients")


def check_train_lm_from_the_command_line(tmp_path, name: str, flags: list[str]) -> dict:
    """``attnlab train lm --model NAME FLAGS`` on a small text trains 12 steps with a falling
    loss and its run generates 40 characters; returns the best checkpoint's run.json, for the
    family's own checks of its configuration."""
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 60)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["train", "lm", "--model", name, "--data", tmp_path / "text.txt", "--out", tmp_path / "run",
            "--steps", "12", "--d-model", "16", "--layers", "1", *flags, "--context", "24", "--batch-size", "4",
            "--lr", "1e-2", "--warmup", "2", "--eval-every", "6", "--no-progress"]
    r = subprocess.run([sys.executable, "-m", "attnlab.cli", *map(str, args)], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r["loss"] for r in records if r["kind"] == "train"]
    assert train[-1] < train[0], train
    g = subprocess.run([sys.executable, "-m", "attnlab.cli", "generate", str(tmp_path / "run"), "--prompt", "the",
                        "--max-new-tokens", "40"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert g.returncode == 0, g.stderr
    assert len(g.stdout) >= 40
    return json.loads((tmp_path / "run" / "best" / "run.json").read_text())
