"""Response-time padding for untrusted tenants: a hit must not be told from a miss by its latency.

The exact and semantic caches are scoped by tenant, so a hit only ever reveals the tenant's own
history; but inside one tenant (a shared public tenant, one key used by many end users) a fast
answer tells a caller that someone asked the same thing before. For a padded tenant no response of
a request leaves the `llm` stage before `floor_s` plus a uniform jitter in [0, `jitter_s`] has
passed since the stage received the request. Hits are held until then; misses that finish earlier
(a short answer, a prefix served from the KV pool) are held as well, so no response arrives earlier
than a hit could; a miss that runs past the release time is not slowed down further.

The floor is fixed, not learnt from recent misses: a floor that follows the observed miss latency
moves with load and with other tenants' traffic, which is itself a signal, and a fixed floor costs
what it says. It must be set at or above the slowest miss that is to be hidden (docs/isolation.md
has the measured misses of the reference model). The floor counts from llm's receipt of the
request: the stages before it (lora_cache reading an adapter from disk) add to it, and a caller
who times them learns what they did (docs/security.md). Nor can it hide a miss made slower than
the floor. Anyone who can send requests can keep
the engine busy (long answers on its `engine_streams`), and a padded tenant's miss then waits
behind them while a hit does not; padding hides hits from misses only while the engine answers
a miss within the floor.

Padding hides the latency; `MaskedResponder` hides the rest of what differs: a padded tenant's
responses carry no cache status, similarity, prompt-token counts or finish reason, and arrive in
one final response (no streamed chunks whose count would tell a generation from a hit).

Nothing here sleeps on the caller's thread: `PaddedResponder` hands held responses to a
`ResponseTimer`, one thread that sends them at their due time (the decoupled
model's execute thread never blocks). Clock and randomness are injected, so tests never sleep.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import random
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from tiercache.exact.flights import EngineUsage
from tiercache.generation import Responder
from tiercache.threads import NamedThread

log = logging.getLogger(__name__)

Action = Callable[[], None]


class Scheduler(Protocol):
    """Runs an action at (or as soon as possible after) `due_s` on the scheduler's clock."""

    def schedule(self, due_s: float, action: Action) -> None: ...


@dataclass(frozen=True, slots=True)
class PaddingPolicy:
    """Which tenants are padded and for how long. `trusted` holds tenant scopes
    (tiercache.exact.keys.tenant_scope), never raw tenant names: the llm stage only sees scopes."""

    floor_s: float = 0.0  # 0: padding off
    jitter_s: float = 0.0
    trusted: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if self.floor_s < 0 or self.jitter_s < 0:
            raise ValueError(
                f"padding floor and jitter must be >= 0, got {self.floor_s}, {self.jitter_s}"
            )

    @property
    def enabled(self) -> bool:
        return self.floor_s > 0

    def pads(self, tenant_scope: str) -> bool:
        return self.enabled and tenant_scope not in self.trusted

    def release_at(self, arrival_s: float, uniform: Callable[[], float]) -> float:
        """When the first response of a request received at `arrival_s` may leave; `uniform`
        returns a float in [0, 1)."""
        return arrival_s + self.floor_s + self.jitter_s * uniform()


class DueQueue:
    """Actions ordered by due time (ties: in the order they were pushed). Not thread-safe."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Action]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, due_s: float, action: Action) -> None:
        heapq.heappush(self._heap, (due_s, next(self._seq), action))

    def next_due(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now_s: float) -> list[Action]:
        """Every action due at or before `now_s`, earliest first."""
        due: list[Action] = []
        while self._heap and self._heap[0][0] <= now_s:
            due.append(heapq.heappop(self._heap)[2])
        return due

    def pop_all(self) -> list[Action]:
        due = [item[2] for item in sorted(self._heap)]
        self._heap.clear()
        return due


class ResponseTimer:
    """One thread that runs scheduled actions when they are due. `close()` runs whatever is still
    held at once (a response is late rather than lost) and joins the thread."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._queue = DueQueue()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = NamedThread(target=self._run, name="llm-padding", daemon=True)
        self._thread.start()

    def schedule(self, due_s: float, action: Action) -> None:
        with self._cond:
            if self._closed:
                due_now = True
            else:
                due_now = False
                self._queue.push(due_s, action)
                self._cond.notify()
        if due_now:
            _run_all([action])

    def pending(self) -> int:
        with self._cond:
            return len(self._queue)

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    now = self._clock()
                    due = self._queue.pop_due(now)
                    if due:
                        break
                    next_due = self._queue.next_due()
                    self._cond.wait(None if next_due is None else max(next_due - now, 0.0))
            _run_all(due)  # outside the lock: sending may take a while

    def close(self) -> None:
        with self._cond:
            self._closed = True
            left = self._queue.pop_all()
            self._cond.notify()
        self._thread.join()
        _run_all(left)


def _run_all(actions: Iterable[Action]) -> None:
    for action in actions:
        try:
            action()
        except Exception:  # noqa: BLE001 - one failed send must not stop the others
            log.exception("sending a padded response failed")


class PaddedResponder:
    """Wraps a request's responder (tiercache.generation.Responder): every response sent before
    `release_s` is held and sent, in order, at `release_s`; once released, responses pass
    straight through. Thread-safe: a miss's worker and the timer may send at the same time."""

    def __init__(
        self,
        inner: Responder,
        release_s: float,
        scheduler: Scheduler,
        clock: Callable[[], float] = time.monotonic,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        """`on_done`: called once the request's last response (final, error or cancellation)
        has gone out: what a caller counting held requests needs."""
        self.inner = inner
        self.release_s = release_s
        self._scheduler = scheduler
        self._clock = clock
        self._lock = threading.Lock()
        self._held: list[Action] = []
        self._final_held = False
        self._released = False
        self._scheduled = False
        self._on_done = on_done

    def _ended(self) -> None:
        done, self._on_done = self._on_done, None
        if done is not None:
            done()

    def _send_last(self, action: Action) -> None:
        """A request's last response: `on_done` follows it, whatever the send did."""

        def last() -> None:
            try:
                action()
            finally:
                self._ended()

        with self._lock:
            if not self._released:
                self._final_held = True
        self._send(last)

    def _send(self, action: Action) -> None:
        with self._lock:
            if not self._released and not self._scheduled and self._clock() >= self.release_s:
                self._released = True  # the floor has passed already: nothing to hold
            if self._released:
                action()  # under the lock: keeps this request's responses in order
                return
            self._held.append(action)
            if self._scheduled:
                return
            self._scheduled = True
        self._scheduler.schedule(self.release_s, self._release)

    def _release(self) -> None:
        with self._lock:
            held, self._held = self._held, []
            self._released = True
            if held and self._final_held and self.inner.is_cancelled():
                # The client left while its answer was held: it gets the cancellation, not
                # the answer (whether it was a hit or a miss, the same).
                try:
                    self.inner.send_cancelled()
                finally:
                    self._ended()
                return
            for action in held:
                action()

    # -- the Responder protocol --------------------------------------------------------------

    def is_cancelled(self) -> bool:
        return self.inner.is_cancelled()

    def send_chunk(self, text: str) -> None:
        self._send(lambda: self.inner.send_chunk(text))

    def send_final(
        self,
        text: str | None,
        status: str,
        similarity: float | None = None,
        usage: EngineUsage | None = None,
        finish_reason: str | None = None,
        tokens: tuple[int, int] | None = None,
    ) -> None:
        inner = self.inner
        if finish_reason is None and tokens is None:
            self._send_last(lambda: inner.send_final(text, status, similarity, usage))
        else:
            self._send_last(
                lambda: inner.send_final(
                    text,
                    status,
                    similarity,
                    usage,
                    finish_reason=finish_reason,
                    tokens=tokens,
                )
            )

    def send_cancelled(self) -> None:
        self._send_last(self.inner.send_cancelled)

    def identify(self, answer_id: str) -> None:
        self.inner.identify(answer_id)

    def send_error(self, exc: BaseException) -> None:
        self._send_last(lambda: self.inner.send_error(exc))


MASKED_STATUS = "masked"


class MaskedResponder:
    """Wraps a padded tenant's responder so that a hit's response and a miss's look alike: the
    answer in one final response (a streamed miss's chunks are joined), `cache_status`
    "masked", and no similarity, prompt-token counts (an exact prefix oracle otherwise), token
    usage (a semantic hit's would be another prompt's) or finish reason. Errors and
    cancellations pass as they are (they do not depend on the cache)."""

    def __init__(self, inner: Responder) -> None:
        self.inner = inner
        self._chunks: list[str] = []

    def is_cancelled(self) -> bool:
        return self.inner.is_cancelled()

    def send_chunk(self, text: str) -> None:
        self._chunks.append(text)  # only one worker sends a request's chunks, then its final

    def send_final(
        self,
        text: str | None,
        status: str,
        similarity: float | None = None,
        usage: EngineUsage | None = None,
        finish_reason: str | None = None,
        tokens: tuple[int, int] | None = None,
    ) -> None:
        whole = "".join(self._chunks) + (text or "")
        self.inner.send_final(whole, MASKED_STATUS)

    def send_cancelled(self) -> None:
        self.inner.send_cancelled()

    def identify(self, answer_id: str) -> None:
        self.inner.identify(answer_id)  # an id tells nothing (tiercache.exact.answer_ids)

    def send_error(self, exc: BaseException) -> None:
        self.inner.send_error(exc)


def uniform_source(seed: int | None = None) -> Callable[[], float]:
    """A thread-safe uniform [0, 1) source for the jitter: the system's (os.urandom: a
    Mersenne Twister's state can be rebuilt from its outputs, and the jitter must not be
    predicted), or with a `seed` a reproducible one (tests and replays)."""
    if seed is None:
        return secrets.SystemRandom().random
    return random.Random(seed).random
