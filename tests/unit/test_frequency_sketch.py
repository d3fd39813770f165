"""tiercache.frequency_sketch: TinyLFU's aging count-min sketch with a doorkeeper."""

from __future__ import annotations

import hashlib

import pytest

from tiercache.frequency_sketch import FrequencySketch, key_hash


def test_counts_each_request_up_to_the_cap() -> None:
    sketch = FrequencySketch(64)
    assert sketch.estimate("a") == 0
    for expected in range(1, 17):
        sketch.add("a")
        assert sketch.estimate("a") == expected  # the doorkeeper's bit, then the counters
    sketch.add("a")
    assert sketch.estimate("a") == 16  # counters saturate at 15, plus the doorkeeper
    assert sketch.estimate("b") == 0


def test_never_undercounts_among_many_keys() -> None:
    sketch = FrequencySketch(100, horizon=1000)  # no aging within this test
    truth = {f"k{i}": i % 7 for i in range(2000)}
    for key, count in truth.items():
        for _ in range(count):
            sketch.add(key)
    estimates = {key: sketch.estimate(key) for key in truth}
    assert all(estimates[key] >= count for key, count in truth.items())  # count-min's guarantee
    over = sum(estimates[key] - count for key, count in truth.items())
    assert over <= len(truth) * 0.05  # sized 25 counters per key of capacity: collisions are rare


def test_aging_halves_every_count_and_empties_the_doorkeeper() -> None:
    # digest keys hash the same in every run (a str's hash is salted per process, and in a
    # sketch this small two str keys collided in every row about once in 500 runs)
    hot, once, filler = (hashlib.sha256(name).digest() for name in (b"hot", b"once", b"filler"))
    sketch = FrequencySketch(1, horizon=20)  # ages after 20 additions
    for _ in range(9):
        sketch.add(hot)
    sketch.add(once)
    assert (sketch.estimate(hot), sketch.estimate(once)) == (9, 1)
    for _ in range(10):
        sketch.add(filler)
    assert (sketch.additions, sketch.estimate(hot)) == (20, 9)  # full, not aged yet
    sketch.add(filler)  # the 21st ages first, then counts
    assert sketch.additions == 10 + 1
    assert sketch.estimate(hot) == 4  # counters 8 -> 4, the doorkeeper's bit gone
    assert sketch.estimate(once) == 0


def test_digest_keys_hash_the_same_in_every_process() -> None:
    digest = hashlib.sha256(b"block").digest()
    assert key_hash(digest) == int.from_bytes(digest[:8], "little")  # not Python's salted hash


def test_sizes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        FrequencySketch(0)


def test_add_returns_the_estimate_after_it_also_across_an_aging() -> None:
    sketch = FrequencySketch(1, horizon=10)  # ages every 10 additions, then every 5
    for step in range(60):
        key = f"k{step % 3}"
        returned = sketch.add(key)
        assert returned == sketch.estimate(key) >= 1  # never halved away right after counting
