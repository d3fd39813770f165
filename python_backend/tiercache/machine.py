"""What the machine has left: host memory (the process's cgroup limit where there is one, else
the system's), GPU memory per device and per process through NVML, and free disk (issue 20).

Readings only; `tiercache.budgets` decides what the caches may hold from them. Every probe
reads the files or library a container actually exposes:

- Host memory. The limit is the memory cgroup's (v2 `memory.max`, v1 `memory.limit_in_bytes`,
  of this process's own group from `/proc/self/cgroup`; the mount's root when the group is not
  visible, as inside a cgroup namespace), bounded by the system's `MemTotal`; the use is the
  group's usage less its inactive page cache (`inactive_file`: the kernel reclaims it before it
  kills anything), or `MemTotal - MemAvailable` without a limit. What is available is the limit
  less the use, and never more than the system's `MemAvailable` (a group limit larger than the
  machine, or a machine full of other groups, leaves less than the limit says).
- GPU memory: NVML (`pynvml`, from the nvidia-ml-py package): each device's total, free and
  used bytes and what this process holds on it. No driver, no device or no package: no GPUs
  (logged once), never an error: the CPU engine runs on host memory alone.
- Disk: `shutil.disk_usage` of the state directory (L2, the semantic rows, converted weights);
  `DiskRoom` turns it into what L2 and the semantic rows may do (grow; turn over inside L2's
  file; inside half of it, with no new semantic rows).

The paths and the NVML module are injectable, so tests read a made-up `/proc` and `/sys` and an
NVML stand-in with NVML's own call surface (tests/unit/test_machine.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

UNLIMITED = 1 << 62  # cgroup v1 writes "no limit" as a number near 2**63


@dataclass(frozen=True, slots=True)
class HostReading:
    limit_bytes: int  # what this process's group may hold (the machine's when unlimited)
    used_bytes: int  # what counts against it, reclaimable page cache left out
    available_bytes: int  # what may still be taken without crossing the limit
    source: str  # "cgroup v2 <dir>", "cgroup v1 <dir>" or "meminfo"


@dataclass(frozen=True, slots=True)
class GpuReading:
    index: int
    name: str
    total_bytes: int
    free_bytes: int
    used_bytes: int
    process_bytes: int  # what this process holds on it (0 when NVML does not say)
    uuid: str = ""  # NVML's "GPU-..." identifier ("" when NVML does not say)


@dataclass(frozen=True, slots=True)
class DiskReading:
    path: str
    total_bytes: int
    free_bytes: int


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _stat_value(path: Path, key: str) -> int:
    """One `key value` line of a cgroup's memory.stat (0 when absent)."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _meminfo(proc: Path) -> dict[str, int]:
    """/proc/meminfo in bytes."""
    found: dict[str, int] = {}
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                found[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except (OSError, ValueError):
        pass
    return found


class HostMemoryProbe:
    """This process's host memory: see the module docstring."""

    def __init__(self, proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")):
        self.proc = proc
        self.cgroup_root = cgroup_root

    def _group(self) -> tuple[str, Path] | None:
        """("v2" | "v1", the memory group's directory) of this process, if one is mounted."""
        try:
            lines = (self.proc / "self" / "cgroup").read_text().splitlines()
        except OSError:
            return None
        v1_path = v2_path = None
        for line in lines:
            _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
            if controllers == "" and path:
                v2_path = path
            elif "memory" in controllers.split(","):
                v1_path = path
        if v1_path is not None and (self.cgroup_root / "memory").is_dir():
            return "v1", self._existing(
                self.cgroup_root / "memory", v1_path, "memory.limit_in_bytes"
            )
        if v2_path is not None and (self.cgroup_root / "cgroup.controllers").exists():
            return "v2", self._existing(self.cgroup_root, v2_path, "memory.max")
        return None

    @staticmethod
    def _existing(mount: Path, path: str, probe_file: str) -> Path:
        """The group's directory under `mount`, or the mount itself (a cgroup namespace shows
        this process's group as the root, a path that is not there). A directory that exists
        is the group's even without `probe_file` (its parent did not delegate the memory
        controller): the levels above it, each read for its own limit, still bind; taking the
        mount for it skipped them (a pod's 1 GiB read as the host's 61 GB)."""
        own = mount / path.lstrip("/")
        return own if (own / probe_file).exists() or own.is_dir() else mount

    def _levels(self, folder: Path, mount: Path) -> list[Path]:
        """The group's directory and each ancestor's up to the mount (a parent's limit binds
        too: a systemd slice, a pod)."""
        levels = [folder]
        here = folder
        while here != mount and mount in here.parents:
            here = here.parent
            levels.append(here)
        return levels

    def read(self) -> HostReading:
        """The reading; raises OSError when neither the cgroup nor /proc/meminfo gives one
        (a budget tick that raises holds every budget where it is, rather than reading 0 bytes
        available and squeezing every cache to its floor)."""
        info = _meminfo(self.proc)
        total = info.get("MemTotal", 0)
        system_available = info.get("MemAvailable", info.get("MemFree", 0))
        group = self._group()
        if group is not None:
            version, folder = group
            found = self._binding(version, folder, total)
            if found is not None:
                limit, used, available, level = found
                if system_available:
                    available = min(available, system_available)
                return HostReading(limit, used, available, f"cgroup {version} {level}")
        if not total:
            raise OSError(f"no host memory reading: {self.proc / 'meminfo'} gives no MemTotal")
        return HostReading(total, max(total - system_available, 0), system_available, "meminfo")

    def _binding(self, version: str, folder: Path, total: int) -> tuple[int, int, int, Path] | None:
        """(limit, used, available, level) of the level that leaves the least: each level with
        a limit is compared with that level's own use (a slice's limit with the slice's use,
        siblings included: this group's use alone overstated what is left). A level whose use
        cannot be read counts this group's (a lower bound); None when no level has a limit."""
        if version == "v2":
            mount = self.cgroup_root
            limit_file, usage_file, inactive_key = "memory.max", "memory.current", "inactive_file"
        else:
            mount = self.cgroup_root / "memory"
            limit_file = "memory.limit_in_bytes"
            usage_file, inactive_key = "memory.usage_in_bytes", "total_inactive_file"
        own_usage = _read_int(folder / usage_file)
        own_inactive = _stat_value(folder / "memory.stat", inactive_key)
        limits: list[tuple[int, Path, int | None, int]] = []
        for level in self._levels(folder, mount):
            limit = _read_int(level / limit_file)
            if limit is None or limit >= UNLIMITED:
                continue
            usage = _read_int(level / usage_file)
            inactive = _stat_value(level / "memory.stat", inactive_key)
            limits.append((limit, level, usage, inactive))
        if version == "v1":
            # the kernel's own minimum over the ancestors, for those a namespace hides: their
            # use is not visible, this group's stands for it
            inherited = _stat_value(folder / "memory.stat", "hierarchical_memory_limit")
            if 0 < inherited < UNLIMITED:
                limits.append((inherited, folder, own_usage, own_inactive))
        best: tuple[int, int, int, Path] | None = None
        for limit, level, usage, inactive in limits:
            if usage is None:
                usage, inactive = own_usage, own_inactive
            if usage is None:
                continue
            if total:
                limit = min(limit, total)
            used = max(usage - inactive, 0)
            available = max(limit - used, 0)
            if best is None or available < best[2]:
                best = (limit, used, available, level)
        return best


class GpuMemoryProbe:
    """Each GPU's memory through NVML (`nvml`: a module with pynvml's call surface; None:
    import pynvml). No NVML: `read()` is empty."""

    def __init__(self, nvml: Any | None = None, pid: int | None = None) -> None:
        self.pid = os.getpid() if pid is None else pid
        self._logged_s = -60.0
        self._nvml = nvml if nvml is not None else self._import()
        self.why_none = ""  # why there are no GPUs (no package, no driver, no device)
        if self._nvml is None:
            self.why_none = "pynvml is not installed"
            return
        try:
            self._nvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - NVMLError_* (no driver, no library)
            self.why_none = f"NVML did not start: {exc}"
            self._nvml = None
            log.info("no GPU memory to read: %s", self.why_none)

    @staticmethod
    def _import() -> Any | None:
        try:
            import pynvml
        except ImportError:
            return None
        return pynvml

    def read(self) -> list[GpuReading]:
        """Each card's reading; [] without NVML, or when NVML fails (a lost card, MIG; logged
        at most once a minute)."""
        try:
            return self._read()
        except Exception as exc:  # noqa: BLE001 - NVMLError_*: a reading, never a crash
            now = time.monotonic()
            if now - self._logged_s >= 60.0:
                self._logged_s = now
                log.warning("reading GPU memory through NVML failed: %s", exc)
            return []

    def _read(self) -> list[GpuReading]:
        nvml = self._nvml
        if nvml is None:
            return []
        readings = []
        for index in range(int(nvml.nvmlDeviceGetCount())):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            name = nvml.nvmlDeviceGetName(handle)
            held = 0
            try:
                for process in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    if int(process.pid) == self.pid and process.usedGpuMemory is not None:
                        held += int(process.usedGpuMemory)
            except Exception:  # noqa: BLE001 - not permitted in some containers: unknown
                held = 0
            try:
                uuid = nvml.nvmlDeviceGetUUID(handle)
                uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            except Exception:  # noqa: BLE001 - an older NVML, or not permitted: unknown
                uuid = ""
            readings.append(
                GpuReading(
                    index,
                    name.decode() if isinstance(name, bytes) else str(name),
                    int(memory.total),
                    int(memory.free),
                    int(memory.used),
                    held,
                    uuid,
                )
            )
        return readings

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001 - closing is best effort
                pass
            self._nvml = None


def nvml_card(
    device_index: int,
    readings: list[GpuReading],
    torch_uuid: str | None = None,
    visible: str | None = None,
    pci_order: bool = False,
) -> GpuReading | None:
    """NVML's reading of the card a process calls `cuda:<device_index>`: by the UUID torch
    gives for it (`torch_uuid`); else, through `CUDA_VISIBLE_DEVICES` (`visible`: indices or
    UUIDs; None: unset, every card visible), a UUID it names, or an index when CUDA numbers
    the cards as NVML does (`pci_order`: CUDA_DEVICE_ORDER=PCI_BUS_ID; CUDA's default order
    puts the fastest first) or there is one card; None when it cannot be told (a MIG instance,
    a list NVML does not know), so that no budget follows the wrong card."""

    def bare(uuid: str) -> str:
        return uuid.strip().lower().removeprefix("gpu-")

    if torch_uuid:
        found = [r for r in readings if r.uuid and bare(r.uuid) == bare(torch_uuid)]
        return found[0] if len(found) == 1 else None
    ordered = pci_order or len(readings) == 1
    if visible is None:
        if len(readings) == 1:  # the one card NVML sees is cuda:0
            return readings[0] if device_index == 0 else None
        if not ordered:
            return None
        return next((r for r in readings if r.index == device_index), None)
    names = [v.strip() for v in visible.split(",") if v.strip()]
    if not 0 <= device_index < len(names):
        return None
    name = names[device_index]
    if name.isdigit():
        if not ordered:
            return None
        return next((r for r in readings if r.index == int(name)), None)
    found = [r for r in readings if r.uuid and bare(r.uuid).startswith(bare(name))]
    return found[0] if len(found) == 1 else None


def read_disk(path: Path) -> DiskReading:
    """Free space of the filesystem holding `path` (its nearest existing parent)."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    usage = shutil.disk_usage(probe)
    return DiskReading(str(path), int(usage.total), int(usage.free))


ROOM, SHORT, CRITICAL = "room", "short", "critical"


class DiskRoom:
    """Whether the filesystem holding `path` keeps `headroom_bytes` free (`disk_headroom_bytes`):
    ROOM; SHORT under the headroom (L2 stops growing its file: it turns over inside the pages it
    has; the prompt vectors' L2 writes nothing); CRITICAL under half of it (L2 keeps half its
    file free, so its writes need no new disk; no new semantic rows are logged). An LMDB file
    never shrinks, so holding its size is all a cache can give back to the disk. Read at most
    every `interval_s` (a syscall; L2 asks on every write); a reading that fails keeps the last
    state. `headroom_bytes` 0: always ROOM. Thread-safe."""

    def __init__(
        self,
        path: Path,
        headroom_bytes: int,
        interval_s: float = 1.0,
        read: Callable[[Path], DiskReading] = read_disk,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.headroom_bytes = max(headroom_bytes, 0)
        self.interval_s = interval_s
        self._read = read
        self._clock = clock
        self._lock = threading.Lock()
        self._next_s = float("-inf")
        self._state = ROOM
        self.free_bytes: int | None = None  # as last read

    def state(self) -> str:
        if self.headroom_bytes <= 0:
            return ROOM
        now = self._clock()
        with self._lock:
            if now < self._next_s:
                return self._state
            self._next_s = now + self.interval_s
        try:
            free = self._read(self.path).free_bytes
        except OSError as exc:
            log.warning(
                "cannot read the free disk of %s (%s); L2 keeps its last state", self.path, exc
            )
            return self._state
        state = (
            ROOM
            if free >= self.headroom_bytes
            else (SHORT if free >= self.headroom_bytes // 2 else CRITICAL)
        )
        with self._lock:
            old, self._state, self.free_bytes = self._state, state, free
        if state != old:
            log.warning(
                "the disk of %s has %d MiB free (disk_headroom_bytes %d MiB): L2 %s",
                self.path,
                free >> 20,
                self.headroom_bytes >> 20,
                {
                    ROOM: "grows again",
                    SHORT: "stops growing its file (it turns over inside it)",
                    CRITICAL: "turns over inside half its file and llm logs no new semantic row",
                }[state],
            )
        return state
