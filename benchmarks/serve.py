"""Load test of ``attnlab serve``: N concurrent clients, batched decoding against one request at a time.

The same server (attnlab.serve.app.Server on 127.0.0.1, in this process, on a free port) runs twice:
with ``--max-batch N`` (requests decoded together, joining and leaving between steps) and with
``--max-batch 1`` (one request at a time, the others queue). Each of ``--clients`` threads sends
``--requests`` streamed completions one after another (greedy, ``--new`` tokens each: the model has
no end token here, so every request runs to its limit, and each prompt is a different slice of
text). Reported: tokens/s over the whole run (all clients' generated tokens / wall time), and per
request the mean and 95th-percentile latency (request sent to last byte) and time to first token.

Model: a random LLaMA (d_model 256, 4 layers, 8 heads, character vocabulary) unless ``--model``
names an LM run or a Hugging Face directory. Times are wall-clock: on a shared machine they
include the other jobs, so say so beside any figure ("machine loaded").

``--against-transformers`` (with ``--model`` a Hugging Face directory) runs the same clients, prompts
and token limits against ``transformers serve MODEL`` (the console script of the installed
transformers, in a subprocess on a free loopback port: CPU, fp32, the same number of threads,
offline), once without and once with ``--continuous-batching``, and reports for each how many of
its greedy texts equal attnlab's. A server that does not start is reported with the reason and its
log (``--log-dir``), and the others still run. A request that meets the model's end token before its
limit counts the tokens of its text.

Usage:
  python benchmarks/serve.py --markdown
  python benchmarks/serve.py --clients 8 --requests 4 --new 64
  python benchmarks/serve.py --quick          # tiny shapes, seconds (smoke test)
  attnlab export SmolLM2-135M-Instruct.Q4_1.gguf smollm2/
  python benchmarks/serve.py --model smollm2/ --against-transformers --clients 8 --requests 2 --new 32
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import render_table  # noqa: E402

TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
        "foolishness, it was the epoch of belief, it was the epoch of incredulity. ") * 4


def random_lm(d_model: int, layers: int, heads: int):
    from attnlab.models.registry import family
    from attnlab.tasks.lm import LoadedLM
    from attnlab.tokenizer import CharTokenizer
    tok = CharTokenizer.train([TEXT])
    fam = family("llama")
    torch.manual_seed(0)
    config = fam.build_config(vocab_size=tok.vocab_size, context=1024, d_model=d_model, num_heads=heads,
                              num_layers=layers)
    model = fam.for_kind("causal-lm").build(config).eval()
    return LoadedLM(model, tok, [], tok.eos_id, Path("random-llama"), "attnlab")


def one_client(url: str, prompts: list[tuple[int, str]], new: int, out: list, model: str = "bench") -> None:
    """Send each (index, prompt) as a streamed greedy completion, one after another; append
    (index, latency, time to first token, text, finish_reason) per request."""
    import json

    import httpx
    with httpx.Client(timeout=3600) as c:
        for index, prompt in prompts:
            body = {"model": model, "prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True}
            start, first, pieces, reason = time.perf_counter(), None, [], None
            with c.stream("POST", url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    text = choices[0].get("text") or ""
                    if text and first is None:
                        first = time.perf_counter()
                    pieces.append(text)
                    reason = choices[0].get("finish_reason") or reason
            out.append((index, time.perf_counter() - start, (first or time.perf_counter()) - start, "".join(pieces),
                        reason))


def _clients(url: str, prompts: list[list[tuple[int, str]]], new: int, model: str, queue) -> None:
    results: list = []
    threads = [threading.Thread(target=one_client, args=(url, p, new, results, model)) for p in prompts]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    queue.put((results, time.perf_counter() - start))


def clients_in_process(url: str, prompts: list[list[tuple[int, str]]], new: int, model: str = "bench"
                       ) -> tuple[list, float]:
    """Run the clients in a process of their own (forked: it uses no torch), so that parsing the
    streams does not take the server's interpreter lock, as real clients would not; (per-request
    (index, latency, time to first token, text, finish_reason), wall seconds)."""
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_clients, args=(url, prompts, new, model, queue))
    proc.start()
    results, wall = queue.get(timeout=3600)
    proc.join(timeout=60)
    return results, wall


def prompts_for(clients: int, requests: int, prompt_chars: int) -> list[list[tuple[int, str]]]:
    """Per client, its (index, prompt) pairs: each prompt a different slice of TEXT."""
    return [[(c * requests + r, TEXT[(7 * (c * requests + r)) % 200:][:prompt_chars]) for r in range(requests)]
            for c in range(clients)]


def load_test(url: str, prompts, new: int, tokenizer, model: str = "bench") -> dict:
    """Warm up (one request per client, 4 tokens), then the clients' run; the figures and each
    request's text by index. A request that ends before ``new`` tokens (the model's end token)
    counts the tokens of its text."""
    clients_in_process(url, [p[:1] for p in prompts], 4, model)      # warm-up: first shapes allocate
    results, wall = clients_in_process(url, prompts, new, model)
    tokens = sum(new if reason == "length" else len(tokenizer.encode(text)) for _, _, _, text, reason in results)
    latency = sorted(r[1] for r in results)
    p95 = latency[min(len(latency) - 1, int(0.95 * len(latency)))]
    return {"tokens/s": tokens / wall, "latency": statistics.mean(latency), "p95": p95,
            "ttft": statistics.mean(r[2] for r in results), "wall": wall,
            "texts": {r[0]: r[3] for r in results}, "requests": len(results)}


def measure(lm, batch: int, clients: int, requests: int, new: int, prompt_chars: int) -> dict:
    from attnlab.serve.app import Server, ServeSettings
    settings = ServeSettings(model_name="bench", max_tokens=max(new, 1), timeout=3600)
    server = Server(lm, settings, None, port=0, max_batch=batch, max_waiting=clients * requests).start()
    try:
        r = load_test(server.url, prompts_for(clients, requests, prompt_chars), new, lm.tokenizer)
        r["rows"] = server.engine.stats["most_rows"]
    finally:
        server.stop()
    return r


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_transformers(model_dir: str, continuous: bool, threads: int, clients: int, requests: int, new: int,
                         prompt_chars: int, tokenizer, log: Path) -> dict:
    """The same load test against ``transformers serve MODEL_DIR`` (the console script beside this
    Python) in a subprocess on a free loopback port: CPU, fp32, ``threads`` OpenMP threads, offline."""
    import os
    import subprocess

    import httpx
    script = Path(sys.executable).with_name("transformers")
    port = _free_port()
    command = [str(script), "serve", model_dir, "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
               "--dtype", "float32", "--continuous-batching" if continuous else "--no-continuous-batching"]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"transformers serve exited with status {proc.returncode}; see {log}")
                try:
                    if httpx.get(url + "/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"transformers serve did not answer /health in 300 s; see {log}")
                time.sleep(1)
            return load_test(url, prompts_for(clients, requests, prompt_chars), new, tokenizer, model_dir)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _row(label: str, r: dict) -> list:
    return [label, r.get("rows", "-"), f"{r['tokens/s']:.1f}", f"{r['latency'] * 1e3:.0f}", f"{r['p95'] * 1e3:.0f}",
            f"{r['ttft'] * 1e3:.0f}", f"{r['wall']:.1f}"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="an LM run or Hugging Face directory (default: a random LLaMA)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=3, help="requests per client, one after another")
    p.add_argument("--new", type=int, default=64, help="tokens per request")
    p.add_argument("--prompt", type=int, default=48, help="prompt length in characters")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--against-transformers", action="store_true",
                   help="also run the clients against 'transformers serve --model' (a Hugging Face directory), "
                        "without and with --continuous-batching, and compare the greedy texts")
    p.add_argument("--log-dir", default=".", help="where transformers serve's output goes (default .)")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--quick", action="store_true", help="tiny shapes: a smoke test")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        args.clients, args.requests, args.new, args.prompt = 3, 1, 8, 16
    if args.against_transformers and not (args.model and Path(args.model, "config.json").is_file()):
        p.error("--against-transformers needs --model: a Hugging Face directory both servers load")
    if args.model:
        from attnlab.tasks.lm import load_lm
        lm = load_lm(args.model, "cpu", "fp32")
    else:
        lm = random_lm(*((32, 1, 4) if args.quick else (256, 4, 8)))
    table, runs = [], {}
    for label, batch in ((f"attnlab batched (--max-batch {args.clients})", args.clients), ("attnlab one at a time", 1)):
        runs[label] = measure(lm, batch, args.clients, args.requests, args.new, args.prompt)
        table.append(_row(label, runs[label]))
    failures = []
    if args.against_transformers:
        for continuous in (False, True):
            label = "transformers serve" + (" --continuous-batching" if continuous else "")
            log = Path(args.log_dir, f"transformers-serve{'-cb' if continuous else ''}.log")
            try:
                runs[label] = measure_transformers(args.model, continuous, args.threads, args.clients, args.requests,
                                                   args.new, args.prompt, lm.tokenizer, log)
            except Exception as e:                      # record why, and go on with the other one
                failures.append(f"{label}: {type(e).__name__}: {e}")
                continue
            table.append(_row(label, runs[label]))
    head = ["serving", "most rows", "tokens/s", "mean latency ms", "p95 latency ms", "mean TTFT ms", "wall s"]
    print(f"{args.clients} clients x {args.requests} streamed greedy requests x {args.new} tokens, prompts of "
          f"{args.prompt} characters, {torch.get_num_threads()} torch thread(s), wall-clock")
    print(render_table(head, table, markdown=args.markdown))
    speed = float(table[0][2]) / float(table[1][2])
    print(f"throughput ratio batched / one at a time: {speed:.2f}x")
    ours = runs[table[0][0]]["texts"]
    for label, r in runs.items():
        if label.startswith("transformers"):
            same = sum(r["texts"].get(i) == text for i, text in ours.items())
            print(f"greedy texts equal to attnlab batched: {same} of {len(ours)} requests ({label})")
            for i, text in sorted(ours.items())[:2]:
                print(f"  request {i}: attnlab {text!r}; transformers {r['texts'].get(i)!r}")
    for failure in failures:
        print("failed:", failure)
    return 0


if __name__ == "__main__":
    sys.exit(main())
