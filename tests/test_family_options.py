"""A model family states its own training options, its defaults for a task's options and the
special ids it takes in its registration, and the tasks read them from the registry: the toy
family below, registered in this file alone, adds ``--toy-depth-scale`` to ``attnlab train lm``
with no edit to a task or command. The toy is a causal LM whose layers see one position each:

    ids -> embedding -> N x [x = x + depth_scale * FFN(RMSNorm(x))] -> RMSNorm -> head
"""
from dataclasses import dataclass

import pytest
import torch
import yaml
from torch import Tensor, nn

from attnlab.cli import main
from attnlab.models.causal_lm import GenerationMixin
from attnlab.models.pretrained import SavePretrained
from attnlab.models.registry import FamilyOption, family, register_family
from attnlab.nn import FeedForward, RMSNorm
from attnlab.nn.cache import RecurrentState
from attnlab.tasks import get_task, open_run
from attnlab.tokenizer import EOS_ID


@dataclass
class DepthConfig:
    vocab_size: int = 96
    d_model: int = 16
    num_layers: int = 1
    d_ff: int = 32
    max_seq_len: int = 64
    depth_scale: float = 1.0
    eos_token_id: int | None = None


class DepthLM(GenerationMixin, SavePretrained, nn.Module):
    """Each position on its own: its decoding state holds nothing but how far it has read."""

    def __init__(self, config: DepthConfig):
        super().__init__()
        self.config = c = config
        self.embedding = nn.Embedding(c.vocab_size, c.d_model)
        self.norms = nn.ModuleList(RMSNorm(c.d_model) for _ in range(c.num_layers))
        self.ffs = nn.ModuleList(FeedForward(c.d_model, c.d_ff, activation="gelu") for _ in range(c.num_layers))
        self.norm, self.head = RMSNorm(c.d_model), nn.Linear(c.d_model, c.vocab_size, bias=False)

    def new_cache(self) -> RecurrentState:
        return RecurrentState()

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, cache=None) -> Tensor:
        if cache is not None:
            for _ in range(input_ids.size(1)):
                cache.advance(1)
            attention_mask = None if attention_mask is None else attention_mask[:, -input_ids.size(1):]
        x = self.embedding(input_ids)
        if attention_mask is not None:                    # padding enters as zeros
            x = x * attention_mask.to(x.dtype)[..., None]
        for norm, ff in zip(self.norms, self.ffs):
            x = x + self.config.depth_scale * ff(norm(x))
        return self.head(self.norm(x))


def build_config(*, vocab_size, context, d_model, num_heads, num_layers, d_ff=None, dropout=0.0,
                 depth_scale: float = 1.0, eos_token_id: int | None = None) -> DepthConfig:
    return DepthConfig(vocab_size, d_model, num_layers, d_ff or 2 * d_model, context, depth_scale, eos_token_id)


TOY = register_family(
    "toy", DepthConfig, presets={"tiny": {}}, build_config=build_config,
    options=(FamilyOption("toy_depth_scale", float, "scale of each layer's residual branch", ("lm",),
                          keyword="depth_scale", check=lambda v: None if v > 0 else "must be positive"),),
    task_defaults={"lm": {"d_ff": 24}}, token_ids={"eos_token_id": "eos"},
    limits=lambda c: {"vocab_size": c.vocab_size, "context": c.max_seq_len})
TOY.register("DepthLM", DepthLM, kind="causal-lm")

SMALL = ["--d-model", "16", "--heads", "2", "--layers", "1", "--context", "16", "--batch-size", "4",
         "--lr", "1e-2", "--warmup", "1", "--eval-every", "0", "--eval-windows", "2", "--sample-tokens", "0",
         "--no-progress"]


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("attnlab train: error: "), err
    return lines[0]


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    return path


def test_the_family_option_is_shown_under_the_family_in_the_task_help_only(capsys):
    helps = {}
    for task in ("lm", "translate", "mlm", "classify"):
        with pytest.raises(SystemExit):
            main(["train", task, "--help"])
        helps[task] = capsys.readouterr().out
    lm = helps["lm"]
    group = lm[lm.index("\n--model toy:\n"):].strip()           # the group titled by the family
    assert "--toy-depth-scale" in group.split("\n\n")[0] and "scale of each layer's residual branch (default: 1.0)" \
        in " ".join(group.split())
    assert all("--toy-depth-scale" not in helps[t] for t in ("translate", "mlm", "classify"))
    assert "--experts" in lm[lm.index("\n--model mixtral:\n"):]
    assert "(--model toy: 24)" in " ".join(lm.split())            # the family's default for --d-ff


def test_the_family_option_builds_the_model_is_saved_and_kept_on_resume(tmp_path, text, capsys):
    out = tmp_path / "run"
    args = ["train", "lm", "--model", "toy", "--data", str(text), "--out", str(out), *SMALL]
    assert main([*args, "--steps", "2", "--toy-depth-scale", "2.5"]) == 0
    settings = yaml.safe_load((out / "config.yaml").read_text())["settings"]
    assert settings["toy_depth_scale"] == 2.5
    assert settings["d_ff"] == 24                                  # the family's default for lm's own option
    run = open_run(out)
    assert run.model_type == "toy" and run.config["depth_scale"] == 2.5 and run.config["d_ff"] == 24
    assert run.config["eos_token_id"] == EOS_ID                    # the tokenizer's id the family takes
    capsys.readouterr()
    assert main([*args, "--steps", "3", "--toy-depth-scale", "3", "--resume"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "--toy-depth-scale 3.0 differs from the run's 2.5" in line
    assert main([*args, "--steps", "3", "--resume"]) == 0          # the saved value, unchanged
    assert yaml.safe_load((out / "config.yaml").read_text())["settings"]["toy_depth_scale"] == 2.5


def test_the_family_default_is_written_when_the_option_is_not_given(tmp_path, text):
    out = tmp_path / "run"
    assert main(["train", "lm", "--model", "toy", "--data", str(text), "--out", str(out), "--steps", "1",
                 *SMALL]) == 0
    assert yaml.safe_load((out / "config.yaml").read_text())["settings"]["toy_depth_scale"] == 1.0


def test_a_family_option_with_another_family_is_one_line(tmp_path, text, capsys):
    for model in ("gpt2", "llama"):
        assert main(["train", "lm", "--model", model, "--toy-depth-scale", "2", "--data", str(text),
                     "--out", str(tmp_path / "r"), "--steps", "1"]) == 2
        assert f"--toy-depth-scale applies to --model toy, not --model {model}" in \
            _one_error_line(capsys.readouterr().err)
    assert main(["train", "lm", "--model", "toy", "--toy-depth-scale", "0", "--data", str(text),
                 "--out", str(tmp_path / "r")]) == 2
    assert "--toy-depth-scale: must be positive, got 0.0" in _one_error_line(capsys.readouterr().err)
    assert main(["train", "lm", "--model", "gpt2", "--experts", "2", "--data", str(text),
                 "--out", str(tmp_path / "r")]) == 2
    assert "--experts applies to --model mixtral, not --model gpt2" in _one_error_line(capsys.readouterr().err)


def test_the_built_in_families_state_what_the_tasks_used_to_name():
    mixtral = {o.name: o for o in family("mixtral").options_for("lm")}
    assert {n: (o.keyword, family("mixtral").option_default(o)) for n, o in mixtral.items()} == {
        "experts": ("num_experts", 4), "top_k": ("top_k", 2), "aux_coef": ("router_aux_loss_coef", 0.02)}
    assert family("albert").task_defaults == {"mlm": {"objective": "sop"}}
    assert get_task("mlm").family_defaults_of("objective") == {"albert": "sop"}
    assert family("t5").token_ids == {"pad_token_id": "pad", "eos_token_id": "eos", "decoder_start_token_id": "bos"}
    assert family("bert").special_tokens["mask_token"] == "[MASK]"


def test_register_family_refuses_what_its_builder_cannot_take():
    def builder(*, vocab_size, context, d_model, num_heads, num_layers, d_ff=None, dropout=0.0, depth=1):
        return DepthConfig()

    bad = [dict(options=(FamilyOption("depth_x", int, "h", ("lm",)),)),          # not a builder keyword
           dict(options=(FamilyOption("depth", int, "h", ()),)),                 # names no task
           dict(options=(FamilyOption("depth", int, "h", "lm"),)),               # a string, not a tuple of tasks
           dict(options=(FamilyOption("d_model", int, "h", ("lm",)),)),          # a size every family shares
           dict(token_ids={"depth": "cls"}),                                     # not a tokenizer role
           dict(token_ids={"pad_token_id": "pad"})]                              # not a builder keyword
    for i, extra in enumerate(bad):
        with pytest.raises(ValueError, match=r"register_family\('bad-toy-"):
            register_family(f"bad-toy-{i}", DepthConfig, build_config=builder, limits=dict, **extra)


def test_a_family_default_for_a_task_option_fills_only_what_is_not_given():
    mlm = get_task("mlm")
    for given, model, want in ((None, "albert", "sop"), ("nsp", "albert", "nsp"), (None, "bert", None)):
        s = mlm.settings(model=model, objective=given)
        mlm.apply_family_defaults(s)
        assert s["objective"] == want


def test_export_names_the_special_tokens_the_family_states(tmp_path):
    import json
    from attnlab.cli.export import _tokenizer_files
    from attnlab.tokenizer import train_wordpiece
    tok = train_wordpiece(["the cat sat", "on the mat", "a dog ran"], 40)
    for name, tokens in (("bert", family("bert").special_tokens), ("none", {})):
        (tmp_path / name).mkdir()
        assert _tokenizer_files(tok, tmp_path / name, 16, tokens) is None
        config = json.loads((tmp_path / name / "tokenizer_config.json").read_text())
        assert config["pad_token"] == "[PAD]"                     # by the tokenizer's own roles
        assert (config.get("mask_token"), config.get("cls_token")) == (
            ("[MASK]", "[CLS]") if name == "bert" else (None, None))


def test_a_layer_order_choice_for_a_family_without_one_is_refused_not_ignored(tmp_path, capsys):
    # T5 is Pre-Norm by construction; its builder has no norm_first, so the flag would do nothing
    for flag in ("--pre-norm", "--no-pre-norm"):
        assert main(["train", "translate", "--model", "t5", flag, "--out", str(tmp_path / "r"), "--steps", "1"]) == 2
        assert "--model t5 has a fixed layer order" in _one_error_line(capsys.readouterr().err)


def test_a_t5_translation_run_trains_and_resumes_without_the_layer_order_flag(tmp_path, capsys):
    common = ["--model", "t5", "--out", str(tmp_path / "r"), "--corpus-size", "200", "--d-model", "32",
              "--layers", "1", "--eval-size", "0"]
    assert main(["train", "translate", *common, "--steps", "2"]) == 0
    assert main(["train", "translate", "--out", str(tmp_path / "r"), "--resume", "--steps", "3"]) == 0
    assert yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())["settings"]["pre_norm"] is None
    assert main(["train", "translate", "--model", "transformer", "--no-pre-norm", "--out", str(tmp_path / "p"),
                 "--corpus-size", "200", "--d-model", "32", "--layers", "1", "--eval-size", "0", "--steps", "1"]) == 0
