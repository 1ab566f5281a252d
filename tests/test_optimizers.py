"""The optimizer choice: AdamW (the default) or Adafactor (T5's), through TrainConfig, the Trainer
(exact resume, a changed optimizer refused) and `attnlab train` (T5's family default, the flag)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from torch import nn

from attnlab.train import TrainConfig, Trainer, build_optimizer

sys.path.insert(0, str(Path(__file__).parent))
from _train_worker import ReverseTask  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _cfg(out: Path, **kw) -> TrainConfig:
    base = dict(out_dir=out, steps=4, lr=0.05, schedule="constant", progress=False, device="cpu", precision="fp32",
                log_every=1, optimizer="adafactor")
    return TrainConfig(**{**base, **kw})


def test_adafactor_steps_follow_each_weights_scale(tmp_path):
    """The reason T5 trains with it: a weight of scale 1 (T5's embedding) and one of scale 0.01 with
    the same gradient move by amounts in the ratio of their scales; AdamW moves both alike."""
    torch.manual_seed(0)
    big, small = nn.Parameter(torch.randn(64, 32)), nn.Parameter(torch.randn(64, 32) * 0.01)
    model = nn.ParameterList([big, small])
    for name, ratio in (("adafactor", (90, 110)), ("adamw", (0.9, 1.1))):
        opt = build_optimizer(model, _cfg(tmp_path, optimizer=name, weight_decay=0.0))
        assert isinstance(opt, torch.optim.Adafactor if name == "adafactor" else torch.optim.AdamW)
        before = [p.detach().clone() for p in (big, small)]
        g = torch.randn(64, 32)
        big.grad, small.grad = g.clone(), g.clone()
        opt.step()
        moved = [float((p.detach() - b).norm()) for p, b in zip((big, small), before)]
        assert ratio[0] < moved[0] / moved[1] < ratio[1], (name, moved)


def test_config_refuses_an_unknown_optimizer(tmp_path):
    with pytest.raises(ValueError, match="optimizer must be one of adamw, adafactor"):
        _cfg(tmp_path, optimizer="sgd")


def test_adafactor_resumes_bit_identically_and_a_changed_optimizer_is_refused(tmp_path):
    torch.set_num_threads(1)
    Trainer(ReverseTask(16, 4), _cfg(tmp_path / "full", steps=6, save_every=3)).fit()
    Trainer(ReverseTask(16, 4), _cfg(tmp_path / "part", steps=3, save_every=3)).fit()
    Trainer(ReverseTask(16, 4), _cfg(tmp_path / "part", steps=6, save_every=3), resume=True).fit()
    for name in ("model.safetensors", "optimizer.safetensors"):
        a, b = (load_file(tmp_path / d / "step-0000006" / name) for d in ("full", "part"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    with pytest.raises(ValueError, match="adafactor optimizer, this run asks for adamw"):
        Trainer(ReverseTask(16, 4), _cfg(tmp_path / "part", steps=9, optimizer="adamw"), resume=True)


def _train(*args: str) -> subprocess.CompletedProcess:
    import os
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"))
    return subprocess.run([sys.executable, "-m", "attnlab.cli", "train", "translate", *args, "--no-progress",
                           "--d-model", "16", "--heads", "2", "--layers", "1", "--d-ff", "32", "--eval-size", "4",
                           "--corpus-size", "200"], capture_output=True, text=True, env=env, timeout=300)


def test_t5_trains_with_adafactor_by_default_and_the_flag_wins(tmp_path):
    r = _train("--model", "t5", "--steps", "2", "--out", str(tmp_path / "t5"))
    assert r.returncode == 0, r.stderr
    assert "training: Adafactor (lr relative to each weight's RMS), cosine schedule, lr 0.05," in r.stderr
    # another optimizer: the task's own defaults for it, not T5's Adafactor lr and decay
    r = _train("--model", "t5", "--steps", "2", "--optimizer", "adamw", "--out", str(tmp_path / "a"))
    assert r.returncode == 0 and "training: cosine schedule, lr 0.002" in r.stderr, r.stderr
    assert yaml.safe_load((tmp_path / "a" / "config.yaml").read_text())["settings"]["weight_decay"] == 0.01
    r = _train("--steps", "2", "--out", str(tmp_path / "tr"))            # the chapter's Transformer: AdamW
    assert r.returncode == 0 and "Adafactor" not in r.stderr and "training: cosine" in r.stderr, r.stderr
    # asked for on a task sized for AdamW: said, and the task's AdamW lr 2e-3 made relative (x 15)
    r = _train("--steps", "1", "--optimizer", "adafactor", "--out", str(tmp_path / "tr-ada"))
    assert r.returncode == 0 and "training: Adafactor (lr relative to each weight's RMS), cosine schedule, lr 0.03," \
        in r.stderr, r.stderr
    saved = {run: yaml.safe_load((tmp_path / run / "config.yaml").read_text())["settings"] for run in ("t5", "tr")}
    assert (saved["t5"]["optimizer"], saved["t5"]["weight_decay"]) == ("adafactor", 0.0)      # as T5 was trained
    assert (saved["tr"]["optimizer"], saved["tr"]["weight_decay"]) == ("adamw", 0.01)
    # the resolved choice is saved with the run: resuming keeps it, another one is refused by name
    r = _train("--model", "t5", "--steps", "3", "--out", str(tmp_path / "t5"), "--resume")
    assert r.returncode == 0 and "Adafactor" in r.stderr, r.stderr
    r = _train("--model", "t5", "--steps", "4", "--out", str(tmp_path / "t5"), "--resume", "--optimizer", "adamw")
    assert r.returncode == 2 and "--optimizer adamw differs from the run's adafactor" in r.stderr, r.stderr


def test_adafactor_on_a_task_sized_for_adamw_takes_a_relative_lr():
    from attnlab.tasks.base import ADAFACTOR_LR_SCALE, training_schedule
    d = dict(lr=2e-3, steps=10)

    def lr(**given):
        from attnlab.tasks import get_task
        s = get_task("translate").settings(steps=10, **given)
        return training_schedule(s, d, lambda n, b: 1, lambda n, b: 5, 0)["lr"]
    assert lr() == 2e-3 and lr(optimizer="adamw") == 2e-3                   # AdamW: the task's lr
    assert lr(optimizer="adafactor") == pytest.approx(2e-3 * ADAFACTOR_LR_SCALE)
    assert lr(optimizer="adafactor", lr=1e-2) == 1e-2                       # --lr wins
    d = dict(lr=5e-2, steps=10, optimizer="adafactor")                      # a family's own Adafactor recipe
    assert lr() == 5e-2 and lr(optimizer="adafactor") == 5e-2


# ----------------------------------------------------------------------------- what must not decay
def _todays_rule(model: nn.Module) -> set[str]:
    """The names the rule before module declarations exempted, restated: parameters of torch's
    nn.Embedding and of the norm layers, and every parameter of fewer than 2 dimensions."""
    from attnlab.nn.norm import DyT, LayerNorm, RMSNorm
    kinds = (nn.Embedding, nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase, LayerNorm, RMSNorm, DyT)
    exempt = {id(p) for m in model.modules() if isinstance(m, kinds) for p in m.parameters(recurse=False)}
    return {n for n, p in model.named_parameters() if id(p) in exempt or p.ndim < 2}


def test_every_registered_model_keeps_its_groups_and_its_position_tables_stop_decaying():
    """The declarations reproduce the groups of every registered model, and add exactly the learned
    position tables (GPT-2's, the BERT family's, DeBERTa's relative one, the image families' patch
    grid, Swin's relative position bias), attnlab's ViT, DeiT and CLIP class and distillation tokens and MAE's class and mask tokens, which the rule by module type
    decayed though they are embeddings, and the (d, n) transitions A_log of the state-space
    layers, matrices that decay would pull towards A = -1."""
    import contract
    from attnlab.models.clip import CLIPVisionTower
    from attnlab.models.deberta import RelativeEmbeddings
    from attnlab.models.vit import ViTEncoder
    from attnlab.models.registry import architectures
    from attnlab.nn.patch import PatchPositionEmbedding
    from attnlab.nn.position import LearnedPositionalEmbedding
    from attnlab.nn.window import WindowPositionBias
    from attnlab.train import split_decay
    tables_seen = 0
    for arch in architectures():
        model = contract.tiny(arch)
        decay, no_decay = (set(n for n, _ in group) for group in split_decay(model))
        tables = {f"{name}.weight" for name, m in model.named_modules()
                  if isinstance(m, (LearnedPositionalEmbedding, RelativeEmbeddings, PatchPositionEmbedding))}
        tables |= {f"{name}.table" for name, m in model.named_modules() if isinstance(m, WindowPositionBias)}
        # attnlab's image encoders' class and distillation tokens, the model's own or a tower's (CLIP, LLaVA)
        for prefix, m in model.named_modules():
            if isinstance(m, (ViTEncoder, CLIPVisionTower)):
                tables |= {f"{prefix}.{n}".lstrip(".") for n, _ in m.named_parameters(recurse=False)
                           if n in ("cls_token", "distillation_token")}
        # the masked auto-encoder's learned tokens, inputs as the class token is
        tables |= {n for n, _ in model.named_parameters() if arch.model_type == "vit_mae"
                   and n.rsplit(".", 1)[-1] in ("cls_token", "mask_token")}
        transitions = {n for n, _ in model.named_parameters() if n.endswith(".A_log")}   # a state space's A
        assert no_decay == _todays_rule(model) | tables | transitions, arch
        assert decay | no_decay == {n for n, _ in model.named_parameters()} and not decay & no_decay, arch
        tables_seen += bool(tables)
    assert tables_seen >= 10                 # GPT-2, BERT, ELECTRA, ALBERT, DeBERTa architectures


def test_gpt2_groups_equal_nanogpts_with_embeddings_exempt():
    """An independent reference: the benchmark's nanoGPT groups over transformers' GPT-2 with the
    same weights, embeddings exempt (its wte and wpe are nn.Embedding), name for name."""
    import transformers
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from shakespeare_reference import nanogpt_param_groups
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    import contract
    from attnlab.models.convert import convert
    from attnlab.models.registry import family
    from attnlab.train import split_decay
    arch = family("gpt2").default
    ours = contract.tiny(arch)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**arch.family.config_to_hf(ours.config)))
    hf_name = {id(p): n for n, p in hf.named_parameters()}
    want = [{hf_name[id(p)] for p in g["params"]} for g in nanogpt_param_groups(hf, 0.1, decay_embeddings=False)]
    got = [set(convert(dict(group), arch.weight_map, ours.config, to_hf=True)[0]) for group in split_decay(ours)]
    assert got == want and "transformer.wpe.weight" in want[1]


class _Scan(nn.Module):
    """A state-space layer's shape: A_log (2-D) and D must not decay; its projection must."""

    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(4, 8)
        self.A_log = nn.Parameter(torch.zeros(8, 3))
        self.D = nn.Parameter(torch.ones(8))

    def no_weight_decay(self):
        return ("A_log", "D")


def test_a_module_declares_what_must_not_decay_and_a_wrong_name_is_refused():
    from attnlab.train import split_decay
    model = nn.Sequential(_Scan(), nn.Linear(8, 8))
    decay, no_decay = (set(n for n, _ in group) for group in split_decay(model))
    assert decay == {"0.in_proj.weight", "1.weight"}
    assert no_decay == {"0.A_log", "0.D", "0.in_proj.bias", "1.bias"}

    class Wrong(_Scan):
        def no_weight_decay(self):
            return ("A",)
    with pytest.raises(ValueError, match=r"Wrong \(0\): no_weight_decay\(\) names 'A', which is not one of its "
                                         r"parameters"):
        split_decay(nn.Sequential(Wrong()))


def _alpha_model(scale: float) -> nn.Module:
    from attnlab.nn.norm import DyT
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), DyT(4, alpha_init=0.5))
    model[1].alpha_lr_scale = scale
    return model


def test_a_module_asks_for_a_multiple_of_the_lr_and_adam_moves_that_parameter_that_much_further(tmp_path):
    """DyT's alpha at 10 times the rate: its own group, lr 10x, and the first AdamW step (which
    moves every parameter by about its group's lr, whatever its gradient) moves it 10x as far."""
    cfg = TrainConfig(out_dir=tmp_path, steps=1, lr=1e-3, weight_decay=0.0, optimizer="adamw", device="cpu")
    plain = build_optimizer(_alpha_model(1.0), cfg)
    assert [len(g["params"]) for g in plain.param_groups] == [1, 4]     # as before: no group of its own
    assert all("lr_scale" not in g for g in plain.param_groups)
    model = _alpha_model(10.0)
    opt = build_optimizer(model, cfg)
    groups = opt.param_groups
    assert [len(g["params"]) for g in groups] == [1, 3, 1]
    assert groups[2]["params"][0] is model[1].alpha and groups[2]["lr_scale"] == 10.0
    assert (groups[0]["lr"], groups[1]["lr"], groups[2]["lr"]) == (1e-3, 1e-3, pytest.approx(1e-2))
    assert groups[2]["weight_decay"] == 0.0                             # still exempt from decay
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(torch.randn(8, 4)).pow(2).sum().backward()
    opt.step()
    moved = {n: (p.detach() - before[n]).abs() for n, p in model.named_parameters()}
    assert moved["1.alpha"].item() == pytest.approx(1e-2, rel=1e-4)
    for name in ("0.weight", "0.bias", "1.weight"):
        assert torch.allclose(moved[name], torch.full_like(moved[name], 1e-3), rtol=1e-3), name


def test_the_schedule_keeps_the_multiple(tmp_path):
    from torch.optim.lr_scheduler import LambdaLR
    cfg = TrainConfig(out_dir=tmp_path, steps=3, lr=2e-3, optimizer="adamw", device="cpu")
    model = _alpha_model(10.0)
    opt = build_optimizer(model, cfg)
    schedule = LambdaLR(opt, lambda k: (k + 1) / 4)
    for _ in range(3):
        model(torch.randn(8, 4)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        schedule.step()
        assert opt.param_groups[2]["lr"] == pytest.approx(10 * opt.param_groups[0]["lr"])


def test_a_wrong_lr_multiple_is_refused_naming_the_module():
    from attnlab.train.optim import lr_scales

    class Wrong(_Scan):
        def __init__(self, scales):
            super().__init__()
            self.scales = scales

        def lr_scale(self):
            return self.scales
    with pytest.raises(ValueError, match=r"Wrong \(0\): lr_scale\(\) names 'A', which is not one of its parameters"):
        lr_scales(nn.Sequential(Wrong({"A": 2.0})))
    for bad in (0, -1.0, float("nan"), True, "10"):
        with pytest.raises(ValueError, match=r"Wrong \(0\): lr_scale\(\) gives 'D' the multiple .*; it must be a "
                                             r"positive number"):
            lr_scales(nn.Sequential(Wrong({"D": bad})))
    model = nn.Sequential(Wrong({"D": 3}))
    assert lr_scales(model) == {id(model[0].D): 3.0}
