"""tiercache.machine: host memory from a made-up /proc and /sys (cgroup v2, v1, none), GPU
memory through a stand-in with NVML's call surface, and free disk."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tiercache.machine import (
    CRITICAL,
    ROOM,
    SHORT,
    DiskReading,
    DiskRoom,
    GpuMemoryProbe,
    GpuReading,
    HostMemoryProbe,
    nvml_card,
    read_disk,
)

GIB = 1 << 30


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def proc_tree(tmp_path: Path, cgroup: str, total_gib: int = 16, available_gib: int = 12) -> Path:
    proc = tmp_path / "proc"
    write(proc / "self" / "cgroup", cgroup)
    write(
        proc / "meminfo",
        f"MemTotal: {total_gib * GIB // 1024} kB\nMemFree: 1 kB\n"
        f"MemAvailable: {available_gib * GIB // 1024} kB\n",
    )
    return proc


def test_cgroup_v2_limit_less_reclaimable_cache(tmp_path: Path) -> None:
    proc = proc_tree(tmp_path, "0::/tenant/serve\n")
    sys = tmp_path / "sys"
    write(sys / "cgroup.controllers", "memory\n")
    group = sys / "tenant" / "serve"
    write(group / "memory.max", f"{4 * GIB}\n")
    write(group / "memory.current", f"{3 * GIB}\n")
    write(group / "memory.stat", f"anon 1\ninactive_file {GIB}\n")
    reading = HostMemoryProbe(proc, sys).read()
    assert (reading.limit_bytes, reading.used_bytes, reading.available_bytes) == (
        4 * GIB,
        2 * GIB,
        2 * GIB,
    )
    assert reading.source == f"cgroup v2 {group}"


def test_cgroup_v1_limit_and_a_namespace_that_shows_the_group_as_the_root(tmp_path: Path) -> None:
    proc = proc_tree(tmp_path, "4:memory:/not/visible/here\n0::/\n")
    sys = tmp_path / "sys"
    mount = sys / "memory"
    write(mount / "memory.limit_in_bytes", f"{8 * GIB}\n")
    write(mount / "memory.usage_in_bytes", f"{5 * GIB}\n")
    write(mount / "memory.stat", f"cache 9\ntotal_inactive_file {GIB}\n")
    reading = HostMemoryProbe(proc, sys).read()
    assert (reading.limit_bytes, reading.used_bytes, reading.available_bytes) == (
        8 * GIB,
        4 * GIB,
        4 * GIB,
    )
    assert reading.source == f"cgroup v1 {mount}"


def test_the_machine_bounds_what_a_generous_group_says(tmp_path: Path) -> None:
    """A limit above the machine, or a machine full of other groups: the system's MemAvailable
    is the most that is available."""
    proc = proc_tree(tmp_path, "0::/big\n", total_gib=16, available_gib=3)
    sys = tmp_path / "sys"
    write(sys / "cgroup.controllers", "memory\n")
    write(sys / "big" / "memory.max", f"{64 * GIB}\n")
    write(sys / "big" / "memory.current", f"{GIB}\n")
    reading = HostMemoryProbe(proc, sys).read()
    assert reading.limit_bytes == 16 * GIB
    assert reading.available_bytes == 3 * GIB


@pytest.mark.parametrize(
    ("cgroup", "files"),
    [
        (
            "0::/\n",
            {"cgroup.controllers": "memory\n", "memory.max": "max\n", "memory.current": "5"},
        ),
        ("4:memory:/\n", {"memory/memory.limit_in_bytes": "9223372036854771712\n"}),
        ("", {}),
    ],
    ids=["v2-max", "v1-unlimited", "no-cgroup"],
)
def test_without_a_limit_the_system_meminfo_decides(
    tmp_path: Path, cgroup: str, files: dict[str, str]
) -> None:
    proc = proc_tree(tmp_path, cgroup, total_gib=16, available_gib=12)
    sys = tmp_path / "sys"
    for name, text in files.items():
        write(sys / name, text)
    reading = HostMemoryProbe(proc, sys).read()
    assert (reading.limit_bytes, reading.used_bytes, reading.available_bytes) == (
        16 * GIB,
        4 * GIB,
        12 * GIB,
    )
    assert reading.source == "meminfo"


def test_this_machine_reads_something_sensible() -> None:
    reading = HostMemoryProbe().read()
    assert 0 < reading.available_bytes <= reading.limit_bytes
    assert reading.used_bytes >= 0


class FakeNvml:
    """pynvml's surface, as far as the probe uses it: two devices, this process on one."""

    class NVMLError(Exception):
        pass

    def __init__(self, pid: int, fail_init: bool = False) -> None:
        self.pid, self.fail_init, self.shut = pid, fail_init, False

    def nvmlInit(self) -> None:  # noqa: N802 - NVML's names
        if self.fail_init:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.shut = True

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802
        return index

    def nvmlDeviceGetName(self, handle: int) -> Any:  # noqa: N802
        return b"NVIDIA H200" if handle == 0 else "NVIDIA H200"

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:  # noqa: N802
        return SimpleNamespace(total=141 * GIB, free=(100 - handle) * GIB, used=(41 + handle) * GIB)

    def nvmlDeviceGetUUID(self, handle: int) -> Any:  # noqa: N802
        if handle == 1:
            raise self.NVMLError("Not Supported")
        return b"GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Any]:  # noqa: N802
        if handle == 1:
            raise self.NVMLError("Insufficient Permissions")
        return [
            SimpleNamespace(pid=self.pid, usedGpuMemory=3 * GIB),
            SimpleNamespace(pid=self.pid + 1, usedGpuMemory=30 * GIB),
            SimpleNamespace(pid=self.pid, usedGpuMemory=None),  # NVML's "not available"
        ]


def test_gpu_memory_per_device_and_this_process() -> None:
    nvml = FakeNvml(pid=4242)
    probe = GpuMemoryProbe(nvml, pid=4242)
    first, second = probe.read()
    assert (first.index, first.name, first.total_bytes, first.free_bytes) == (
        0,
        "NVIDIA H200",
        141 * GIB,
        100 * GIB,
    )
    assert first.process_bytes == 3 * GIB  # its own processes' only
    assert (first.uuid, second.uuid) == ("GPU-8932f937-d72c-4106-c12f-20bd9faed9f6", "")
    assert (second.free_bytes, second.used_bytes, second.process_bytes) == (99 * GIB, 42 * GIB, 0)
    probe.close()
    assert nvml.shut and probe.read() == []


def test_the_engines_card_is_found_by_uuid_or_visible_devices_never_guessed() -> None:
    cards = [
        GpuReading(i, "NVIDIA H200", 141 * GIB, (100 - i) * GIB, 0, 0, f"GPU-{i}a{i}b-0000")
        for i in range(4)
    ]
    # by index only where CUDA numbers cards as NVML does (PCI order) or there is one card
    assert nvml_card(0, cards) is None  # CUDA's default order: fastest first
    assert nvml_card(0, cards, pci_order=True).index == 0  # type: ignore[union-attr]
    assert nvml_card(0, cards[2:3]).index == 2  # type: ignore[union-attr]  # the only card
    assert nvml_card(1, cards, torch_uuid="2a2b-0000").index == 2  # type: ignore[union-attr]
    assert nvml_card(0, cards, torch_uuid="GPU-2A2B-0000").index == 2  # type: ignore[union-attr]
    assert nvml_card(1, cards, visible="3,1") is None
    assert nvml_card(1, cards, visible="3,1", pci_order=True).index == 1  # type: ignore[union-attr]
    assert nvml_card(0, cards, visible="GPU-3a3b").index == 3  # type: ignore[union-attr]
    assert nvml_card(0, cards, torch_uuid="ffff") is None  # a card NVML does not list
    assert nvml_card(2, cards, visible="0,1") is None  # not among the visible ones
    assert nvml_card(0, cards, visible="MIG-GPU-0a0b-0000/1/0") is None  # a MIG instance
    assert nvml_card(0, cards, visible="GPU-") is None  # a prefix of every card: ambiguous
    assert nvml_card(7, cards, pci_order=True) is None


def test_no_driver_means_no_gpus_not_an_error() -> None:
    probe = GpuMemoryProbe(FakeNvml(pid=1, fail_init=True))
    assert probe.read() == []
    assert "Driver Not Loaded" in probe.why_none


def test_this_machine_without_a_gpu_reads_none() -> None:
    """No NVIDIA driver here: pynvml (a dependency) cannot start, and the probe says why."""
    probe = GpuMemoryProbe()
    if probe.read():  # a GPU machine: the GPU script prints what NVML reports
        pytest.skip("this machine has a GPU")
    assert probe.why_none


def test_disk_of_a_path_not_created_yet(tmp_path: Path) -> None:
    reading = read_disk(tmp_path / "state" / "l2")
    assert 0 < reading.free_bytes <= reading.total_bytes


def test_disk_room_reads_this_machines_disk(tmp_path: Path) -> None:
    free = read_disk(tmp_path).free_bytes
    assert DiskRoom(tmp_path, 0).state() == ROOM  # off
    assert DiskRoom(tmp_path, 1).state() == ROOM
    assert DiskRoom(tmp_path, 1 << 62).state() == CRITICAL
    room = DiskRoom(tmp_path, 3 * free // 2)  # short while 0.75x to 1.5x of it stays free
    assert room.state() == SHORT and room.free_bytes is not None


def test_disk_room_reads_at_most_every_interval_and_keeps_its_state_when_a_read_fails(
    tmp_path: Path,
) -> None:
    now, reads, free = [0.0], [0], [100]

    def read(path: Path) -> DiskReading:
        reads[0] += 1
        if free[0] < 0:
            raise OSError("gone")
        return DiskReading(str(path), 1000, free[0])

    room = DiskRoom(tmp_path, 80, interval_s=1.0, read=read, clock=lambda: now[0])
    assert room.state() == ROOM and reads[0] == 1
    free[0] = 50
    now[0] = 0.5
    assert room.state() == ROOM and reads[0] == 1  # not read again yet
    now[0] = 1.0
    assert room.state() == SHORT and reads[0] == 2
    free[0], now[0] = 39, 2.0
    assert room.state() == CRITICAL
    free[0], now[0] = -1, 3.0
    assert room.state() == CRITICAL and reads[0] == 4  # a failed reading keeps the last state
    free[0], now[0] = 80, 4.0
    assert room.state() == ROOM


def test_a_parents_limit_binds_v2(tmp_path: Path) -> None:
    """A systemd slice or a pod limits the parent; the process's own group says "max"."""
    proc = proc_tree(tmp_path, "0::/pod/container\n")
    sys = tmp_path / "sys"
    write(sys / "cgroup.controllers", "memory\n")
    write(sys / "pod" / "memory.max", f"{3 * GIB}\n")
    write(sys / "pod" / "container" / "memory.max", "max\n")
    write(sys / "pod" / "container" / "memory.current", f"{GIB}\n")
    reading = HostMemoryProbe(proc, sys).read()
    assert (reading.limit_bytes, reading.available_bytes) == (3 * GIB, 2 * GIB)


def test_a_group_without_the_memory_controller_still_reads_its_parents_limit(
    tmp_path: Path,
) -> None:
    """A service that moved itself into a child group its parent did not delegate memory to:
    the child has no memory.max. The probe took the mount root for its group and read the
    host's meminfo, not the pod's 1 GiB."""
    proc = proc_tree(tmp_path, "0::/pod/leaf\n")
    sys = tmp_path / "sys"
    write(sys / "cgroup.controllers", "memory\n")
    write(sys / "pod" / "memory.max", f"{GIB}\n")
    write(sys / "pod" / "memory.current", f"{GIB - 64 * (1 << 20)}\n")
    (sys / "pod" / "leaf").mkdir()
    reading = HostMemoryProbe(proc, sys).read()
    assert (reading.limit_bytes, reading.available_bytes) == (GIB, 64 * (1 << 20))


def test_a_parents_limit_binds_v1(tmp_path: Path) -> None:
    proc = proc_tree(tmp_path, "4:memory:/container\n")
    group = tmp_path / "sys" / "memory" / "container"
    write(group / "memory.limit_in_bytes", "9223372036854771712\n")
    write(group / "memory.usage_in_bytes", f"{GIB}\n")
    write(group / "memory.stat", f"hierarchical_memory_limit {4 * GIB}\ntotal_inactive_file 0\n")
    reading = HostMemoryProbe(proc, tmp_path / "sys").read()
    assert (reading.limit_bytes, reading.available_bytes) == (4 * GIB, 3 * GIB)


def test_a_failing_nvml_reading_is_no_gpus_not_a_crash() -> None:
    nvml = FakeNvml(pid=1)

    def lost(handle: int) -> Any:
        raise FakeNvml.NVMLError("GPU is lost")

    nvml.nvmlDeviceGetMemoryInfo = lost  # type: ignore[method-assign]
    assert GpuMemoryProbe(nvml, pid=1).read() == []


def test_a_parents_limit_is_held_against_the_parents_own_use_v2(tmp_path: Path) -> None:
    """A slice of 4 GiB holding 3.5 (this group 1, its siblings the rest): 0.5 GiB is left,
    not the 3 that the slice's limit less this group's use would say."""
    proc = proc_tree(tmp_path, "0::/slice/server\n")
    sys = tmp_path / "sys"
    write(sys / "cgroup.controllers", "memory\n")
    write(sys / "slice" / "memory.max", f"{4 * GIB}\n")
    write(sys / "slice" / "memory.current", f"{7 * GIB // 2}\n")
    write(sys / "slice" / "server" / "memory.max", "max\n")
    write(sys / "slice" / "server" / "memory.current", f"{GIB}\n")
    reading = HostMemoryProbe(proc, sys).read()
    assert (reading.limit_bytes, reading.available_bytes) == (4 * GIB, GIB // 2)
    assert reading.source.endswith("slice")


def test_a_parents_limit_is_held_against_the_parents_own_use_v1(tmp_path: Path) -> None:
    proc = proc_tree(tmp_path, "4:memory:/pod/container\n")
    mount = tmp_path / "sys" / "memory"
    write(mount / "pod" / "memory.limit_in_bytes", f"{4 * GIB}\n")
    write(mount / "pod" / "memory.usage_in_bytes", f"{3 * GIB}\n")
    write(mount / "pod" / "memory.stat", f"total_inactive_file {GIB // 2}\n")
    group = mount / "pod" / "container"
    write(group / "memory.limit_in_bytes", "9223372036854771712\n")
    write(group / "memory.usage_in_bytes", f"{GIB}\n")
    write(group / "memory.stat", f"hierarchical_memory_limit {4 * GIB}\ntotal_inactive_file 0\n")
    reading = HostMemoryProbe(proc, tmp_path / "sys").read()
    assert (reading.limit_bytes, reading.used_bytes) == (4 * GIB, 5 * GIB // 2)
    assert reading.available_bytes == 3 * GIB // 2


def test_no_reading_at_all_is_an_error_not_zero_bytes_left(tmp_path: Path) -> None:
    """Without /proc/meminfo and a cgroup limit nothing is known: the budget tick that asks
    fails and holds every budget, where 0 bytes available squeezed every cache to its floor."""
    proc = tmp_path / "proc"
    write(proc / "self" / "cgroup", "0::/\n")
    with pytest.raises(OSError, match="no host memory reading"):
        HostMemoryProbe(proc, tmp_path / "sys").read()
