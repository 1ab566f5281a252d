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

Usage:
  python benchmarks/serve.py --markdown
  python benchmarks/serve.py --clients 8 --requests 4 --new 64
  python benchmarks/serve.py --quick          # tiny shapes, seconds (smoke test)
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


def one_client(url: str, prompts: list[str], new: int, out: list) -> None:
    import httpx
    with httpx.Client(timeout=600) as c:
        for prompt in prompts:
            body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True}
            start, first = time.perf_counter(), None
            with c.stream("POST", url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if first is None and line.startswith("data: {") and '"text": ""' not in line:
                        first = time.perf_counter()
            out.append((time.perf_counter() - start, (first or time.perf_counter()) - start))


def _clients(url: str, prompts: list[list[str]], new: int, queue) -> None:
    results: list = []
    threads = [threading.Thread(target=one_client, args=(url, p, new, results)) for p in prompts]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    queue.put((results, time.perf_counter() - start))


def clients_in_process(url: str, prompts: list[list[str]], new: int) -> tuple[list, float]:
    """Run the clients in a process of their own (forked: it uses no torch), so that parsing the
    streams does not take the server's interpreter lock, as real clients would not; (per-request
    (latency, time to first token), wall seconds)."""
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_clients, args=(url, prompts, new, queue))
    proc.start()
    results, wall = queue.get(timeout=3600)
    proc.join(timeout=60)
    return results, wall


def measure(lm, batch: int, clients: int, requests: int, new: int, prompt_chars: int) -> dict:
    from attnlab.serve.app import Server, ServeSettings
    settings = ServeSettings(model_name="bench", max_tokens=max(new, 1), timeout=3600)
    server = Server(lm, settings, None, port=0, max_batch=batch, max_waiting=clients * requests).start()
    try:
        prompts = [[TEXT[(7 * (c * requests + r)) % 200:][:prompt_chars] for r in range(requests)]
                   for c in range(clients)]
        clients_in_process(server.url, [p[:1] for p in prompts], 4)      # warm-up: first shapes allocate
        results, wall = clients_in_process(server.url, prompts, new)
        rows = server.engine.stats["most_rows"]
    finally:
        server.stop()
    latency = sorted(r[0] for r in results)
    ttft = sorted(r[1] for r in results)
    p95 = latency[min(len(latency) - 1, int(0.95 * len(latency)))]
    return {"tokens/s": clients * requests * new / wall, "latency": statistics.mean(latency), "p95": p95,
            "ttft": statistics.mean(ttft), "rows": rows, "wall": wall}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="an LM run or Hugging Face directory (default: a random LLaMA)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=3, help="requests per client, one after another")
    p.add_argument("--new", type=int, default=64, help="tokens per request")
    p.add_argument("--prompt", type=int, default=48, help="prompt length in characters")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--quick", action="store_true", help="tiny shapes: a smoke test")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        args.clients, args.requests, args.new, args.prompt = 3, 1, 8, 16
    if args.model:
        from attnlab.tasks.lm import load_lm
        lm = load_lm(args.model, "cpu", "fp32")
    else:
        lm = random_lm(*((32, 1, 4) if args.quick else (256, 4, 8)))
    table = []
    for label, batch in ((f"batched (--max-batch {args.clients})", args.clients), ("one at a time", 1)):
        r = measure(lm, batch, args.clients, args.requests, args.new, args.prompt)
        table.append([label, r["rows"], f"{r['tokens/s']:.1f}", f"{r['latency'] * 1e3:.0f}", f"{r['p95'] * 1e3:.0f}",
                      f"{r['ttft'] * 1e3:.0f}", f"{r['wall']:.1f}"])
    head = ["serving", "most rows", "tokens/s", "mean latency ms", "p95 latency ms", "mean TTFT ms", "wall s"]
    print(f"{args.clients} clients x {args.requests} requests x {args.new} tokens, prompts of {args.prompt} "
          f"characters, {torch.get_num_threads()} torch thread(s), wall-clock")
    print(render_table(head, table, markdown=args.markdown))
    speed = float(table[0][2]) / float(table[1][2])
    print(f"throughput ratio batched / one at a time: {speed:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
