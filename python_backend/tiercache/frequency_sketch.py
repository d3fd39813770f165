"""How often each key was asked for lately, in fixed memory: TinyLFU's frequency sketch.

A count-min sketch (four rows of 8-bit counters saturating at 15) behind a Bloom doorkeeper, with
aging: the first request for a key only sets its doorkeeper bits, later ones count in the rows, and
once `horizon` x `capacity` additions have been made all counters halve, the doorkeeper empties
and the count of additions halves too (so later agings come every half period), so the estimate
follows a workload that shifts (Einziger, Friedman and Manes, "TinyLFU: A Highly Efficient Cache
Admission Policy", ACM TOS 2017; Caffeine's `FrequencySketch` is the well-known implementation).

Sized for a horizon rather than for the cache: a prefix cache's blocks come back hundreds of
requests later (Mooncake's conversation trace: median 500 requests between a block's first and
second use), far beyond what the cache holds, so the sketch must remember keys it no longer holds.
`capacity` is the number of keys the cache holds; the sketch keeps `horizon` times that many
additions before aging, and has `width` times that many counters per row (docs/kv_reuse.md gives
the measurements that chose 100 and 25). Memory: about 4 x 25 + 100 bytes per key of capacity
(counters, and a doorkeeper of 8 bits per addition of a period), rounded up to powers of two.

Written here rather than taken from a library: no maintained Python package offers an aging
count-min sketch with a doorkeeper, and the hit path needs it cheap (`add` is a few integer
operations and byte reads; `python -m tiercache_dev.bench.policy` measures it).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

_MASK64 = (1 << 64) - 1
_HALVE = bytes(value >> 1 for value in range(256))  # aging in C speed: bytes.translate
_MAX_COUNT = 15
_ROWS = 4
_DOOR_HASHES = 3

KeyHash = Callable[[Hashable], int]


def key_hash(key: Hashable) -> int:
    """A key's 64 bits for the sketch: the first 8 bytes of a digest key (KV block hashes are
    SHA-256 already, so this is unsalted and the same in every process), Python's hash otherwise
    (salted per process: fine, the sketch is never stored or shared)."""
    if isinstance(key, bytes) and len(key) >= 8:
        return int.from_bytes(key[:8], "little")
    return hash(key) & _MASK64


def _mix(value: int) -> int:
    """splitmix64's finalizer: spreads small or sequential integers (trace ids) over 64 bits."""
    value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    value = (value ^ (value >> 27)) * 0x94D049BB133111EB & _MASK64
    return value ^ (value >> 31)


def _power_of_two(at_least: int) -> int:
    return 1 << max(at_least - 1, 1).bit_length()


def sketch_bytes(capacity: int, *, horizon: int = 100, width: int = 25) -> int:
    """The bytes a `FrequencySketch` of these dimensions holds (its counters and doorkeeper)."""
    return _ROWS * _power_of_two(capacity * width) + (_power_of_two(capacity * horizon * 8) >> 3)


class FrequencySketch:
    """Estimated recent request count per key (0 for a key never added, at most 16).

    Not thread-safe (its policy's store calls it under its own lock). Fixed size: a policy whose
    cache outgrows `capacity` builds a larger sketch."""

    __slots__ = (
        "_door",
        "_door_mask",
        "_hash",
        "_mask",
        "_period",
        "_rows",
        "additions",
        "capacity",
    )

    def __init__(
        self, capacity: int, *, horizon: int = 100, width: int = 25, hash_fn: KeyHash = key_hash
    ) -> None:
        if capacity < 1 or horizon < 1 or width < 1:
            raise ValueError(
                f"capacity, horizon and width must be >= 1, got {capacity}, {horizon}, {width}"
            )
        self._hash = hash_fn
        self.capacity = capacity
        self._period = capacity * horizon
        size = _power_of_two(capacity * width)
        self._mask = size - 1
        self._rows = [bytearray(size) for _ in range(_ROWS)]
        # ~8 bits per addition of a period: about 3 % false positives with three hashes even if
        # every addition of the period is a new key (256 bits per key of capacity were 8.5 %)
        door_bits = _power_of_two(self._period * 8)
        self._door = bytearray(door_bits >> 3)
        self._door_mask = door_bits - 1
        self.additions = 0  # since the last aging

    @property
    def nbytes(self) -> int:
        """The bytes its counters and doorkeeper hold."""
        return sum(len(row) for row in self._rows) + len(self._door)

    def _indexes(self, key: Hashable) -> tuple[int, int]:
        """Two 32-bit numbers for double hashing (index i = first + i * step): a digest's own
        bytes (uniform already), or the mixed hash of any other key."""
        if isinstance(key, bytes) and len(key) >= 8 and self._hash is key_hash:
            return int.from_bytes(key[:4], "little"), int.from_bytes(key[4:8], "little") | 1
        mixed = _mix(self._hash(key))
        return mixed & 0xFFFFFFFF, (mixed >> 32) | 1

    def add(self, key: Hashable) -> int:
        """One more request for `key`; returns its estimate after it (`estimate`'s value), so a
        policy ranking on every request hashes once. Unrolled: this runs on every cache hit.
        Ages first when the period is full, so the request just counted is never halved away."""
        if self.additions >= self._period:
            self.age()
        first, step = self._indexes(key)
        door, door_mask = self._door, self._door_mask
        bit0 = first & door_mask
        bit1 = (first + step) & door_mask
        bit2 = (first + 2 * step) & door_mask
        rows, mask = self._rows, self._mask
        row0, row1, row2, row3 = rows
        index0 = first & mask
        index1 = (first + step) & mask
        index2 = (first + 2 * step) & mask
        index3 = (first + 3 * step) & mask
        least = min(row0[index0], row1[index1], row2[index2], row3[index3])
        if (
            door[bit0 >> 3] & (1 << (bit0 & 7))
            and door[bit1 >> 3] & (1 << (bit1 & 7))
            and door[bit2 >> 3] & (1 << (bit2 & 7))
        ):
            if least < _MAX_COUNT:  # conservative update: only the counters at the minimum
                if row0[index0] == least:
                    row0[index0] = least + 1
                if row1[index1] == least:
                    row1[index1] = least + 1
                if row2[index2] == least:
                    row2[index2] = least + 1
                if row3[index3] == least:
                    row3[index3] = least + 1
                least += 1
        else:
            door[bit0 >> 3] |= 1 << (bit0 & 7)
            door[bit1 >> 3] |= 1 << (bit1 & 7)
            door[bit2 >> 3] |= 1 << (bit2 & 7)
        self.additions += 1
        return least + 1

    def estimate(self, key: Hashable) -> int:
        """Recent requests for `key`: the least of its counters, plus one if the doorkeeper
        holds it."""
        first, step = self._indexes(key)
        rows, mask = self._rows, self._mask
        count = min(rows[i][(first + i * step) & mask] for i in range(_ROWS))
        door, door_mask = self._door, self._door_mask
        for i in range(_DOOR_HASHES):
            bit = (first + i * step) & door_mask
            if not door[bit >> 3] & (1 << (bit & 7)):
                return count
        return count + 1

    def age(self) -> None:
        """Halve every counter and empty the doorkeeper (each key's weight halves)."""
        self._rows = [bytearray(row.translate(_HALVE)) for row in self._rows]
        self._door = bytearray(len(self._door))
        self.additions //= 2

    def clear(self) -> None:
        for row in self._rows:
            row[:] = bytes(len(row))
        self._door[:] = bytes(len(self._door))
        self.additions = 0
