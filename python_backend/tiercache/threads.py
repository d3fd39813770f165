"""Threads the kernel knows by name.

Python (before 3.14) names its threads for itself only: to the kernel, and so to `top -H`,
`perf`, `py-spy`'s native view and `/proc/<pid>/task/<tid>/comm` (what the soak comparison
groups a process's CPU by), every thread of a stage's stub is the stub itself. `NamedThread`
starts by giving its kernel thread its Python name (less a leading "tiercache-", which every
thread of a stage would share, and cut to the kernel's 15 bytes: `tiercache-invalidations` and
`tiercache-restart-sweep` are `invalidations` and `restart-sweep` there, not both
`tiercache-xxxxx`); a pool gives its workers theirs with `initializer=name_this_thread`."""

from __future__ import annotations

import threading
from pathlib import Path

KERNEL_NAME_BYTES = 15  # TASK_COMM_LEN less its terminating NUL
_SHARED_PREFIX = "tiercache-"  # left out of a kernel name: it tells no thread from another
_COMM = Path("/proc/thread-self/comm")


def name_this_thread(name: str | None = None) -> bool:
    """Give the calling thread the kernel name `name` (default: its Python name), less a
    leading "tiercache-" and cut to KERNEL_NAME_BYTES; False where it cannot (not Linux, no
    /proc), which changes nothing else."""
    if name is None:
        name = threading.current_thread().name
    name = name.removeprefix(_SHARED_PREFIX) or name
    try:
        _COMM.write_bytes(name.encode("ascii", "replace")[:KERNEL_NAME_BYTES])
    except OSError:
        return False
    return True


class NamedThread(threading.Thread):
    """A `threading.Thread` that gives itself its name in the kernel too, as it starts."""

    def run(self) -> None:
        name_this_thread()
        super().run()
