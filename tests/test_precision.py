"""Precision by default: the fast inference path from from_pretrained, --precision auto (bf16
autocast where the CPU does bf16 natively), bf16 weight copies for inference (--dtype).

- A model loaded by from_pretrained has InferenceLinear layers; trained after inference calls
  (bf16 weight copies included), its gradients and weights equal a plain nn.Linear model's
  bit for bit: the bf16 copies only run where no gradient is needed, and training calls of up
  to 64 rows (these) stay on F.linear (above that, an fp32 training product may take oneDNN,
  equal to the order of its sums: tests/test_linear_training.py).
- --precision auto follows the CPU's flags (patched here), says why, and records the choice;
  a bf16 run killed mid-run and resumed equals an uninterrupted bf16 run bit for bit.
- bf16 weight copies: greedy tokens equal fp32's on a small trained model, logits within bf16's
  rounding (2 % of their scale); the copy follows weight updates; --dtype reaches the model.
"""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

import attnlab
import attnlab.nn.linear as linear_mod
import attnlab.nn.precision as precision_mod
from attnlab.models.gpt import GPT, GPTConfig
from attnlab.nn import InferenceLinear, set_inference_dtype
from attnlab.nn.linear import inference_dtype, prepare_for_inference
from attnlab.train import TrainConfig, Trainer
import attnlab.train.trainer as trainer_mod
from attnlab.train.trainer import _resolve_precision

sys.path.insert(0, str(Path(__file__).parent))
from _train_worker import ReverseTask  # noqa: E402


def _flags(monkeypatch, flags: tuple[str, ...]) -> None:
    monkeypatch.setattr(precision_mod, "cpu_bf16_flags", lambda: flags)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def _tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=48, n_positions=32, d_model=64, num_heads=4, num_layers=2, dropout=0.0))


def _trained_gpt(steps: int = 150) -> GPT:
    """A tiny GPT trained on a repeating pattern: clear greedy choices, like a real trained model."""
    model = _tiny_gpt()
    pattern = torch.tensor([(7 * i) % 48 for i in range(48)])
    data = pattern.repeat(4)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - 33, (8,), generator=g)
        w = torch.stack([data[s: s + 33] for s in starts.tolist()])
        loss = F.cross_entropy(model(w[:, :-1]).flatten(0, 1), w[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model.eval()


# ----------------------------------------------------------------------------- the fast path by default
def test_from_pretrained_returns_inference_linear_with_the_same_keys_and_ties(tmp_path):
    model = _tiny_gpt()
    model.save_pretrained(tmp_path)
    loaded = attnlab.from_pretrained(tmp_path)
    linears = [m for m in loaded.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is InferenceLinear for m in linears)
    assert loaded.lm_head.weight is loaded.token_embedding.weight
    assert loaded.state_dict().keys() == model.state_dict().keys()
    ids = torch.randint(0, 48, (2, 9))
    with torch.no_grad():
        assert rel(loaded(ids), model.eval()(ids)) < 1e-5
    loaded.save_pretrained(tmp_path / "again")                # save_pretrained still works, same tensors
    again = attnlab.from_pretrained(tmp_path / "again")
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), loaded.state_dict().values()))


def test_training_after_inference_is_bit_identical_to_plain_linear(tmp_path):
    """from_pretrained's model, used for inference (fp32 oneDNN and bf16 copies, every layer), then
    switched to train(): 3 AdamW steps give the same gradients and weights as plain nn.Linear."""
    base = _tiny_gpt()
    base.save_pretrained(tmp_path)
    fast = attnlab.from_pretrained(tmp_path)
    plain = _tiny_gpt()
    plain.load_state_dict(base.state_dict())
    set_inference_dtype(fast, torch.bfloat16, min_elements=0)
    prompt = torch.randint(0, 48, (2, 4))
    fast.generate(prompt, 6)                                   # fills the bf16 caches
    assert inference_dtype(fast) is torch.bfloat16
    fast.train()
    plain.train()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (fast, plain)]
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        w = torch.randint(0, 48, (4, 17), generator=g)
        grads = []
        for m, opt in zip((fast, plain), opts):
            F.cross_entropy(m(w[:, :-1]).flatten(0, 1), w[:, 1:].flatten()).backward()
            grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert grads[0].keys() == grads[1].keys()
        assert all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])
    assert all(torch.equal(a, b) for a, b in zip(fast.state_dict().values(), plain.state_dict().values()))
    # back to inference: the bf16 copies follow the trained weights (not the stale ones)
    fast.eval()
    plain.eval()
    ids = torch.randint(0, 48, (2, 8))
    with torch.no_grad():
        fresh = set_inference_dtype(prepare_for_inference(copy.deepcopy(plain), "fp32")[0], torch.bfloat16, 0)
        assert torch.equal(fast(ids), fresh(ids))


def test_bf16_copy_follows_in_place_updates_and_is_not_saved():
    torch.manual_seed(0)
    lin = set_inference_dtype(InferenceLinear.from_linear(nn.Linear(64, 32)), torch.bfloat16, min_elements=0)
    x = torch.randn(5, 64)
    with torch.no_grad():
        first = lin(x)
        assert rel(first, F.linear(x, lin.weight, lin.bias)) < 2e-2
        lin.weight.mul_(2.0)                                   # an in-place update (what an optimizer does)
        second = lin(x)
        assert rel(second, F.linear(x, lin.weight, lin.bias)) < 2e-2 and not torch.allclose(first, second)
        assert lin(torch.randn(0, 64)).shape == (0, 32)
    assert set(lin.state_dict()) == {"weight", "bias"}
    assert "_low_precision_cache" not in copy.deepcopy(lin).__dict__
    y = torch.randn(3, 64, requires_grad=True)                 # a gradient is needed: exactly nn.Linear
    assert torch.equal(lin(y), F.linear(y, lin.weight, lin.bias))


def test_a_bf16_model_runs_its_large_layers_from_packed_weights(tmp_path, monkeypatch):
    monkeypatch.setattr(linear_mod, "MIN_WEIGHT_ELEMENTS", 0)
    model = _tiny_gpt()
    model.save_pretrained(tmp_path)
    bf = attnlab.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert bf.lm_head.weight.dtype is torch.bfloat16
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    layer = bf.layers[0].ff.linear1
    with torch.no_grad():
        out = layer(x)
        assert out.dtype is torch.bfloat16
        assert rel(out, F.linear(x, layer.weight, layer.bias)) < 2e-2
        tokens = bf.generate(torch.randint(0, 48, (2, 4)), 5)
    assert tokens.shape == (2, 9)


# ----------------------------------------------------------------------------- bf16 inference
def test_bf16_greedy_tokens_equal_fp32_on_a_trained_model():
    model = _trained_gpt()
    fp32 = prepare_for_inference(copy.deepcopy(model), "fp32")[0]
    bf16 = set_inference_dtype(copy.deepcopy(fp32), torch.bfloat16, min_elements=0)
    assert all(m.compute_dtype is torch.bfloat16 for m in bf16.modules() if isinstance(m, InferenceLinear))
    prompts = torch.tensor([[(7 * (i + s)) % 48 for i in range(5)] for s in (0, 3, 11, 20)])
    with torch.no_grad():
        a, b = fp32(prompts), bf16(prompts)
    assert rel(b, a) < 2e-2                                    # bf16 rounds to 8 bits: ~0.4 % per product
    assert torch.equal(fp32.generate(prompts, 20), bf16.generate(prompts, 20))


def test_resolve_inference_dtype_follows_the_cpu(monkeypatch):
    _flags(monkeypatch, ())
    assert precision_mod.resolve_inference_dtype("auto")[0] is None
    _flags(monkeypatch, ("amx_bf16",))
    dtype, why = precision_mod.resolve_inference_dtype("auto")
    assert dtype is torch.bfloat16 and "amx_bf16" in why
    assert precision_mod.resolve_inference_dtype("fp32")[0] is None
    assert precision_mod.resolve_inference_dtype("bf16")[0] is torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        precision_mod.resolve_inference_dtype("fp8")


def test_dtype_option_reaches_the_model(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    from _hf_fixtures import tiny_gpt2_dir
    from attnlab.cli import main
    from attnlab.tasks.lm import load_lm
    tiny_gpt2_dir(tmp_path, 32)
    monkeypatch.setattr(linear_mod, "MIN_WEIGHT_ELEMENTS", 0)  # the tiny model's layers count as large
    _flags(monkeypatch, ("avx512_bf16",))
    assert inference_dtype(load_lm(tmp_path, "cpu").model) is torch.bfloat16          # auto, native bf16
    assert inference_dtype(load_lm(tmp_path, "cpu", "fp32").model) is None
    _flags(monkeypatch, ())
    assert inference_dtype(load_lm(tmp_path, "cpu").model) is None                    # auto, no native bf16
    assert inference_dtype(load_lm(tmp_path, "cpu", "bf16").model) is torch.bfloat16
    outs = {}
    for dtype in ("fp32", "bf16"):
        assert main(["generate", str(tmp_path), "--prompt", "the quick", "--max-new-tokens", "6",
                     "--temperature", "0", "--dtype", dtype]) == 0
        outs[dtype] = capsys.readouterr()
    assert "bfloat16 weight copies" in outs["bf16"].err and "bfloat16" not in outs["fp32"].err
    assert outs["bf16"].out == outs["fp32"].out                # the fixture's clear greedy choices


# ----------------------------------------------------------------------------- --precision auto
def test_auto_precision_follows_the_cpu_flags_and_is_recorded(tmp_path, monkeypatch, caplog):
    cpu = torch.device("cpu")
    _flags(monkeypatch, ())
    assert _resolve_precision("auto", cpu)[0] == "fp32"
    _flags(monkeypatch, ("avx512_bf16", "amx_bf16"))
    precision, why = _resolve_precision("auto", cpu)
    assert precision == "bf16" and "avx512_bf16" in why
    assert _resolve_precision("fp32", cpu) == ("fp32", "asked for")
    assert _resolve_precision("bf16", cpu) == ("bf16", "asked for")           # native: no warning
    _flags(monkeypatch, ())
    precision, why = _resolve_precision("bf16", cpu)                          # emulated: said, still honoured
    assert precision == "bf16" and "emulated" in why and "slower than fp32" in why
    assert "emulated" in precision_mod.resolve_inference_dtype("bf16")[1]
    _flags(monkeypatch, ("avx512_bf16", "amx_bf16"))
    assert precision_mod.resolve_inference_dtype("bf16")[1] == "asked for"
    # a model too small for bf16 matmuls to pay trains in fp32 under auto, and says why
    tiny = ReverseTask(n_examples=16, micro=8, dropout=0.0).model
    precision, why = _resolve_precision("auto", cpu, tiny)
    assert precision == "fp32" and "too few for bf16" in why
    monkeypatch.setattr(trainer_mod, "AUTO_BF16_MIN_PARAMS", 0)
    assert _resolve_precision("auto", cpu, tiny)[0] == "bf16"
    cfg = TrainConfig(out_dir=tmp_path / "run", steps=2, save_every=2, progress=False, device="cpu", log_every=1)
    assert cfg.precision == "auto"
    with caplog.at_level("INFO", logger="attnlab.train"):
        trainer = Trainer(ReverseTask(n_examples=16, micro=8, dropout=0.0), cfg)
    assert trainer.precision == "bf16" and "precision: bf16" in caplog.text
    summary = trainer.fit()
    assert summary["precision"] == "bf16"
    state = json.loads((tmp_path / "run" / "step-0000002" / "trainer_state.json").read_text())
    assert state["precision"] == "bf16"
    weights = load_file(tmp_path / "run" / "step-0000002" / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in weights.values())            # fp32 master weights on disk
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert all(v.dtype == torch.float32 for s in trainer.optimizer.state.values() for v in s.values()
               if torch.is_tensor(v) and v.is_floating_point())


class _Crash(RuntimeError):
    pass


class _CrashingTask(ReverseTask):
    def __init__(self, crash_at: int | None):
        super().__init__(n_examples=36, micro=4, dropout=0.1)
        self.crash_at = crash_at

    def loss(self, model, batch):
        if self.crash_at is not None and self.loss_calls + 1 == self.crash_at:
            raise _Crash("killed mid-step")
        return super().loss(model, batch)


def test_bf16_run_killed_and_resumed_equals_an_uninterrupted_bf16_run(tmp_path):
    """accum 2, 9 micro-batches an epoch: the crash hits inside step 6, after the checkpoint at step 4."""
    def cfg(out):
        return TrainConfig(out_dir=out, steps=8, lr=1e-3, schedule="cosine", warmup_steps=2, accum_steps=2,
                           save_every=2, eval_every=4, progress=False, device="cpu", precision="bf16", log_every=1)
    ref = Trainer(_CrashingTask(None), cfg(tmp_path / "ref"))
    ref.fit()
    victim = Trainer(_CrashingTask(11), cfg(tmp_path / "run"))
    with pytest.raises(_Crash):
        victim.fit()
    assert (tmp_path / "run" / "latest").read_text().strip() == "step-0000004"
    resumed = Trainer(_CrashingTask(None), cfg(tmp_path / "run"), resume=True)
    assert resumed.step == 4
    resumed.fit()
    for name in ("model.safetensors", "optimizer.safetensors"):
        a = load_file(tmp_path / "ref" / "step-0000008" / name)
        b = load_file(tmp_path / "run" / "step-0000008" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    curve = lambda d: [(r["step"], r.get("loss"), r.get("val_loss"))  # noqa: E731
                       for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())]
    assert curve(tmp_path / "ref") == curve(tmp_path / "run")
