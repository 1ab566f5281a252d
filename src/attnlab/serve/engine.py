"""One decoding loop for every request: continuous batching over a causal LM's decoding state.

    engine = Engine(lm, max_batch=8, max_waiting=64)       # lm: attnlab.tasks.lm.LoadedLM
    engine.start()
    handle = engine.submit(Request(prompt_ids, max_tokens=50, temperature=0.0))
    for event in handle.events():   ...                    # Delta(text) ..., then Finished(reason, ...)

A scheduler thread owns the model. Between two decoding steps it lets waiting requests join: each
is prefilled alone (its own :class:`~attnlab.generate.state.CausalState`, whose first token it
samples at once), then merged into the running batch; then one forward pass gives every running
row its next token; rows that are done (an end token, a stop string, ``max_tokens``, a client gone,
the deadline passed) leave the batch before the next step.

Why rows decode in one batch as they would alone. Rows of different lengths are aligned by padding
on the LEFT with masked slots, in the token history and in every layer's KV cache; the model takes
each row's positions from the cumulative sum of its mask, so a row's padding changes neither its
positions nor (being masked) its attention: greedy rows give the tokens they give alone (the sums
of a batched product may differ in the last bits, tests/test_serve.py). Columns that no remaining
row uses any more are cut off when rows leave, so a long request that has left costs nothing.

A state that cannot be merged (a recurrent model's) decodes requests one batch at a time: those
that arrive together join, the next wait until the batch is empty.
"""
from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..generate.sampling import sample
from ..generate.state import CausalState
from ..nn.cache import LayerCaches

__all__ = ["Request", "Delta", "Finished", "Failed", "Handle", "Engine", "QueueFull"]


class QueueFull(RuntimeError):
    """More requests wait than the engine's ``max_waiting``."""


@dataclass
class Request:
    """One generation: ``prompt_ids`` continued by up to ``max_tokens`` tokens. ``stop_ids``: tokens
    that end it (not part of the text); ``stop``: strings that end it (cut from the text);
    ``temperature`` 0 is greedy; ``seed`` makes sampling reproducible; ``deadline``: time.monotonic()
    after which it ends with an error."""
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_ids: frozenset[int] = frozenset()
    deadline: float | None = None


@dataclass
class Delta:
    text: str


@dataclass
class Finished:
    reason: str                  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Failed:
    status: int
    message: str


class Handle:
    """A submitted request: the engine pushes events, the caller reads them (``events``) or gives up
    (``cancel``). ``notify`` is called after each push (the web server wakes its event loop with it)."""

    def __init__(self, request: Request, notify=None):
        self.request, self.notify = request, notify
        self._events: collections.deque = collections.deque()
        self._ready = threading.Condition()
        self.cancelled = threading.Event()

    def push(self, event) -> None:
        with self._ready:
            self._events.append(event)
            self._ready.notify_all()
        if self.notify is not None:
            self.notify()

    def cancel(self) -> None:
        self.cancelled.set()

    def pop(self):
        """The next event, or None if there is none yet."""
        with self._ready:
            return self._events.popleft() if self._events else None

    def events(self, timeout: float | None = None):
        """Yield the events as they come, up to the last (Finished or Failed); blocking."""
        while True:
            with self._ready:
                if not self._ready.wait_for(lambda: self._events, timeout):
                    raise TimeoutError("no event from the engine in time")
                event = self._events.popleft()
            yield event
            if isinstance(event, (Finished, Failed)):
                return


class _Row:
    """A running request: its generated ids, its text so far and what has been sent of it."""

    def __init__(self, handle: Handle, tokenizer, device):
        self.handle, self.tokenizer = handle, tokenizer
        r = handle.request
        self.ids: list[int] = []
        self.sent = 0
        self.generator = None
        if r.temperature > 0:
            self.generator = torch.Generator(device)
            if r.seed is not None:                # the seed attnlab generate takes: the same draws
                self.generator.manual_seed(r.seed)
            else:                                 # this generator alone; torch's global one is left alone
                self.generator.seed()
        self.hold = max((len(s) for s in r.stop), default=1) - 1     # text that may still become a stop

    def choose(self, logits: Tensor) -> int:
        r = self.handle.request
        if r.temperature == 0:
            return int(logits.argmax())
        return int(sample(logits[None], r.temperature, None, r.top_p, generator=self.generator)[0])

    def add(self, token: int) -> str | None:
        """Take one token; push the text that is certain; the finish reason when it ends here."""
        r = self.handle.request
        if token in r.stop_ids:
            return self.finish("stop")
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        cut = min((i for i in (text.find(s) for s in r.stop) if i >= 0), default=-1)
        if cut >= 0:
            return self.finish("stop", text[:cut])
        if len(self.ids) >= r.max_tokens:
            return self.finish("length", text)
        safe = len(text) - self.hold
        while safe > self.sent and text[safe - 1] == "\ufffd":     # a character still incomplete
            safe -= 1
        if safe > self.sent:
            self.handle.push(Delta(text[self.sent:safe]))
            self.sent = safe
        return None

    def finish(self, reason: str, text: str | None = None) -> str:
        text = self.tokenizer.decode(self.ids) if text is None else text
        if len(text) > self.sent:
            self.handle.push(Delta(text[self.sent:]))
            self.sent = len(text)
        self.handle.push(Finished(reason, len(self.handle.request.prompt_ids), len(self.ids)))
        return reason


def _pad_left(t: Tensor, width: int, dim: int) -> Tensor:
    """``t`` with zeros before it along ``dim`` up to ``width``."""
    shape = list(t.shape)
    shape[dim] = width - t.size(dim)
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def mergeable(state: CausalState) -> bool:
    """Whether rows of this state can join a running batch (a KV cache can; a recurrent state keeps
    one length for all rows and cannot)."""
    return isinstance(state.cache, LayerCaches) and state.cache.cross_attn is None


def merge_states(states: list[CausalState], drop: int = 0) -> CausalState:
    """One state holding the rows of ``states`` (each left-padded to the longest), without the
    first ``drop`` slots of the result (columns no row uses). Every state must have consumed all
    its slots but the last (each row has one new token to feed)."""
    L = max(s.length for s in states) - drop
    out = CausalState.__new__(CausalState)
    out.model, out.prefill_chunk = states[0].model, None
    seq = torch.cat([_pad_left(s.seq, L + drop, 1) for s in states])[:, drop:]
    mask = torch.cat([_pad_left(s.mask, L + drop, 1) for s in states])[:, drop:]
    out._length = L
    out._seq, out._mask = out._room(seq, 2 * L + 64), out._room(mask, 2 * L + 64)
    cache = LayerCaches(len(states[0].cache.self_attn))
    for layer, merged in enumerate(cache.self_attn):
        parts = [s.cache.self_attn[layer] for s in states]
        width = L - 1 + drop                      # the slots consumed, the newest token not yet
        k = torch.cat([_pad_left(p.k[:, :, :p.length], width, 2) for p in parts])[:, :, drop:]
        v = torch.cat([_pad_left(p.v[:, :, :p.length], width, 2) for p in parts])[:, :, drop:]
        merged.capacity = max(64, 2 * (L - 1))
        merged.k = k.new_zeros(k.size(0), k.size(1), merged.capacity, k.size(3))
        merged.v = v.new_zeros(v.size(0), v.size(1), merged.capacity, v.size(3))
        merged.k[:, :, :L - 1], merged.v[:, :, :L - 1] = k, v
        merged.length = L - 1
    out.cache = cache
    return out


class Engine:
    """The scheduler (see the module docstring). ``lm``: a model with its tokenizer (``model``,
    ``tokenizer``); ``max_batch`` rows decode together; ``max_waiting`` requests may wait to join
    (one more is refused with :class:`QueueFull`)."""

    def __init__(self, lm, max_batch: int = 8, max_waiting: int = 64):
        if max_batch < 1 or max_waiting < 0:
            raise ValueError(f"Engine: max_batch must be >= 1 and max_waiting >= 0, got {max_batch}, {max_waiting}")
        self.model, self.tokenizer = lm.model, lm.tokenizer
        self.device = next(self.model.parameters()).device
        self.max_batch, self.max_waiting = max_batch, max_waiting
        self._waiting: collections.deque[Handle] = collections.deque()
        self._wake = threading.Condition()
        self._running = threading.Event()
        self._running.set()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.stats = {"steps": 0, "most_rows": 0, "requests": 0, "errors": 0}
        self.batch: CausalState | None = None
        self.rows: list[_Row] = []

    # ------------------------------------------------------------------ the caller's side
    def start(self) -> "Engine":
        self.warm_up()
        self._thread = threading.Thread(target=self._loop, name="attnlab-engine", daemon=True)
        self._thread.start()
        return self

    @torch.inference_mode()
    def warm_up(self) -> None:
        """One step of a padded two-row batch before the first request: the first forward with a
        padding mask pays a one-time set-up (seconds on a small CPU; benchmarks/results/code.md),
        which would otherwise land on the first requests that decode together."""
        def prefilled(n: int) -> CausalState:
            state = CausalState(self.model, torch.zeros(1, n, dtype=torch.long, device=self.device))
            state.append(state.next_logits().argmax(-1)[:, None])
            return state

        first = prefilled(1)
        if mergeable(first):
            merge_states([first, prefilled(2)]).next_logits()

    def close(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        self._running.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def pause(self) -> None:
        """Stop stepping after the current step (requests still queue); for maintenance and tests."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()
        with self._wake:
            self._wake.notify_all()

    @property
    def load(self) -> dict:
        return {"running": len(self.rows), "waiting": len(self._waiting)}

    def submit(self, request: Request, notify=None) -> Handle:
        """Queue ``request``; QueueFull if ``max_waiting`` requests already wait."""
        handle = Handle(request, notify)
        with self._wake:
            # the free rows of the batch take requests at the next step: they do not count as a queue
            if len(self._waiting) >= self.max_waiting + max(0, self.max_batch - len(self.rows)):
                raise QueueFull(f"{len(self._waiting)} requests are waiting already (--max-waiting "
                                f"{self.max_waiting}); try again later")
            self._waiting.append(handle)
            self._wake.notify_all()
        return handle

    # ------------------------------------------------------------------ the scheduler thread
    def _loop(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._stop or self._waiting or self.rows)
                if self._stop:
                    break
            self._running.wait()
            if self._stop:
                break
            try:
                with torch.inference_mode():
                    self._admit()
                    self._step()
            except Exception as e:                # a fault ends the requests it touched, not the server
                self._fail_all(f"internal error while decoding: {type(e).__name__}")
                self.stats["errors"] += 1
        self._fail_all("the server is shutting down", status=503)

    def _fail_all(self, message: str, status: int = 500) -> None:
        for row in self.rows:
            row.handle.push(Failed(status, message))
        self.rows, self.batch = [], None
        with self._wake:
            for h in self._waiting:
                h.push(Failed(status, message))
            self._waiting.clear()

    def _expired(self, handle: Handle) -> bool:
        d = handle.request.deadline
        if d is not None and time.monotonic() > d:
            handle.push(Failed(504, "the request timed out"))
            return True
        return handle.cancelled.is_set()

    def _admit(self) -> None:
        """Let waiting requests join, prefilled one by one, while the batch has room."""
        joined = []
        while len(self.rows) + len(joined) < self.max_batch:
            if self.batch is not None and not mergeable(self.batch):
                break                             # rows of such a state cannot join a running batch
            with self._wake:
                if not self._waiting:
                    break
                handle = self._waiting.popleft()
            if self._expired(handle):
                continue
            self.stats["requests"] += 1
            row = _Row(handle, self.tokenizer, self.device)
            state = CausalState(self.model, torch.tensor([handle.request.prompt_ids], device=self.device))
            token = row.choose(state.next_logits()[0])
            if row.add(token) is None:
                state.append(torch.tensor([[token]], device=self.device))
                joined.append((row, state))
                if not mergeable(state):
                    break
        if not joined:
            return
        states = ([self.batch] if self.batch is not None else []) + [s for _, s in joined]
        self.rows += [r for r, _ in joined]
        self.batch = states[0] if len(states) == 1 else merge_states(states)
        self.stats["most_rows"] = max(self.stats["most_rows"], len(self.rows))

    def _step(self) -> None:
        """One token for every running row; the rows that are done leave."""
        if not self.rows:
            return
        logits = self.batch.next_logits()
        self.stats["steps"] += 1
        tokens, keep = [], []
        for i, row in enumerate(self.rows):
            if self._expired(row.handle):
                tokens.append(0)
                continue
            token = row.choose(logits[i])
            tokens.append(token)
            if row.add(token) is None:
                keep.append(i)
        if len(keep) == len(self.rows):
            self.batch.append(torch.tensor(tokens, device=self.device)[:, None])
            return
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.batch = None
            return
        self.batch.append(torch.tensor(tokens, device=self.device)[:, None])
        self.batch.select(torch.tensor(keep, device=self.device))
        self._compact()

    def _compact(self) -> None:
        """Cut the leading columns no remaining row uses (a long request has left)."""
        if not mergeable(self.batch):
            return
        used = self.batch.mask.any(0)
        first = int(used.float().argmax())
        if first > 0:
            self.batch = merge_states([self.batch], drop=first)
