"""attnlab serve as users call it: the `openai` client against the server on 127.0.0.1.

A tiny random LLaMA with a character tokenizer (weights N(0, 0.3): clear greedy choices) is served
on a free loopback port in a thread. Non-streamed and streamed replies equal `attnlab generate`'s
greedy continuation (attnlab.generate.text.complete, the function the command calls); requests sent
together decode in one batch and each equals its run alone; the faults (a client leaving mid-stream,
a malformed body, a huge body, a wrong key, an unknown route, a full queue, a timeout) are each
answered with OpenAI's JSON error and /health stays ok. Every loop is bounded.
"""
import json
import threading
import time
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from attnlab.data.chats import CHATML, ChatTemplate  # noqa: E402
from attnlab.generate.text import complete  # noqa: E402
from attnlab.models.registry import family  # noqa: E402
from attnlab.serve.app import Server, ServeSettings  # noqa: E402
from attnlab.tasks.lm import LoadedLM  # noqa: E402
from attnlab.tokenizer import CharTokenizer  # noqa: E402

KEY = "test-key"
TEXT = "<|im_start|>user\nassistant: the quick brown fox jumps over the lazy dog, 0123456789.<|im_end|>\n?!"


def tiny_lm() -> LoadedLM:
    tok = CharTokenizer.train([TEXT])
    fam = family("llama")
    torch.manual_seed(0)
    model = fam.for_kind("causal-lm").build(fam.preset("tiny", vocab_size=tok.vocab_size,
                                                       max_position_embeddings=256))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    return LoadedLM(model.eval(), tok, [tok.eos_id], tok.eos_id, Path("tiny"), "attnlab")


@pytest.fixture(scope="module")
def served():
    lm = tiny_lm()
    settings = ServeSettings(model_name="tiny", api_key=KEY, max_tokens=64, max_body_bytes=20_000, timeout=30)
    server = Server(lm, settings, ChatTemplate(CHATML), port=0, max_batch=4, max_waiting=2).start()
    try:
        yield lm, server
    finally:
        server.stop()


def client(server, key=KEY):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=30)


def greedy(lm, prompt_ids, n):
    return complete(lm.model, lm.tokenizer, prompt_ids, n, eos_ids=lm.eos_ids, temperature=0.0).text


def healthy(server):
    r = httpx.get(server.url + "/health", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    return r.status_code == 200 and r.json()["status"] == "ok"


def test_server_binds_loopback(served):
    _, server = served
    assert server.url.startswith("http://127.0.0.1:")


def test_completions_equal_generate_greedy(served):
    lm, server = served
    c = client(server)
    prompt = "the quick brown"
    want = greedy(lm, lm.tokenizer.encode(prompt), 20)
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
    assert r.choices[0].text == want and len(want) > 0
    assert r.usage.prompt_tokens == len(prompt) and r.choices[0].finish_reason in ("length", "stop")
    pieces = [ch.choices[0].text for ch in c.completions.create(model="tiny", prompt=prompt, max_tokens=20,
                                                                 temperature=0, stream=True)]
    assert "".join(pieces) == want and len([p for p in pieces if p]) > 1
    assert [m.id for m in c.models.list().data] == ["tiny"]


def test_chat_equals_generate_greedy_on_the_template(served):
    lm, server = served
    c = client(server)
    messages = [{"role": "user", "content": "the lazy dog"}]
    prompt = ChatTemplate(CHATML).render(messages, add_generation_prompt=True)
    want = greedy(lm, lm.tokenizer.encode(prompt), 30).split("<|im_end|>")[0]
    r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=30, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    stream = c.chat.completions.create(model="tiny", messages=messages, max_tokens=30, temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream) == want


def test_stop_strings_and_seeded_sampling(served):
    lm, server = served
    c = client(server)
    full = greedy(lm, lm.tokenizer.encode("fox"), 20)
    stop = full[5:7]
    r = c.completions.create(model="tiny", prompt="fox", max_tokens=20, temperature=0, stop=[stop])
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"
    a, b = (c.completions.create(model="tiny", prompt="fox", max_tokens=20, temperature=1.0, top_p=0.9, seed=7)
            .choices[0].text for _ in range(2))
    want = complete(lm.model, lm.tokenizer, lm.tokenizer.encode("fox"), 20, eos_ids=lm.eos_ids, temperature=1.0,
                    top_p=0.9, seed=7).text
    assert a == b == want                   # the seed as `attnlab generate --seed 7` takes it
    other = c.completions.create(model="tiny", prompt="fox", max_tokens=20, temperature=1.0, seed=8).choices[0].text
    assert other != a


def test_concurrent_requests_decode_together_and_equal_each_alone(served):
    lm, server = served
    prompts = [("the", 25), ("quick brown fox jumps", 9), ("0123", 17), ("lazy", 30)]
    want = [greedy(lm, lm.tokenizer.encode(p), n) for p, n in prompts]
    got = [None] * len(prompts)
    server.engine.pause()                   # they arrive while it waits, so that they start together
    threads = [threading.Thread(target=lambda i=i, p=p, n=n: got.__setitem__(
        i, client(server).completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0).choices[0].text))
        for i, (p, n) in enumerate(prompts)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while server.engine.load["waiting"] < len(prompts) and time.monotonic() < deadline:
        time.sleep(0.02)
    server.engine.resume()
    for t in threads:
        t.join(timeout=60)
    assert got == want
    assert server.engine.stats["most_rows"] == len(prompts)          # all four in one batch


def _post(server, path, body: bytes, key=KEY):
    headers = {"content-type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    return httpx.post(server.url + path, content=body, headers=headers, timeout=30)


def test_faults_get_openai_errors_and_the_server_keeps_serving(served):
    _, server = served
    cases = [
        (_post(server, "/v1/completions", b'{"prompt": "the", "max_tokens": '), 400),      # malformed JSON
        (_post(server, "/v1/completions", json.dumps({"prompt": "x" * 50_000}).encode()), 413),
        (_post(server, "/v1/completions", b'{"prompt": "the"}', key="wrong"), 401),
        (_post(server, "/v1/completions", b'{"prompt": "the"}', key=None), 401),
        (_post(server, "/v1/nowhere", b"{}"), 404),
        (_post(server, "/v1/completions", b'{"prompt": "the", "max_tokens": 100000}'), 400),
        (_post(server, "/v1/chat/completions", b'{"messages": "hi"}'), 400),
        (_post(server, "/v1/completions", b'{"prompt": "the", "temperature": -1}'), 400),
    ]
    for response, status in cases:
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["message"] and error["code"] == status and "Traceback" not in response.text
    with pytest.raises(openai.AuthenticationError):
        client(server, key="wrong").completions.create(model="tiny", prompt="the", max_tokens=3)
    assert healthy(server)
    assert client(server).completions.create(model="tiny", prompt="the", max_tokens=3).choices[0].text is not None


def test_a_huge_body_without_a_length_is_refused_while_it_streams_in(served):
    # chunked transfer: no content-length to refuse on, so the limit (20 000 bytes here) is counted
    # as the body arrives; 413, never the whole body held, and the server goes on
    _, server = served
    sent = []

    def body():
        for _ in range(200):                    # 200 x 10 000 bytes, far over the limit
            sent.append(1)
            yield b'{"prompt": "' if len(sent) == 1 else b"x" * 10_000

    response = httpx.post(server.url + "/v1/completions", content=body(), timeout=30,
                          headers={"content-type": "application/json", "Authorization": f"Bearer {KEY}"})
    assert "content-length" not in response.request.headers and len(sent) == 200
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["code"] == 413 and "20000 bytes" in error["message"] and "Traceback" not in response.text
    assert healthy(server)
    assert client(server).completions.create(model="tiny", prompt="the", max_tokens=3).choices[0].text is not None


def test_a_client_leaving_mid_stream_frees_its_row(served):
    _, server = served
    body = {"prompt": "the", "max_tokens": 64, "temperature": 0, "stream": True}
    server.engine.pause()
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        server.engine.resume()
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["object"] == "text_completion"
    deadline = time.monotonic() + 20           # gone: its row leaves the batch
    while server.engine.load["running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.engine.load == {"running": 0, "waiting": 0}
    assert healthy(server)
    assert client(server).completions.create(model="tiny", prompt="the", max_tokens=3).choices[0].text is not None


def test_full_queue_is_429_and_a_timeout_504():
    lm = tiny_lm()
    settings = ServeSettings(model_name="tiny", max_tokens=8, timeout=1.0)
    server = Server(lm, settings, ChatTemplate(CHATML), port=0, max_batch=1, max_waiting=1).start()
    try:
        server.engine.pause()
        results = []
        threads = [threading.Thread(target=lambda: results.append(
            _post(server, "/v1/completions", b'{"prompt": "the", "max_tokens": 4}', key=None))) for _ in range(3)]
        for t in threads:
            t.start()
            time.sleep(0.3)
        time.sleep(1.2)                           # past the deadline of the two that wait
        server.engine.resume()
        for t in threads:
            t.join(timeout=30)
        statuses = sorted(r.status_code for r in results)
        assert statuses == [429, 504, 504], [r.text for r in results]
        assert all(r.json()["error"]["code"] == r.status_code for r in results)
        assert _post(server, "/v1/completions", b'{"prompt": "the", "max_tokens": 4}', key=None).status_code == 200
    finally:
        server.stop()


def test_the_command_serves_a_run(tmp_path):
    """`attnlab serve RUN` in its own process: the key from ATTNLAB_API_KEY, loopback, then stopped."""
    import os
    import socket
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ATTNLAB_API_KEY": KEY}
    (tmp_path / "t.txt").write_text(TEXT * 20)
    train = subprocess.run([sys.executable, "-m", "attnlab.cli", "train", "lm", "--data", str(tmp_path / "t.txt"),
                            "--out", str(tmp_path / "run"), "--model", "llama", "--tokenizer", "char", "--d-model",
                            "32", "--heads", "4", "--layers", "1", "--context", "64", "--steps", "2",
                            "--sample-tokens", "0", "--no-progress"], capture_output=True, text=True, cwd=root,
                           env=env, timeout=300)
    assert train.returncode == 0, train.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "attnlab.cli", "serve", str(tmp_path / "run"), "--port", str(port)],
                            cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url, up = f"http://127.0.0.1:{port}", False
        for _ in range(300):                                   # at most ~60 s for the start
            try:
                up = httpx.get(url + "/health", headers={"Authorization": f"Bearer {KEY}"}, timeout=2).status_code \
                    == 200
            except httpx.TransportError:
                pass
            if up or proc.poll() is not None:
                break
            time.sleep(0.2)
        assert up, proc.stderr.read() if proc.poll() is not None else "not up in time"
        assert httpx.get(url + "/health", timeout=5).status_code == 401
        c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=30)
        r = c.chat.completions.create(model="run", messages=[{"role": "user", "content": "fox"}], max_tokens=5)
        assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens <= 5
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_load_test_benchmark_quick_runs():
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "serve.py"), "--quick"], capture_output=True,
                          text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "batched (--max-batch 3)" in proc.stdout and "one at a time" in proc.stdout
    assert "throughput ratio" in proc.stdout


@pytest.mark.slow
def test_load_test_against_transformers_serve(tmp_path):
    # opt-in (-m slow: two transformers serve start-ups); the default suite runs the quick load test
    # above. A tiny random LLaMA saved by transformers with SmolLM2's tokenizer: both servers load
    # the directory, serve the same greedy requests, and every reply is the same text.
    import subprocess
    import sys

    import transformers
    from _smollm import GGUF

    from attnlab import load_tokenizer
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    (tmp_path / "model" / "tokenizer.json").write_text(load_tokenizer(GGUF).hf.to_str(), encoding="utf-8")
    (tmp_path / "model" / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>"}), encoding="utf-8")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "serve.py"), "--quick", "--model",
                           str(tmp_path / "model"), "--against-transformers", "--log-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=900, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "failed:" not in proc.stdout, proc.stdout
    for label in ("transformers serve ", "transformers serve --continuous-batching"):
        assert label in proc.stdout
    assert proc.stdout.count("greedy texts equal to attnlab batched: 3 of 3 requests") == 2, proc.stdout
