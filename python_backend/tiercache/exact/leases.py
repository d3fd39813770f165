"""Cross-replica coalescing: one generation per digest across every replica sharing a Redis.

Inside one process, `tiercache.exact.flights` coalesces identical misses. Across replicas, the
leader of a local flight first takes a lease in Redis
(`SET <prefix>lease:<digest> <token> NX PX ttl`):

- Taken: it generates, the lease renewed every `ttl_s / 3` by one background thread while it
  does, stores the answer (in L3 among others), then releases the lease with a compare-and-delete
  script (only its own token is deleted, never a lease that expired and was taken by another).
- Held by another replica: it waits for that replica's answer, polling the cache (L2, L3) every
  `poll_s`, for at most `wait_s`. If the lease disappears without an answer (the holder died and
  the lease expired after at most `ttl_s`, or its generation failed or was not stored), it tries
  to take the lease itself.
- Redis unavailable: no lease, it generates (the local flight still coalesces this replica).

A leader that loses its lease (a renewal found another token or none) keeps generating: at worst
two replicas generate the same answer, never a wrong one. Leases are not signed: one that no
replica could have set (no expiry, or longer than `ttl_s`, which every acquisition and renewal
sets) is taken over rather than waited for, so a lease planted in Redis cannot make every miss
of its digest wait `wait_s`. Replicas sharing a Redis must share `lease_ttl_s`.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from tiercache.log_throttle import LogThrottle
from tiercache.threads import NamedThread

if TYPE_CHECKING:
    from tiercache.exact.redis_tier import RedisLink

log = logging.getLogger(__name__)

# KEYS[1] lease, ARGV[1] token, ARGV[2] ttl in ms: take the lease when nobody holds it (1), or
# when what holds it cannot be a replica's lease (2: no expiry, or longer than a lease's ttl,
# which every acquisition and renewal sets: planted by whoever can write Redis, it would make
# every miss of that digest wait `wait_s`); 0 when another replica holds it.
_ACQUIRE = """
if redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return 1
end
local left = redis.call('pttl', KEYS[1])
if left == -1 or left > tonumber(ARGV[2]) then
  redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 2
end
return 0
"""
# KEYS[1] lease, ARGV[1] token: delete only our own lease.
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('del', KEYS[1])
end
return 0
"""
# KEYS[1] lease, ARGV[1] token, ARGV[2] ttl in ms: extend only our own lease.
_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""


class LeaseState(str, Enum):
    ACQUIRED = "acquired"  # this replica generates
    HELD = "held"  # another replica generates: wait for its answer
    UNAVAILABLE = "unavailable"  # Redis cannot be asked: generate without a lease


@dataclass(frozen=True, slots=True)
class Lease:
    name: str  # the Redis key
    token: str  # unique to this acquisition


@dataclass(frozen=True, slots=True)
class LeaseStats:
    acquired: int
    held_elsewhere: int  # acquisitions refused because another replica held the lease
    unavailable: int
    lost: int  # renewals that found the lease gone or taken
    active: int


class LeaseCoordinator:
    """Leases on one Redis, for one process. `close()` releases the leases still held (so other
    replicas need not wait for them to expire) and joins the renewal thread."""

    def __init__(
        self,
        link: RedisLink,
        ttl_s: float = 10.0,
        wait_s: float = 60.0,
        poll_s: float = 0.05,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if ttl_s <= 0 or wait_s < 0 or poll_s <= 0:
            raise ValueError(f"bad lease timing: ttl_s={ttl_s}, wait_s={wait_s}, poll_s={poll_s}")
        self.link = link
        self.ttl_s = ttl_s
        self.wait_s = wait_s
        self.poll_s = poll_s
        self._sleep = sleep
        self._owner = uuid.uuid4().hex
        self._take = link.client.register_script(_ACQUIRE)
        self._release = link.client.register_script(_RELEASE)
        self._renew = link.client.register_script(_RENEW)
        # by token: a lease lost (expired) and a newer one for the same digest may both be
        # held in this process; releasing the old one must not stop renewing the new one
        self._active: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._acquired = self._held = self._unavailable = self._lost = 0
        self._replaced = 0  # leases taken over that no replica could have set (`_ACQUIRE`)
        self._replaced_log = LogThrottle()

    def _name(self, digest: str) -> str:
        return self.link.key("lease", digest)

    def acquire(self, digest: str) -> tuple[LeaseState, Lease | None]:
        lease = Lease(self._name(digest), f"{self._owner}:{uuid.uuid4().hex}")
        px = max(1, int(self.ttl_s * 1000))
        missing = object()
        taken: Any = self.link.call(
            lambda c: self._take(keys=[lease.name], args=[lease.token, px]), missing
        )
        with self._lock:
            if taken is missing:
                self._unavailable += 1
                return LeaseState.UNAVAILABLE, None
            if not int(taken):
                self._held += 1
                return LeaseState.HELD, None
            self._acquired += 1
            self._replaced += int(taken) == 2
            self._active[lease.token] = lease
        if int(taken) == 2 and self._replaced_log.ready():
            log.warning(
                "took over %s, which held no replica's lease (no expiry, or one longer than "
                "lease_ttl_s): planted in Redis, or left by a replica with a longer lease_ttl_s "
                "(give every replica the same); %d so far",
                lease.name,
                self._replaced,
            )
        self._ensure_renewer()
        return LeaseState.ACQUIRED, lease

    def held(self, digest: str) -> bool | None:
        """Whether some replica holds the lease; None when Redis cannot be asked."""
        found = self.link.call(lambda c: c.exists(self._name(digest)), None)
        return None if found is None else bool(found)

    def pause(self) -> None:
        """One polling interval (injected sleep)."""
        self._sleep(self.poll_s)

    def release(self, lease: Lease) -> bool:
        """Delete the lease if it is still ours; False if it expired or Redis is away."""
        with self._lock:
            self._active.pop(lease.token, None)
        released = self.link.call(lambda c: self._release(keys=[lease.name], args=[lease.token]), 0)
        return bool(released)

    def _ensure_renewer(self) -> None:
        with self._lock:
            if self._thread is not None or self._stop.is_set():
                return
            self._thread = NamedThread(target=self._renew_loop, name="tiercache-leases")
            self._thread.daemon = True
            self._thread.start()

    def _renew_loop(self) -> None:
        px = max(1, int(self.ttl_s * 1000))
        while not self._stop.wait(self.ttl_s / 3):
            with self._lock:
                leases = list(self._active.values())
            for lease in leases:
                renewed = self.link.call(
                    lambda c, le=lease: self._renew(keys=[le.name], args=[le.token, px]),  # type: ignore[misc]
                    None,
                )
                if renewed is not None and not renewed:
                    with self._lock:
                        still = self._active.pop(lease.token, None) is not None
                        self._lost += still
                    if still:
                        log.warning(
                            "lease %s was lost while generating (expired or taken)", lease.name
                        )

    def stats(self) -> LeaseStats:
        with self._lock:
            return LeaseStats(
                self._acquired, self._held, self._unavailable, self._lost, len(self._active)
            )

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            thread, self._thread = self._thread, None
            leases = list(self._active.values())
        if thread is not None:
            thread.join()
        for lease in leases:
            self.release(lease)
