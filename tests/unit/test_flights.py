"""Single-flight coalescing (tiercache.exact.flights)."""

from __future__ import annotations

import threading

import pytest

from tiercache.errors import Unavailable
from tiercache.exact.flights import Flight, FlightTable, abandoned_error


def test_read_yields_chunks_before_and_after_subscribe() -> None:
    flight = Flight("k", subscribers=1)
    flight.append("a")
    reader = flight.read()
    assert next(reader) == "a"
    flight.append("b")
    flight.append("c")
    assert next(reader) == "b"
    assert next(reader) == "c"
    flight.finish()
    assert list(reader) == []
    assert flight.text() == "abc"


def test_read_waits_for_chunks_from_another_thread() -> None:
    flight = Flight("k", subscribers=1)
    got: list[str] = []
    done = threading.Event()

    def consume() -> None:
        got.extend(flight.read())
        done.set()

    threading.Thread(target=consume, daemon=True).start()
    flight.append("a")
    flight.append("b")
    assert not done.wait(0.05)  # still waiting: the flight is not finished
    flight.finish()
    assert done.wait(5)
    assert got == ["a", "b"]


def test_late_subscriber_reads_from_the_first_chunk() -> None:
    flight = Flight("k")
    flight.append("a")
    flight.append("b")
    flight.finish()
    assert list(flight.read()) == ["a", "b"]
    assert list(flight.read()) == ["a", "b"]


def test_read_raises_flight_error_after_chunks() -> None:
    flight = Flight("k")
    flight.append("partial")
    flight.finish(Unavailable("engine died"))
    reader = flight.read()
    assert next(reader) == "partial"
    with pytest.raises(Unavailable, match="engine died"):
        next(reader)


def test_read_stops_when_cancelled() -> None:
    flight = Flight("k")
    cancelled = threading.Event()
    flight.append("a")
    reader = flight.read(cancelled.is_set, poll_s=0.01)
    assert next(reader) == "a"
    cancelled.set()
    assert list(reader) == []  # returns although the flight never finishes
    assert not flight.done


def test_cancel_while_waiting_returns_promptly() -> None:
    flight = Flight("k")
    cancelled = threading.Event()
    done = threading.Event()
    got: list[str] = []

    def consume() -> None:
        got.extend(flight.read(cancelled.is_set, poll_s=0.01))
        done.set()

    threading.Thread(target=consume, daemon=True).start()
    assert not done.wait(0.05)
    cancelled.set()
    assert done.wait(5)
    assert got == []


def test_table_join_leads_then_follows() -> None:
    table = FlightTable()
    first, lead = table.join("k")
    second, follow = table.join("k")
    other, lead_other = table.join("other")
    assert (lead, follow, lead_other) == (True, False, True)
    assert second is first and other is not first
    assert (first.subscribers, first.followers) == (2, 1)
    assert table.coalesced_total == 1
    assert table.in_flight() == 2


def test_table_leave_and_abandoned() -> None:
    table = FlightTable()
    flight, _ = table.join("k")
    table.join("k")
    assert not flight.abandoned
    table.leave(flight)
    assert not flight.abandoned
    table.leave(flight)
    assert flight.abandoned
    assert table.in_flight() == 1  # leaving does not remove the flight; complete does


def test_table_complete_removes_and_finishes() -> None:
    table = FlightTable()
    flight, _ = table.join("k")
    flight.append("x")
    error = abandoned_error()
    table.complete(flight, error)
    assert table.in_flight() == 0
    assert flight.done and flight.error is error
    fresh, lead = table.join("k")
    assert lead and fresh is not flight
    assert table.coalesced_total == 0


def test_completing_a_stale_flight_keeps_the_new_one() -> None:
    table = FlightTable()
    old, _ = table.join("k")
    table.complete(old)
    new, _ = table.join("k")
    table.complete(old)
    assert table.in_flight() == 1
    assert table.join("k") == (new, False)


def test_abandoned_error_is_unavailable() -> None:
    assert isinstance(abandoned_error(), Unavailable)


def test_a_slow_cancellation_check_holds_up_no_writer() -> None:
    """A reader asks whether its requester cancelled outside the flight's lock: the chunk
    written meanwhile goes in at once (before, the writer and every `leave` waited for the
    answer, which python_backend's sender gets from Triton's core)."""
    flight = Flight("k", subscribers=1)
    asking, answer = threading.Event(), threading.Event()

    def is_cancelled() -> bool:
        asking.set()
        assert answer.wait(10)
        return False

    got: list[str] = []
    reader = threading.Thread(target=lambda: got.extend(flight.read(is_cancelled, poll_s=0.01)))
    reader.start()
    assert asking.wait(10)
    appended = threading.Thread(target=flight.append, args=("x",))
    appended.start()
    appended.join(2)
    written = not appended.is_alive()
    answer.set()
    flight.finish()
    reader.join(10)
    assert written
    assert got == ["x"]
