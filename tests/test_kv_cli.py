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
