"""Coalescing of identical in-flight misses (single flight).

The first request for a digest becomes a flight's first subscriber and starts one generation; later
identical requests subscribe to the same flight and receive the same chunks, from the beginning,
as they arrive. The generation belongs to the flight, not to any one request: a subscriber that
cancels only detaches, and the flight reports `abandoned` once every subscriber has gone, so the
producer can stop early.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from tiercache.errors import TierCacheError, Unavailable
from tiercache.exact.codec import CacheEntry


@dataclass(frozen=True, slots=True)
class EngineUsage:
    """What a flight's generation cost the engine, as llm reports it: prompt tokens served from
    the prefix KV pool and computed, and answer tokens taken from verified drafts (speculative
    decoding; each one a forward pass saved, less the verification's extra cost)."""

    reused_tokens: int = 0
    computed_tokens: int = 0
    speculated_tokens: int = 0

    @property
    def prompt_tokens(self) -> int:
        return self.reused_tokens + self.computed_tokens


@dataclass(slots=True)
class Flight:
    """Chunks of one generation, readable by many subscribers while it is being written."""

    key: str
    chunks: list[str] = field(default_factory=list)
    done: bool = False
    error: TierCacheError | None = None
    subscribers: int = 0
    followers: int = 0
    # (reused, computed) prompt tokens of the generation, once the engine reported them.
    usage: EngineUsage | None = None
    # How the generation ended (the engine's finish reason), once it did.
    finish_reason: str | None = None
    # Tokens the generation produced, once it ended.
    generated_tokens: int = 0
    # An answer stored since the lookup served it instead (here, or another replica's): its
    # (prompt tokens, completion tokens, finish reason), as a hit on it reports them.
    stored: tuple[int, int, str] | None = None
    # When it was created (the cache's clock): what its answer would be stored as made at, at
    # the latest, for telling whether an invalidation since covers it (`FlightTable.join`).
    started_s: float = 0.0
    # The tags its answer is stored with (its leader's; not part of the key): what an
    # invalidation by tag since it started kills.
    tags: tuple[str, ...] = ()
    # Left the table for a newer flight because an invalidation covers its answer: one still
    # holding its cross-replica lease is not waited for by that newer flight.
    superseded: bool = False
    # What runs once its answer is stored (the semantic index write): its leader's, or the
    # first subscriber's that brought one (a verified semantic hit leading brings none).
    after_store: Callable[[], None] | None = None
    _cond: threading.Condition = field(default_factory=threading.Condition)

    def append(self, chunk: str) -> None:
        with self._cond:
            self.chunks.append(chunk)
            self._cond.notify_all()

    def serve_stored(self, entry: CacheEntry) -> None:
        """Answer with `entry` (stored since the lookup) instead of a generation."""
        self.stored = (entry.prompt_tokens, entry.generated_tokens, entry.finish_reason)
        self.append(entry.text)

    def finish(self, error: TierCacheError | None = None) -> None:
        with self._cond:
            self.done = True
            self.error = error
            self._cond.notify_all()

    @property
    def abandoned(self) -> bool:
        with self._cond:
            return self.subscribers == 0

    def text(self) -> str:
        with self._cond:
            return "".join(self.chunks)

    def read(
        self, is_cancelled: Callable[[], bool] = lambda: False, poll_s: float = 0.05
    ) -> Iterator[str]:
        """Yield every chunk from the first; raise the flight's error; stop if `is_cancelled`.
        `is_cancelled` is asked outside the flight's lock (python_backend's asks Triton's core:
        one slow answer must not hold up the flight's writer, nor the table's `leave`)."""
        index = 0
        while True:
            if index >= len(self.chunks) and not self.done and is_cancelled():
                return
            with self._cond:
                if index >= len(self.chunks) and not self.done:
                    self._cond.wait(poll_s)
                pending = self.chunks[index:]
                index = len(self.chunks)
                finished, error = self.done, self.error
            if not pending and not finished:
                continue
            yield from pending
            if finished and index >= len(self.chunks):
                if error is not None:
                    raise error
                return


class FlightTable:
    """Digest -> running Flight. `join` tells the caller whether it leads (must produce)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flights: dict[str, Flight] = {}
        self.coalesced_total = 0

    def join(
        self,
        key: str,
        now_s: float = 0.0,
        stale: Callable[[Flight], bool] | None = None,
        tags: tuple[str, ...] = (),
    ) -> tuple[Flight, bool]:
        """The running flight for `key` and False, or a new one (started at `now_s`, its
        answer to be stored with `tags`) and True.
        A running flight that `stale` refuses (an invalidation issued since it started covers
        its answer) leaves the table first: its subscribers keep it, and the request starts
        afresh instead of being served the answer the invalidation killed."""
        checked: Flight | None = None
        while True:
            with self._lock:
                flight = self._flights.get(key)
                if flight is None:
                    flight = Flight(key, subscribers=1, started_s=now_s, tags=tags)
                    self._flights[key] = flight
                    return flight, True
                if stale is None or checked is flight:
                    flight.subscribers += 1
                    flight.followers += 1
                    self.coalesced_total += 1
                    return flight, False
            if stale(flight):  # outside the lock: it may read the host's invalidation log
                with self._lock:
                    if self._flights.get(key) is flight:
                        del self._flights[key]
                        flight.superseded = True
            else:
                checked = flight

    def leave(self, flight: Flight) -> None:
        with self._lock, flight._cond:
            flight.subscribers -= 1

    def complete(self, flight: Flight, error: TierCacheError | None = None) -> None:
        """Remove the flight from the table (new requests start afresh) and wake subscribers."""
        with self._lock:
            if self._flights.get(flight.key) is flight:
                del self._flights[flight.key]
        flight.finish(error)

    def retire_if_abandoned(self, flight: Flight) -> bool:
        """Whether every requester has left `flight`; if so it leaves the table now, so no
        request joins it between this decision and its completion (one arriving later starts
        afresh)."""
        with self._lock, flight._cond:
            if flight.subscribers > 0:
                return False
            if self._flights.get(flight.key) is flight:
                del self._flights[flight.key]
            return True

    def in_flight(self) -> int:
        with self._lock:
            return len(self._flights)


def abandoned_error() -> TierCacheError:
    return Unavailable("generation abandoned: every requester cancelled")
