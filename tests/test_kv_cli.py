"""The KV-cache flags of ``attnlab generate`` and ``chat``: the chosen cache gives the full
cache's greedy text where it is exact, and each misuse is one line naming the flag."""
import pytest

from attnlab.cli import build_parser, main
from _hf_fixtures import tiny_gpt2_dir  # noqa: E402


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("attnlab generate: error: "), err
    return lines[0]


def test_kv_cache_flags_give_the_full_caches_text(tmp_path, capsys):
    pytest.importorskip("transformers")
    tiny_gpt2_dir(tmp_path, n_embd=32)
    base = ["generate", str(tmp_path), "--prompt", "the quick brown fox", "--temperature", "0",
            "--max-new-tokens", "8"]
    assert main(base) == 0
    want = capsys.readouterr().out
    # the window covers the whole text, the residual every token: both exact
    for extra in (["--kv-cache", "int8"], ["--kv-cache", "int4"], ["--kv-cache", "sliding", "--window", "16"],
                  ["--prefill-chunk", "2"], ["--kv-cache", "sliding", "--window", "16", "--prefill-chunk", "3"]):
        assert main(base + extra) == 0, extra
        assert capsys.readouterr().out == want, extra
    assert main(base + ["--kv-cache", "sliding", "--window", "2"]) == 0    # a short window changes the text
    assert capsys.readouterr().out.startswith("the quick brown fox")


@pytest.mark.parametrize("flags, message", [
    (["--kv-cache", "int8", "--window", "8"], "--window: only with --kv-cache sliding or sink (not int8)"),
    (["--kv-cache", "sink"], "--kv-cache sink: needs --window N"),
    (["--sink-tokens", "2"], "--sink-tokens: only with --kv-cache sink (not full)"),
    (["--prefill-chunk", "0"], "--prefill-chunk: must be at least 1, got 0"),
    (["--kv-cache", "sliding", "--window", "0"], "--window: must be at least 1, got 0"),
])
def test_kv_cache_misuse_is_one_line(tmp_path, capsys, flags, message):
    assert main(["generate", str(tmp_path / "nothing-loaded-before-the-check")] + flags) == 2
    assert message in _one_error_line(capsys.readouterr().err)


def test_chat_and_generate_take_the_flags():
    parser = build_parser()
    for command in ("generate", "chat"):
        args = parser.parse_args([command, "m.gguf", "--kv-cache", "sink", "--window", "64", "--sink-tokens", "2",
                                  "--prefill-chunk", "128"])
        assert (args.kv_cache, args.window, args.sink_tokens, args.prefill_chunk) == ("sink", 64, 2, 128)


def test_eval_reads_the_text_through_the_chosen_cache(tmp_path, capsys):
    """``eval --kv-cache``: the streamed perplexity with a full cache equals the one computed
    from the full forward of the same tokens (transformers' GPT-2), and int8 stays near it."""
    transformers = pytest.importorskip("transformers")
    import math
    hf, tok = tiny_gpt2_dir(tmp_path / "m", n_embd=32)          # context 16
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog a cat the dog")
    ids = tok.encode(text.read_text()).ids[:16]
    import torch
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1]
    want = math.exp(float(torch.nn.functional.cross_entropy(logits.double(), torch.tensor(ids[1:]))))
    assert main(["eval", str(tmp_path / "m"), "--data", str(text), "--kv-cache", "sliding", "--window", "16",
                 "--prefill-chunk", "3", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    got = float(out.split("perplexity ")[1].split()[0])
    assert abs(got - want) <= 1e-3 * want and "read once through a sliding KV cache in chunks of 3" in out
    assert main(["eval", str(tmp_path / "m"), "--data", str(text), "--kv-cache", "int8", "--window", "3"]) == 2
    assert "--window: only with --kv-cache sliding or sink" in capsys.readouterr().err
