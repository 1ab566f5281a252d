"""Recipes (`attnlab train TASK --config NAME|FILE.yaml`): every named recipe is valid for its task,
flags override a recipe, the resolved settings are saved in the run and reused by --resume."""
import argparse

import pytest
import yaml

from attnlab.cli import build_parser, main
from attnlab.cli.train import resolve_settings
from attnlab.recipes import load_recipe, named_recipes
from attnlab.tasks import get_task, registered_tasks

TINY_TRANSLATE = ["--d-model", "16", "--heads", "2", "--layers", "1", "--d-ff", "32", "--max-tokens", "256",
                  "--eval-size", "4", "--no-progress"]


def _args(*argv) -> argparse.Namespace:
    return build_parser().parse_args(["train", *map(str, argv)])


@pytest.mark.parametrize("name", sorted(named_recipes()))
def test_every_named_recipe_is_valid_for_its_task(name):
    recipe = load_recipe(name)
    task = get_task(recipe.task)                       # a registered task
    assert recipe.description and recipe.settings
    task.validate(recipe.settings)                     # every key is one of its options, every value valid
    settings, _ = resolve_settings(task, _args(recipe.task, "--config", name, "--data", __file__))
    for key, value in recipe.settings.items():
        assert settings[key] == value


def test_the_issue_s_recipes_ship():
    assert {"numbers", "multi30k", "shakespeare-char"} <= set(named_recipes())
    sh = load_recipe("shakespeare-char").settings
    assert (sh["layers"], sh["heads"], sh["d_model"], sh["context"], sh["dropout"], sh["batch_size"]) == \
        (6, 6, 384, 256, 0.2, 64)                      # nanoGPT's train_shakespeare_char
    assert (sh["lr"], sh["beta2"], sh["weight_decay"], sh["warmup"], sh["steps"]) == (1e-3, 0.99, 0.1, 100, 5000)
    assert set(registered_tasks()) >= {"translate", "lm"}


def test_flags_override_the_recipe():
    settings, out = resolve_settings(get_task("lm"), _args("lm", "--config", "shakespeare-char", "--data", __file__,
                                                          "--layers", "2", "--out", "runs/x"))
    assert settings["layers"] == 2 and settings["heads"] == 6 and str(out) == "runs/x"


def test_a_recipe_with_no_embedded_data_asks_for_data():
    with pytest.raises(ValueError, match=r"--config shakespeare-char trains on the Tiny Shakespeare text.*--data"):
        resolve_settings(get_task("lm"), _args("lm", "--config", "shakespeare-char"))


def test_bad_recipes_are_one_line_naming_the_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("task: lm\nsettings:\n  layers: 2\n  no_such_option: 3\n")
    assert main(["train", "lm", "--config", str(bad)]) == 2
    assert "'no_such_option' is not an option of 'attnlab train lm'" in capsys.readouterr().err
    bad.write_text("task: lm\nsettings: [1, 2\n")
    assert main(["train", "lm", "--config", str(bad)]) == 2
    assert f"{bad}: not a readable YAML recipe" in capsys.readouterr().err
    assert main(["train", "lm", "--config", "numbers"]) == 2
    assert "a recipe for 'attnlab train translate', not 'lm'" in capsys.readouterr().err
    assert main(["train", "lm", "--config", "no-such-recipe"]) == 2
    assert "neither a file nor a named recipe" in capsys.readouterr().err
    bad.write_text("task: lm\nsettings:\n  layers: -1\n")
    assert main(["train", "lm", "--config", str(bad)]) == 2
    assert "--layers: must be positive, got -1" in capsys.readouterr().err


def test_resume_reuses_the_saved_settings_and_flags_still_win(tmp_path):
    pairs = [f"{a} {b}\t{b} {a}" for a in ["one", "two", "three"] for b in ["cat", "dog"]]
    data = tmp_path / "pairs.tsv"
    data.write_text("\n".join(pairs * 4) + "\n")
    out = tmp_path / "run"
    assert main(["train", "translate", "--data", str(data), "--valid", str(data), "--tokenizer", "word", "--steps",
                 "2", "--eval-every", "2", "--lr", "0.005", "--out", str(out), *TINY_TRANSLATE]) == 0
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["task"] == "translate" and saved["settings"]["lr"] == 0.005 and saved["settings"]["d_model"] == 16
    # --resume with only the run directory: the saved settings come back, --steps extends the run
    settings, _ = resolve_settings(get_task("translate"), _args("translate", "--resume", "--out", out, "--steps", 4))
    assert settings["lr"] == 0.005 and settings["d_model"] == 16 and settings["steps"] == 4
    assert settings["data"] == str(data)
    assert main(["train", "translate", "--resume", "--out", str(out), "--steps", "4"]) == 0
    assert (out / "step-0000004").is_dir()


def test_the_shakespeare_recipe_trains_nanogpts_model(tmp_path, capsys):
    """`attnlab train lm --config shakespeare-char --data input.txt`: nanoGPT's 6-layer, 384-wide
    character GPT (one short step here, on a small batch)."""
    text = tmp_path / "input.txt"
    text.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n\n" * 80)
    out = tmp_path / "run"
    assert main(["train", "lm", "--config", "shakespeare-char", "--data", str(text), "--out", str(out), "--steps", "1",
                 "--batch-size", "2", "--eval-windows", "2", "--sample-tokens", "0", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "model: GPT, 10.7" in err and "context 256" in err              # nanoGPT reports 10.65M (vocab 65)
    saved = yaml.safe_load((out / "config.yaml").read_text())["settings"]
    assert (saved["layers"], saved["d_model"], saved["dropout"], saved["batch_size"]) == (6, 384, 0.2, 2)


def test_the_multi30k_recipe_s_sizes_are_the_defaults_for_its_corpus():
    """`--time-budget 30` alone on Multi30k's 29,000 pairs picks the sizes the recipe hand-tuned."""
    recipe = load_recipe("multi30k").settings
    task = get_task("translate")
    chosen = task._sizes(task.settings(data="train.de-en.tsv"), 29_000)
    keys = ("tokenizer", "vocab_size", "d_model", "heads", "layers", "d_ff", "dropout", "pre_norm", "max_tokens",
            "lr", "warmup")
    assert {k: chosen[k] for k in keys} == {k: recipe[k] for k in keys}
