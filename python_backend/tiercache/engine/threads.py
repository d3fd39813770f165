"""torch's intra-op thread count in a stage process that runs torch (issue 15).

The engine (`torch_llm`) and the embedder each run torch in their own stage process. With torch's
default, each takes one intra-op thread per core, and libgomp's workers spin for a while after
every parallel region: on a small host the two processes take the cores from each other, and the
engine, the critical path, slows down while the cache serves. So each torch stage sets its
thread count from its `torch_threads` parameter (`set_torch_threads`, first thing in its open
function, before the weights load). Its model.py also sets OMP_WAIT_POLICY=PASSIVE (workers
sleep instead of spinning) and TOKENIZERS_PARALLELISM=false unless the environment sets them,
first thing: libgomp reads its variables once, when torch loads it.

Torch-free at import (torch is imported inside `set_torch_threads`), so tiercache.config can
import it without loading torch.
"""

from __future__ import annotations

import enum
import logging
import os
import re

from tiercache.errors import ConfigError

log = logging.getLogger(__name__)

AUTO = "auto"
TORCH_THREADS_PATTERN = r"auto|[1-9]|[1-9][0-9]|1[0-9][0-9]|2[0-4][0-9]|25[0-6]"  # 1 to 256
"""What a `torch_threads` parameter may be: `auto`, or a thread count >= 1."""


class ThreadRole(enum.Enum):
    """Which torch stage a `torch_threads: auto` is resolved for (`auto_thread_count`)."""

    ENGINE = "engine"
    EMBEDDER = "embedder"


EMBEDDER_CPU_SHARE = 8
"""`auto` gives the embedder one thread per this many usable CPUs (at least 1) and the engine the
rest (at least 1): 1 and 1 on 2 CPUs, 1 and 3 on 4, 2 and 14 on 16. Chosen by measurement on 2
CPUs (docs/soak.md, "Issue 15"): the engine with one thread generated more tokens per second
than with two passive ones, behind tiercache and behind Triton's response cache alike, and left
a core for the stages and the embedder, which embeds one short prompt per miss. Larger
machines follow the same rule without a measurement of their own."""


def auto_thread_count(role: ThreadRole, cpus: int) -> int:
    """The threads `auto` means for `role` on `cpus` usable CPUs (see EMBEDDER_CPU_SHARE)."""
    embedder = max(1, cpus // EMBEDDER_CPU_SHARE)
    return embedder if role is ThreadRole.EMBEDDER else max(1, cpus - embedder)


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask (which a container's cpuset narrows;
    a CPU quota such as `docker --cpus` does not), else os.cpu_count() where there is no mask."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def torch_thread_count(setting: str, cpus: int, role: ThreadRole) -> int:
    """The intra-op thread count a `torch_threads` setting means on `cpus` usable CPUs: the
    number itself, or for `auto` `auto_thread_count(role, cpus)`. ConfigError for anything
    else."""
    if not re.fullmatch(TORCH_THREADS_PATTERN, setting):
        raise ConfigError(f"torch_threads must be auto or an integer >= 1, got {setting!r}")
    if setting == AUTO:
        return auto_thread_count(role, cpus)
    return int(setting)


PASS_THREADS_PATTERN = r"auto|[0-9]|[1-9][0-9]|1[0-9][0-9]|2[0-4][0-9]|25[0-6]"
"""What a `pass_threads` parameter may be: `auto`, 0 (off), or a thread count up to 256."""


def pass_thread_count(setting: str, cpus: int) -> int:
    """The torch threads a `pass_threads` setting means for passes over several tokens on `cpus`
    usable CPUs: 0 (off: torch_threads for every pass), the count itself, or for `auto` every
    usable CPU (a one-token step is bound by memory and keeps torch_threads; a pass over many
    tokens is bound by arithmetic and gains from every core, docs/speculation.md). ConfigError
    for anything else."""
    if not re.fullmatch(PASS_THREADS_PATTERN, setting):
        raise ConfigError(f"pass_threads must be auto or an integer 0-256, got {setting!r}")
    return max(1, cpus) if setting == AUTO else int(setting)


def set_torch_threads(setting: str, role: ThreadRole, cpus: int | None = None) -> int:
    """Set torch's intra-op threads in this process (torch.set_num_threads, which later threads
    also take) from a `torch_threads` setting; `cpus` defaults to `usable_cpus()`. Logs one
    line and returns the count."""
    import torch  # only here: the module stays importable before torch loads

    usable = usable_cpus() if cpus is None else cpus
    threads = torch_thread_count(setting, usable, role)
    torch.set_num_threads(threads)
    if setting == AUTO:
        log.info("torch threads: %d (auto from %d CPUs)", threads, usable)
    else:
        log.info("torch threads: %d (torch_threads; %d CPUs usable)", threads, usable)
    return threads
