"""Triton boundary, BLS: every call from one stage to another model goes through `BlsClient`.

A called model's typed error reaches the caller as the same typed error (`io.from_triton_error`):
a caller's fault (InvalidRequest, NotFound) keeps its message as the called model worded it, so
the client sees the same words whichever stage raised it; a dependency's failure (Unavailable,
capacity, internal) is prefixed with the callee's label, so the client learns which dependency
failed. Decoupled streams are handed to a `StreamKeeper` when read or abandoned (see there). A unary
call can be given a deadline (`Deadline`): Triton's own request timeout bounds only the time a
request waits in a scheduler's queue, not a callee that stopped answering; a decoupled stream can
be given one per response (`StreamDeadline`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from concurrent.futures import Future, wait
from typing import Any, TypeVar

import triton_python_backend_utils as pb_utils

from tiercache.errors import InvalidRequest, NotFound, TierCacheError, Unavailable
from tiercache.threads import NamedThread
from tiercache.triton.io import from_triton_error

T = TypeVar("T")


class StreamKeeper:
    """Holds the response iterators of finished decoupled BLS streams for `hold_s` seconds.

    Triton 2.51's Python stub (python_backend r24.10, and its head as of 2026) erases a finished
    stream from its iterator map on its stub-to-parent thread, without the GIL. When the model
    has already dropped its own reference, that erase destroys the iterator there, with its
    responses' numpy arrays: Python objects freed without the GIL corrupt the interpreter's heap
    and the stub segfaults later (docs/faults.md;
    `python -m tiercache_dev.diagnostics.repro_bls_streams`). Handing each stream's iterator to
    `keep()` once it is read (or abandoned) makes the model's reference the last one; it is
    dropped here, by a later `keep()` or `clear()`, holding the GIL.
    """

    def __init__(self, hold_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        if hold_s <= 0:
            raise ValueError(f"hold_s must be > 0, got {hold_s}")
        self.hold_s = hold_s
        self._clock = clock
        self._held: deque[tuple[float, object]] = deque()
        self._lock = threading.Lock()

    def keep(self, stream: object) -> None:
        """Hold `stream` for hold_s; drop those held longer (outside the lock)."""
        now = self._clock()
        expired = []
        with self._lock:
            self._held.append((now + self.hold_s, stream))
            while self._held and self._held[0][0] <= now:
                expired.append(self._held.popleft())
        expired.clear()

    def read(self, stream: Iterable[Any]) -> Iterator[Any]:
        """Iterate `stream` (a `request.exec(decoupled=True)` result), then keep it: also when
        the reader stops early, raises, or the generator reading it is closed."""
        try:
            yield from stream
        finally:
            self.keep(stream)

    def clear(self) -> None:
        """Drop every held stream (in finalize)."""
        with self._lock:
            held, self._held = self._held, deque()
        held.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)


def raise_if_error(response: Any, label: str) -> None:
    """Raise the typed error a BLS response carries, if any (see the module docstring)."""
    if not response.has_error():
        return
    error = response.error()
    code = error.code() if hasattr(error, "code") else None
    raise typed_error(str(error.message()), code, label)


def typed_error(message: str, code: int | None, label: str) -> TierCacheError:
    """`from_triton_error`, with the callee's `label` in front of a dependency's failure."""
    exc = from_triton_error(message, code)
    if isinstance(exc, (InvalidRequest, NotFound)):
        return exc
    return type(exc)(f"{label}: {exc.message}")


class Deadline:
    """Blocking calls run on one worker thread of their own (a daemon: a call that never returns
    does not keep the process from exiting), each waited for at most `timeout_s`.

    A call past its deadline raises `Unavailable` (naming `label`) in the caller and is left to
    finish on the worker; until it does, every later call is refused at once with `Unavailable`,
    so a callee that hangs costs one call one timeout, not every call one, and never more than
    one thread. Calls from several threads run one at a time, and a call's deadline counts from
    when it was made: one still queued at its deadline is withdrawn (it never runs). The late
    call goes on after the caller's `execute` returned; python_backend's `InferRequest::Exec`
    refuses BLS only while the model initializes or finalizes, and a call cut short by the
    stub's finalize just ends the worker's wait with its error.
    """

    MAX_TIMEOUT_S = 86_400.0  # past a day, "no deadline" is what is meant (and what overflows)

    def __init__(self, timeout_s: float, label: str) -> None:
        if not 0 < timeout_s <= self.MAX_TIMEOUT_S:
            raise ValueError(
                f"timeout_s must be > 0 and <= {self.MAX_TIMEOUT_S:g}, got {timeout_s}"
            )
        self.timeout_s = timeout_s
        self.label = label
        self.timed_out = 0  # calls with no answer within their deadline
        self.refused = 0  # calls refused while a late one was still out
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._late: Future[Any] | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._worker = NamedThread(target=self._work, name=f"deadline-{label}"[:15], daemon=True)
        self._worker.start()

    def _work(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:
                return
            call, future = item
            if not future.set_running_or_notify_cancel():
                continue  # withdrawn by its caller while queued
            try:
                result = call()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller as raised
                future.set_exception(exc)
            else:
                future.set_result(result)
            del call, future, item  # the late call's response is not kept past its end

    def run(self, call: Callable[[], T]) -> T:
        """`call()`'s result or its exception, or `Unavailable` past the deadline, while a late
        call is out, or once closed."""
        with self._lock:
            if self._closed:
                raise Unavailable(f"{self.label}: closed")
            late = self._late
            if late is not None:
                if not late.done():
                    self.refused += 1
                    raise Unavailable(
                        f"{self.label}: an earlier call has had no answer for more than "
                        f"{self.timeout_s:g} s; not calling again until it answers"
                    )
                self._late = None
            future: Future[T] = Future()
            self._calls.put((call, future))
        done, _ = wait([future], self.timeout_s)
        if future in done:
            return future.result()  # the callee's own exceptions too, TimeoutError included
        with self._lock:
            self.timed_out += 1
            # Withdrawn if it had not started (queued behind another call); else it is the
            # call the worker is stuck in (or will be), and later calls wait for its end.
            if not future.cancel() and (self._late is None or self._late.done()):
                self._late = future
        raise Unavailable(f"{self.label}: no answer within {self.timeout_s:g} s")

    def close(self) -> None:
        """Take no more calls; the worker ends after the call it is in, if any."""
        with self._lock:
            self._closed = True
            self._calls.put(None)


_END = object()  # a stream's reader has read its last response


class _StreamReader:
    """One stream opened and read on a daemon thread (python_backend's `exec(decoupled=True)`
    itself waits for the callee's first response): its responses, then `_END` or what it
    raised, go to `queue`. Once the caller stops reading, the rest is read and dropped:
    python_backend lets go of a stream's iterator only once its last response was read. The
    stream goes to `keep` when the thread is done with it; with `cancel_on_close`, a stream
    the caller left before its end is cancelled once (by the caller if it was open then, else
    here as it opens)."""

    def __init__(
        self,
        watch: StreamDeadline,
        open_stream: Callable[[], Iterable[Any]],
        keep: Callable[[object], None],
        cancel_on_close: bool,
    ) -> None:
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.abandoned = False  # the caller stopped reading: drop what comes
        self.finished = False
        self.stalled = False  # counted in the watch's stalled readers
        self.stream: Iterable[Any] | None = None  # once open
        self.lock = threading.Lock()  # `abandoned` against `stream`: one cancel
        self._cancel_on_close = cancel_on_close
        self._watch = watch
        self._thread = NamedThread(
            target=self._pump, args=(open_stream, keep), name="bls-stream", daemon=True
        )
        self._thread.start()

    def abandon(self, cancel: bool) -> None:
        """The caller stops reading; `cancel`: cancel the stream if it is open (else it is
        cancelled as it opens, with `cancel_on_close`)."""
        with self.lock:
            self.abandoned = True
            stream = self.stream
        if cancel and stream is not None:
            _cancel(stream)

    def _pump(
        self, open_stream: Callable[[], Iterable[Any]], keep: Callable[[object], None]
    ) -> None:
        responses = None
        try:
            responses = open_stream()
            with self.lock:
                self.stream = responses
                left = self.abandoned
            if left and self._cancel_on_close:
                _cancel(responses)
            for response in responses:
                if not self.abandoned:
                    self.queue.put(response)
            self.queue.put(_END)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller as raised
            self.queue.put(exc)
        finally:
            if responses is not None:
                keep(responses)  # here, with the GIL, as StreamKeeper needs
            del responses
            self._watch._finished(self)


def _cancel(stream: object) -> None:
    """python_backend's cancel of a BLS stream (>= 25.05; none before)."""
    cancel: Callable[[], None] | None = getattr(stream, "cancel", None)
    if cancel is not None:
        cancel()


class StreamDeadline:
    """Waits at most `idle_s` for each response of a decoupled stream (the first counted from
    the call). A stream is opened and read on a daemon thread of its own; past the wait the
    caller gets `Unavailable` (naming `label`) and the thread is left to read the stream to its
    end (dropping what it reads). While `max_stalled` such threads are still out, new streams
    are refused at once: a callee that stopped answering holds the threads of the calls that
    were waiting on it then, and at most `max_stalled` - 1 more. Each stream costs a thread
    start and a queue hand-off per response (tens of microseconds: for engine generations and
    adapter loads, not for hits)."""

    MAX_IDLE_S = Deadline.MAX_TIMEOUT_S

    def __init__(self, idle_s: float, label: str, max_stalled: int = 4) -> None:
        if not 0 < idle_s <= self.MAX_IDLE_S:
            raise ValueError(f"idle_s must be > 0 and <= {self.MAX_IDLE_S:g}, got {idle_s}")
        if max_stalled < 1:
            raise ValueError(f"max_stalled must be >= 1, got {max_stalled}")
        self.idle_s = idle_s
        self.label = label
        self.max_stalled = max_stalled
        self.timed_out = 0  # streams that went idle_s without a response
        self.refused = 0  # streams refused while max_stalled readers were out
        self._stalled = 0
        self._lock = threading.Lock()

    def admit(self) -> None:
        """Unavailable while `max_stalled` stalled streams are still being read."""
        with self._lock:
            if self._stalled >= self.max_stalled:
                self.refused += 1
                raise Unavailable(
                    f"{self.label}: {self._stalled} earlier calls have had no response for more "
                    f"than {self.idle_s:g} s; not calling again until one answers"
                )

    def read(
        self,
        open_stream: Callable[[], Iterable[Any]],
        keep: Callable[[object], None],
        cancel_on_close: bool = False,
    ) -> Generator[Any, None, None]:
        """The responses of the stream `open_stream()` opens (on the reader's thread), in order,
        each waited for at most idle_s (then `Unavailable`); what opening or the stream raises,
        raised here. `keep` gets the stream once its reader is done with it;
        `cancel_on_close`: a stream the caller stops reading before its end is cancelled."""
        reader = _StreamReader(self, open_stream, keep, cancel_on_close)
        ended = False
        try:
            while True:
                try:
                    item = reader.queue.get(timeout=self.idle_s)
                except queue.Empty:
                    with self._lock:
                        try:  # one that came as the wait ended is taken, not failed
                            item = reader.queue.get_nowait()
                        except queue.Empty:
                            item = None
                            self.timed_out += 1
                            if not reader.finished:
                                reader.stalled = True
                                self._stalled += 1
                    if item is None:
                        raise Unavailable(
                            f"{self.label}: no response within {self.idle_s:g} s"
                        ) from None
                if item is _END:
                    ended = True
                    return
                if isinstance(item, BaseException):  # a response is never one
                    raise item
                yield item
        finally:
            reader.abandon(cancel_on_close and not ended)

    def stalled(self) -> int:
        """Readers past their wait that are still out."""
        with self._lock:
            return self._stalled

    def _finished(self, reader: _StreamReader) -> None:
        with self._lock:
            reader.finished = True
            if reader.stalled:
                reader.stalled = False
                self._stalled -= 1


class BlsClient:
    """Calls to one Triton model from inside a stage.

    `label` names the callee in the messages of its failures ("engine torch_llm", "embedder");
    `keeper` holds finished decoupled streams (one per model process is enough); `timeout_s`
    bounds each unary call (`infer`, through a `Deadline`); `stream_idle_s` each response of a
    stream (`StreamDeadline`); None waits as long as the callee.
    """

    def __init__(
        self,
        model_name: str,
        label: str = "",
        keeper: StreamKeeper | None = None,
        timeout_s: float | None = None,
        stream_idle_s: float | None = None,
    ) -> None:
        self.model_name = model_name
        self.label = label or model_name
        self.keeper = keeper if keeper is not None else StreamKeeper()
        self.deadline = Deadline(timeout_s, self.label) if timeout_s is not None else None
        self.stream_deadline = (
            StreamDeadline(stream_idle_s, self.label) if stream_idle_s is not None else None
        )

    def request(self, inputs: Sequence[Any], outputs: Sequence[str]) -> Any:
        """The `pb_utils.InferenceRequest` of one call (for `infer`/`stream`)."""
        return pb_utils.InferenceRequest(
            model_name=self.model_name,
            inputs=list(inputs),
            requested_output_names=list(outputs),
        )

    def infer(self, inputs: Sequence[Any], outputs: Sequence[str]) -> Any:
        """One unary call; its response, or the callee's typed error raised (`Unavailable`
        past the deadline, with one)."""
        request = self.request(inputs, outputs)
        if self.deadline is None:
            response = request.exec()
        else:
            response = self.deadline.run(request.exec)
        raise_if_error(response, self.label)
        return response

    def close(self) -> None:
        """Release the deadline's worker (streams held by the keeper stay its concern)."""
        if self.deadline is not None:
            self.deadline.close()

    def stream(
        self, inputs: Sequence[Any], outputs: Sequence[str], *, cancel_on_close: bool = False
    ) -> Generator[Any, None, None]:
        """A decoupled call's responses, in order; the first error response is raised typed.
        The stream goes to the keeper when it ends, is abandoned or fails. `cancel_on_close`
        also cancels what the callee has not sent yet (python_backend >= 25.05; a no-op once
        the stream has ended, and on older versions). With `stream_idle_s`, a response that
        does not come within it raises `Unavailable`, as does a call while too many streams
        are stalled (`StreamDeadline`)."""
        watch = self.stream_deadline
        if watch is not None:
            watch.admit()  # refused before anything is sent
        request = self.request(inputs, outputs)
        reading: Generator[Any, None, None] | None = None
        if watch is None:
            responses = request.exec(decoupled=True)
        else:
            responses = reading = watch.read(
                lambda: request.exec(decoupled=True), self.keeper.keep, cancel_on_close
            )
        try:
            for response in responses:
                raise_if_error(response, self.label)
                yield response
        finally:
            if reading is not None:
                reading.close()  # its reader cancels, drops what comes, then keeps the stream
            else:
                if cancel_on_close:
                    _cancel(responses)
                self.keeper.keep(responses)
