"""GPU checks of tiercache_native's CUDA part; prints a short table.

    python3 tests/gpu/run_gpu_checks.py            (exit 0 when every check passes)

- device publication: a host thread spins on the host-visible count of a DeviceTable while
  another thread publishes many small batches; every row below each count it reads must be
  complete in the pinned host mirror (the __threadfence_system() ordering). The device count
  and the rows copied back must match.
- device rows (with PyTorch): rows written into a CUDA tensor on a side stream behind a slow
  kernel and published with `stream=` at once, no torch.cuda.synchronize(); each tensor is
  dropped right after publish and its memory refilled with NaN on that stream. The same on the
  default stream without `stream=`. An fp16 and a non-contiguous tensor must be refused.
- host sources (with PyTorch, for pinned memory): a pinned buffer refilled with NaN right after
  each publish and each broadcast; the rows must arrive intact.
- broadcast: a ReplicaSet over the cards; after every broadcast a kernel on each replica's
  reader stream reads the count and checks every row below it. On one card the replicas share
  it: one by a device copy ("same-card"), one staged through pinned host memory ("staging");
  with two or more cards, peer copies where peer access is on, and the staging path forced.
- kv reuse isolation: the GPU repository as deploy/tensorrt_llm/assemble_repository.py writes
  it keeps TensorRT-LLM's prefix KV reuse off by default (its Triton backend takes no
  per-tenant cache salt) and turns it on for one configured tenant only (issue 14).
- speculation config: an engine built with --max-draft-len gets trtllm-build's external draft
  tokens mode, and the repository assembled around it sets llm's trtllm_max_draft_len and lets
  tensorrt_llm take draft_input_ids (issue 17; the configs only: no engine is built or run).
- speculation cuda: the project's engine (TorchEngine) speculating on the card, random weights
  of SmolLM2's architecture (tests/gpu/speculation_cuda.py; `--prepare` it here and carry
  build/gpu-spec): every greedy answer and every seeded sampled one (not speculated by
  default) plain decoding's, with the times of both; a sampled request with speculate_sampled
  on is reported, not counted (TensorRT-LLM itself is not on the device machines: see that
  script).
- nvml (issue 20): what NVML reports of each card; 1 GiB taken on card 0 must show; a budget
  controller under a headroom must shrink. kv pool: the engine's KV pool on the card with its
  budget following NVML's free memory while 35 % of it is taken and given back, by this
  process and then by another one (`squeeze_kv_pool`, `OtherProcess`). adapter slots: the
  engine's slots holding the three bundled adapters under the stage's budget while another
  process takes 35 % of the card: down to one adapter, its answer unchanged, and back
  (`squeeze_adapter_slots`).
- teardown: ReplicaSets dropped right after a large broadcast, copies in flight (this can only
  go wrong across cards; on one card it is a smoke test), then a new set must work. With two
  cards and PyTorch, dropping objects on card 1 must leave the current device at 0.

A check that raises is a FAIL row with its error; the others still run.

Exit status: 0 when every check passes, and on a machine without a GPU (no nvidia-smi on PATH,
no /dev/nvidia0), where it says so. On a GPU machine, when the importable tiercache_native has no
CUDA part (or none is importable), it builds one with CMake into build/gpu-checks/ for this
machine's card and runs again with it; a build that fails, or a module that sees no device
(e.g. a driver older than the CUDA toolkit it was built with: CUDA 13 needs R580 or newer),
is reported with what to do, and the exit status is 1.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import select
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python_backend"))  # tiercache, as the checks import it
BUILD = ROOT / "build" / "gpu-checks"
REBUILT = "TIERCACHE_GPU_CHECKS_BUILT"  # set for the second run, on the module just built
WIDTH = 64

Row = tuple[str, ...]


# --- The module -----------------------------------------------------------------------------------


def machine_has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None or Path("/dev/nvidia0").exists()


def import_native() -> tuple[ModuleType | None, str]:
    try:
        return importlib.import_module("tiercache_native"), ""
    except ImportError as e:
        return None, f"tiercache_native is not importable: {e}"


def run_quietly(cmd: list[str]) -> subprocess.CompletedProcess[str] | None:
    """Runs a build step; on failure prints its command and the end of its output."""
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode == 0:
        return result
    print(f"cannot build tiercache_native: `{' '.join(cmd)}` failed (exit {result.returncode}):")
    print("\n".join((result.stdout + result.stderr).splitlines()[-40:]))
    return None


def build_native() -> bool:
    """Builds tiercache_native with CMake into build/gpu-checks/ for this machine's card."""
    cmake = shutil.which("cmake")
    if cmake is None:
        print("cannot build tiercache_native: cmake (3.24 or newer) is not on PATH")
        return False
    probe = [sys.executable, "-m", "nanobind", "--cmake_dir"]
    if subprocess.run(probe, capture_output=True, check=False).returncode != 0:
        print(
            f"cannot build tiercache_native: nanobind is not installed for {sys.executable}"
            f" (`{sys.executable} -m pip install nanobind`)"
        )
        return False
    # PYTHON_INCLUDE_DIR: headers of this Python's minor version from elsewhere, for an image
    # without them that cannot install a package
    elsewhere = os.environ.get("PYTHON_INCLUDE_DIR")
    headers = Path(elsewhere or sysconfig.get_paths()["include"]) / "Python.h"
    if not headers.exists():
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        print(
            f"cannot build tiercache_native: the Python headers are missing ({headers});"
            f" install python{version}-dev (Debian, Ubuntu) or python3-devel (RHEL), or name"
            " a folder holding them in PYTHON_INCLUDE_DIR"
        )
        return False
    configure = [
        cmake,
        "-S",
        str(ROOT),
        "-B",
        str(BUILD),
        f"-DPython_EXECUTABLE={sys.executable}",
        "-DCMAKE_CUDA_ARCHITECTURES=native",
        "-DTIERCACHE_BUILD_TESTS=OFF",
        *([f"-DPython_INCLUDE_DIR={elsewhere}"] if elsewhere else []),
    ]
    if shutil.which("ninja") and not (BUILD / "CMakeCache.txt").exists():
        configure += ["-G", "Ninja"]
    started = time.perf_counter()
    configured = run_quietly(configure)
    if configured is None or run_quietly([cmake, "--build", str(BUILD), "-j"]) is None:
        return False
    if not any((BUILD / "python" / "tiercache_native").glob("_core*.so")):
        notes = [line for line in configured.stderr.splitlines() if "tiercache" in line]
        print("cannot build tiercache_native: CMake built no Python module. It said:")
        print("\n".join(notes) or configured.stderr[-2000:])
        return False
    print(f"built tiercache_native in {BUILD} in {time.perf_counter() - started:.0f} s")
    return True


def run_with_built_module() -> int:
    """Runs this script again in a fresh interpreter that imports the module in BUILD."""
    path = [str(BUILD / "python"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, REBUILT: "1", "PYTHONPATH": os.pathsep.join(path)}
    script = [sys.executable, str(Path(__file__).resolve())]
    return subprocess.run(script, env=env, check=False).returncode


def no_device_hint(status: str) -> str:
    if "InsufficientDriver" in status:
        return (
            "The driver is older than the CUDA runtime the module was built with (CUDA 13 needs\n"
            "driver R580 or newer; nvidia-smi shows the driver). Build with a toolkit that this\n"
            "driver supports:\n"
            "  CUDACXX=/usr/local/cuda-12.8/bin/nvcc cmake -S . -B build/gpu-cuda12 \\\n"
            "    -DCMAKE_CUDA_ARCHITECTURES=native && cmake --build build/gpu-cuda12 -j\n"
            f"  PYTHONPATH=build/gpu-cuda12/python {sys.executable} tests/gpu/run_gpu_checks.py"
        )
    return "Check CUDA_VISIBLE_DEVICES, the driver (nvidia-smi) and the container's device access."


def import_torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch


# --- Checks ---------------------------------------------------------------------------------------


def failed_row(name: str, error: BaseException) -> Row:
    message = " ".join(str(error).split())  # one line
    return (name, "-", "-", "-", "-", f"FAIL: {type(error).__name__}: {message}")


def run_check(name: str, check: Callable[[], list[Row]]) -> list[Row]:
    """A check that raises becomes a FAIL row with its error, and the next check runs."""
    try:
        return check()
    except Exception as e:  # reported, not swallowed: the row fails and the exit status is 1
        return [failed_row(name, e)]


def check_device_publication(native: Any, testing: Any) -> list[Row]:
    batch, batches = 16, 2000
    total = batch * batches
    rows = testing.make_rows(np.arange(total, dtype=np.uint64), WIDTH)
    table = native.DeviceTable(WIDTH, total, device=0, host_mirror=True)
    errors: list[BaseException] = []

    def publish() -> None:
        try:
            for i in range(batches):
                table.publish(rows[i * batch : (i + 1) * batch])
        except BaseException as e:  # handed to the main thread, which fails the check
            errors.append(e)

    writer = threading.Thread(target=publish)
    started = time.perf_counter()
    writer.start()
    # Watched in slices, so a writer that failed does not leave the watch spinning for long.
    polls = distinct = bad = last = 0
    deadline = time.monotonic() + 60.0
    while last < total and not errors and time.monotonic() < deadline:
        seen = table.watch_mirror(total, timeout_s=2.0)
        polls += seen["polls"]
        distinct += seen["distinct_counts"]
        bad += seen["bad_rows"]
        last = seen["last_count"]
    writer.join()
    if errors:
        raise RuntimeError(f"publishing thread: {type(errors[0]).__name__}: {errors[0]}")
    table.synchronize()
    elapsed = time.perf_counter() - started
    ok = (
        bad == 0
        and last == total
        and table.host_count() == total
        and table.device_count() == total
        and np.array_equal(table.rows(), rows)
        and np.array_equal(table.host_snapshot(), rows)
    )
    return [
        (
            "device publication (host rows)",
            f"{total} rows in {batches} kernels",
            f"host saw {distinct} counts in {polls} polls",
            f"{bad} bad rows",
            f"{elapsed / batches * 1e6:.1f} us/publish",
            "ok" if ok else "FAIL",
        )
    ]


def slow_kernel(torch: Any) -> None:
    """Queues about a millisecond of GPU work on the current stream (when torch has it)."""
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(2_000_000)


def publish_from_tensors(native: Any, testing: Any, torch: Any, on_side_stream: bool) -> Row:
    """Rows copied into a fresh tensor behind a slow kernel and published at once; the tensor
    is dropped and its memory refilled with NaN on the same stream right after."""
    total, batch = 4096, 256
    rows = testing.make_rows(np.arange(total, dtype=np.uint64), WIDTH)
    host = torch.from_numpy(rows).pin_memory()  # so that the copies are asynchronous
    table = native.DeviceTable(WIDTH, total, device=0, host_mirror=True)
    stream = torch.cuda.Stream(device=0) if on_side_stream else torch.cuda.current_stream(0)
    with torch.cuda.stream(stream):
        for first in range(0, total, batch):
            on_card = torch.empty((batch, WIDTH), dtype=torch.float32, device="cuda:0")
            slow_kernel(torch)
            on_card.copy_(host[first : first + batch], non_blocking=True)
            if on_side_stream:
                table.publish(on_card, stream=stream.cuda_stream)
            else:
                table.publish(on_card)
            del on_card
            torch.full((batch, WIDTH), float("nan"), device="cuda:0")  # its memory, reused
    seen = table.watch_mirror(total, timeout_s=30.0)
    table.synchronize()
    ok = seen["bad_rows"] == 0 and np.array_equal(table.rows(), rows)
    how = "side stream, stream=" if on_side_stream else "default stream, no stream="
    return (
        f"device rows ({how})",
        f"{total} rows in {total // batch} kernels",
        "no host wait; tensors freed, refilled",
        f"{seen['bad_rows']} bad rows",
        "-",
        "ok" if ok else "FAIL",
    )


def check_device_rows(native: Any, testing: Any, torch: Any) -> list[Row]:
    name = "device rows"
    if torch is None:
        return [(name, "-", "-", "-", "-", "skipped: no torch")]
    if not torch.cuda.is_available():
        return [(name, "-", "-", "-", "-", "skipped: torch sees no GPU")]
    out = [publish_from_tensors(native, testing, torch, on_side_stream=True)]
    if torch.cuda.current_stream(0).cuda_stream == 0:
        out.append(publish_from_tensors(native, testing, torch, on_side_stream=False))
    else:
        out.append((name, "-", "-", "-", "-", "skipped: torch's default stream is not stream 0"))
    table = native.DeviceTable(WIDTH, 16, device=0)
    refused = {
        "fp16": (torch.zeros((4, WIDTH), dtype=torch.float16, device="cuda:0"), "float32"),
        "non-contiguous": (torch.zeros((WIDTH, 4), device="cuda:0").t(), "C-contiguous"),
    }
    for what, (tensor, expected) in refused.items():
        try:
            table.publish(tensor)
            outcome = "FAIL: accepted"
        except (TypeError, ValueError) as e:
            outcome = "ok" if expected in str(e) else f"FAIL: {' '.join(str(e).split())}"
        out.append((f"device rows ({what})", "refused", "-", "-", "-", outcome))
    if table.count() != 0:
        out.append((name, "refused rows were counted", "-", "-", "-", "FAIL"))
    for kind, make in (
        ("DeviceTable", lambda: native.DeviceTable(WIDTH, 2**62 + 1, device=0, host_mirror=True)),
        ("ReplicaSet", lambda: native.ReplicaSet(WIDTH, 2**62 + 1, devices=[0])),
    ):  # a byte size that would wrap: refused before anything is allocated
        try:
            make()
            outcome = "FAIL: accepted"
        except ValueError as e:
            outcome = "ok" if "4 TiB" in str(e) else f"FAIL: {' '.join(str(e).split())}"
        out.append((f"{kind} capacity past 4 TiB", "refused", "-", "-", "-", outcome))
    return out


def check_pinned_sources(native: Any, testing: Any, torch: Any, devices: list[int]) -> list[Row]:
    """publish() and broadcast() must have read a host buffer when they return: pinned memory
    is copied asynchronously, so the buffer is refilled with NaN right after each call."""
    name = "pinned host rows"
    if torch is None:
        return [(name, "-", "-", "-", "-", "skipped: no torch (for pinned memory)")]
    batch, batches = 16384, 8  # 4 MiB per call
    total = batch * batches
    rows = testing.make_rows(np.arange(total, dtype=np.uint64), WIDTH)
    buffer = torch.empty((batch, WIDTH), dtype=torch.float32).pin_memory().numpy()
    table = native.DeviceTable(WIDTH, total, device=0)
    replicas = native.ReplicaSet(WIDTH, total, devices=devices, allow_peer=True)
    for send in (table.publish, replicas.broadcast):
        for first in range(0, total, batch):
            buffer[:] = rows[first : first + batch]
            send(buffer)
            buffer.fill(np.nan)
    table.synchronize()
    replicas.synchronize()
    published = np.array_equal(table.rows(), rows)
    broadcast = all(np.array_equal(replicas.rows(k), rows) for k in range(len(replicas)))
    return [
        (
            f"{name} (publish)",
            f"{total} rows in {batches} calls",
            "buffer refilled after each",
            "-",
            "-",
            "ok" if published else "FAIL",
        ),
        (
            f"{name} (broadcast)",
            ", ".join(replicas.paths()),
            f"{total} rows in {batches} calls",
            "buffer refilled after each",
            "-",
            "ok" if broadcast else "FAIL",
        ),
    ]


def check_broadcast(native: Any, testing: Any, devices: list[int], allow_peer: bool) -> list[Row]:
    rng = np.random.default_rng(0)
    sizes = [int(s) for s in rng.integers(1, 300, size=200)]
    total = sum(sizes)
    rows = testing.make_rows(np.arange(total, dtype=np.uint64), WIDTH)
    replicas = native.ReplicaSet(
        WIDTH, total, devices=devices, allow_peer=allow_peer, staging_rows=128
    )
    started = time.perf_counter()
    first = 0
    for n in sizes:
        replicas.broadcast(rows[first : first + n])
        replicas.launch_reader_checks()  # queued right behind the count, no host wait
        first += n
    replicas.synchronize()
    elapsed = time.perf_counter() - started
    report = replicas.reader_report()
    out: list[Row] = []
    for k, (path, seen) in enumerate(zip(replicas.paths(), report, strict=True)):
        ok = (
            seen["bad_rows"] == 0
            and seen["max_count"] == total
            and seen["checks"] == len(sizes)
            and replicas.replica_count(k) == total
            and np.array_equal(replicas.rows(k), rows)
        )
        out.append(
            (
                f"broadcast replica {k} (card {devices[k]})",
                path,
                f"{len(sizes)} broadcasts, {total} rows",
                f"{seen['checks']} reader checks, {seen['bad_rows']} bad rows",
                f"{elapsed / len(sizes) * 1e6:.0f} us/broadcast",
                "ok" if ok else "FAIL",
            )
        )
    return out


def check_teardown(native: Any, testing: Any, torch: Any, devices: list[int]) -> list[Row]:
    total = 1 << 16  # 16 MiB per replica
    rows = testing.make_rows(np.arange(total, dtype=np.uint64), WIDTH)
    for allow_peer in (True, False):
        for _ in range(3):
            dropped = native.ReplicaSet(WIDTH, total, devices=devices, allow_peer=allow_peer)
            dropped.broadcast(rows)
            del dropped  # copies still in flight: freed only after every replica's streams
    after = native.ReplicaSet(WIDTH, 1024, devices=devices)
    after.broadcast(rows[:1024])
    after.synchronize()
    ok = all(np.array_equal(after.rows(k), rows[:1024]) for k in range(len(after)))
    out: list[Row] = [
        (
            "teardown (set dropped after broadcast)",
            f"{len(devices)} replicas, 6 sets",
            f"{total} rows each",
            "a new set works after" if ok else "a new set fails after",
            "-",
            "ok" if ok else "FAIL",
        )
    ]
    if len(set(devices)) > 1 and torch is not None and torch.cuda.is_available():
        torch.cuda.set_device(0)
        table = native.DeviceTable(WIDTH, 16, device=1)
        replicas = native.ReplicaSet(WIDTH, 16, devices=[1, 0])
        del table, replicas
        current = torch.cuda.current_device()
        out.append(
            (
                "teardown (current device)",
                "objects on card 1 dropped",
                f"current device {current}",
                "-",
                "-",
                "ok" if current == 0 else "FAIL",
            )
        )
    return out


# --- Main -----------------------------------------------------------------------------------------


def load_deploy_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        f"tiercache_{name}", ROOT / "deploy" / "tensorrt_llm" / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def check_kv_reuse_isolation() -> list[Row]:
    """The GPU path's per-tenant KV isolation (issue 14): TensorRT-LLM's Triton backend takes no
    per-tenant cache salt, so the assembled repository must reuse KV blocks only when one
    tenant is configured or the operator says so. Checks the repository this machine would
    serve (assemble_repository.py, no engine needed)."""
    import tempfile

    assemble = load_deploy_script("assemble_repository")
    from tiercache.exact.tenant_keys import add_key

    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        out = assemble.assemble(tmp / "default")
        config = assemble.read_config(out / "tensorrt_llm" / "config.pbtxt")
        reuse = config.parameters["enable_kv_cache_reuse"].string_value
        verdict = "ok" if reuse == "false" else "FAIL: reuse on without a salt"
        rows.append(("kv reuse", "assembled default", "-", "-", reuse, verdict))
        keys = tmp / "keys.json"
        add_key(keys, "acme")
        single, _ = assemble.kv_reuse_decision("auto", keys)
        add_key(keys, "globex")
        several, why = assemble.kv_reuse_decision("auto", keys)
        ok = single and not several
        rows.append(("kv reuse", "auto: 1 tenant / 2 tenants", "-", "-",
                     f"{single} / {several}", "ok" if ok else f"FAIL: {why}"))  # fmt: skip
    return rows


def check_speculation_config() -> list[Row]:
    """Speculative decoding from the cache on the GPU path (issue 17): an engine built with
    --max-draft-len is built for external draft tokens, and the repository assembled around it
    turns llm's speculative steps on with that draft length and lets tensorrt_llm take
    draft_input_ids. Checks the commands and configs this machine would use (no engine run:
    building and serving a TensorRT-LLM engine is not part of this script)."""
    import tempfile

    build = load_deploy_script("build_engine")
    assemble = load_deploy_script("assemble_repository")
    rows: list[Row] = []
    argv = build.build_argv(Path("c"), Path("e"), build.BuildOptions(max_draft_len=8))
    mode = (
        argv[argv.index("--speculative_decoding_mode") + 1]
        if "--speculative_decoding_mode" in argv
        else "-"
    )
    ok = mode == "draft_tokens_external" and argv[argv.index("--max_draft_len") + 1] == "8"
    rows.append(("speculation", "build flags", "-", "-", mode, "ok" if ok else "FAIL"))
    with tempfile.TemporaryDirectory() as tmp_name:
        engine = Path(tmp_name) / "engine-out"
        (engine / "engine").mkdir(parents=True)
        (engine / "engine" / "config.json").write_text("{}")
        (engine / "engine" / "rank0.engine").write_bytes(b"\0" * 16)
        (engine / "tokenizer").mkdir()
        (engine / "tokenizer" / "tokenizer.json").write_text("{}")
        (engine / build.BUILD_FILE).write_text(build.BuildOptions(max_draft_len=8).to_json())
        (engine / build.COMPLETE_FILE).write_text("")
        lens = []
        for reuse in (True, False):  # the steps resend the prompt: only with KV reuse
            out = assemble.assemble(Path(tmp_name) / f"repo-{reuse}", engine, kv_reuse=reuse)
            llm = assemble.read_config(out / "llm" / "config.pbtxt")
            lens.append(llm.parameters["trtllm_max_draft_len"].string_value)
        trt = assemble.read_config(out / "tensorrt_llm" / "config.pbtxt")
        takes = any(i.name == "draft_input_ids" for i in trt.input)
        ok = lens == ["8", "0"] and takes
        rows.append(("speculation", "assembled: draft len reuse/no reuse, input", "-", "-",
                     f"{'/'.join(lens)}, {takes}", "ok" if ok else "FAIL"))  # fmt: skip
    return rows


def check_speculation_cuda() -> list[Row]:
    """The engine's speculative decoding on this card (tests/gpu/speculation_cuda.py, its own
    process: random weights of SmolLM2-135M's architecture, files from build/gpu-spec/): every
    counted answer plain decoding's (greedy speculated; seeded sampled, not speculated by
    default). Its table is printed as it runs; the row here says whether they were identical."""
    script = Path(__file__).with_name("speculation_cuda.py")
    if not (ROOT / "build" / "gpu-spec" / "config.json").exists():
        hint = "FAIL: run speculation_cuda.py --prepare where the model is, and carry it"
        return [("speculation cuda", "engine on this card", "-", "-", "no build/gpu-spec", hint)]
    try:
        done = subprocess.run(
            [sys.executable, str(script), "--max-tokens", "96"],
            capture_output=True,
            text=True,
            timeout=600,
        )
    except subprocess.TimeoutExpired as exc:
        print(exc.stdout or "", end="")
        return [("speculation cuda", "engine on this card", "-", "-", "-", "FAIL: over 600 s")]
    print(done.stdout, end="")
    last = (done.stdout.strip().splitlines() or [done.stderr.strip()[-200:]])[-1]
    ok = done.returncode == 0 and "identical yes" in last
    verdict = "ok" if ok else f"FAIL: exit {done.returncode}: {done.stderr.strip()[-300:]}"
    return [("speculation cuda", "engine on this card", "-", "-", last[-60:], verdict)]


def check_nvml_budgets(torch: Any) -> list[Row]:
    """GPU memory as the budget controller reads it (issue 20: tiercache.machine through
    pynvml): each card's total, free and this process's bytes, printed; then 1 GiB taken on
    card 0 must show in this process's bytes and in the card's free bytes, and a controller
    keeping a headroom just under what was free must shrink its budget."""
    from tiercache.budgets import Budget, BudgetController
    from tiercache.machine import GpuMemoryProbe

    probe = GpuMemoryProbe()
    readings = probe.read()
    if not readings:
        return [("nvml", "cards NVML reports", "-", "-", "none", f"FAIL: {probe.why_none}")]
    rows: list[Row] = []
    for r in readings:
        print(f"NVML card {r.index} {r.name}: total {r.total_bytes >> 20} MiB, free "
              f"{r.free_bytes >> 20} MiB, used {r.used_bytes >> 20} MiB, this process "
              f"{r.process_bytes >> 20} MiB")  # fmt: skip
        sane = 0 < r.free_bytes <= r.total_bytes
        rows.append(("nvml", f"card {r.index} read", "-", "-", f"{r.free_bytes >> 20} MiB free",
                     "ok" if sane else "FAIL: free out of range"))  # fmt: skip
    if torch is None:
        return [*rows, ("nvml", "1 GiB taken on card 0", "-", "-", "-", "FAIL: no torch")]
    # torch_llm's gpu_memory_headroom_bytes reads the card its engine runs on: cuda:0 must be
    # found among NVML's cards (by the UUID torch gives, else CUDA_VISIBLE_DEVICES)
    from tiercache.machine import nvml_card

    try:
        uuid: str | None = str(torch.cuda.get_device_properties(0).uuid)
    except (AttributeError, RuntimeError):
        uuid = None
    card = nvml_card(
        0,
        readings,
        uuid,
        os.environ.get("CUDA_VISIBLE_DEVICES"),
        pci_order=os.environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID",
    )
    print(f"torch cuda:0 uuid {uuid}: NVML card {None if card is None else card.index}")
    rows.append(("nvml", "torch's cuda:0 found in NVML", "-", "-",
                 "none" if card is None else f"card {card.index}",
                 "ok" if card is not None else "FAIL: no NVML card matches"))  # fmt: skip
    index = 0 if card is None else card.index  # NVML's number for torch's cuda:0

    def of_card() -> Any:
        return next(r for r in probe.read() if r.index == index)

    before = of_card()
    sizes: list[int] = []
    controller = BudgetController(
        [Budget("kv_pool", 0, 1 << 30, 1 << 30, lambda n: sizes.append(n) or n, lambda: 1.0)],
        lambda: of_card().free_bytes,
        headroom_bytes=max(before.free_bytes - (512 << 20), 0),
    )
    block = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:0")
    block.fill_(1)
    torch.cuda.synchronize()
    after = of_card()
    decisions = controller.tick()
    del block
    torch.cuda.empty_cache()
    grew = after.process_bytes - before.process_bytes
    fell = before.free_bytes - after.free_bytes
    seen = grew >= (1 << 30) or after.process_bytes == 0  # 0: NVML may not list processes here
    rows.append(("nvml", "1 GiB taken: process +, free -", "-", "-",
                 f"+{grew >> 20} / -{fell >> 20} MiB",
                 "ok" if seen and fell >= (1 << 30) else "FAIL: NVML did not see it"))  # fmt: skip
    shrunk = bool(decisions) and decisions[0].reason == "shrink"
    budget = f"{(sizes or [0])[-1] >> 20} MiB"
    rows.append(("nvml", "a budget shrinks under the headroom", "-", "-", budget,
                 "ok" if shrunk else "FAIL: no shrink"))  # fmt: skip
    probe.close()
    return rows


def ticks_until(controller: Any, done: Callable[[], bool], most: int = 12) -> int:
    """Tick `controller` until `done()`; how many ticks it took (-1: not within `most`)."""
    for n in range(1, most + 1):
        controller.tick()
        if done():
            return n
    return -1


def squeeze_kv_pool(
    engine: Any,
    free_bytes: Callable[[], int],
    take: Callable[[int], None],
    give_back: Callable[[], None],
    memory_label: str = "MiB free",
    tag: str = "",
) -> list[Row]:
    """The engine's KV pool under a budget controller reading `free_bytes` (on a card: NVML's
    free memory), as torch_llm's gpu_memory_headroom_bytes runs it (the controller and the
    pool's budget, without the Triton stage around them). The pool is filled to its size; the
    headroom is set to 3/4 of what is free, so that taking 35 % of it (`take`) leaves it short
    and giving it back (`give_back`) clears the controller's 25 % hysteresis. The budget must
    fall to its floor, the next request evict down to it, the engine hand the freed memory
    back (its cached blocks, where the card's reading sees them), and the budget return to the
    pool's size once the memory is back. `tag` starts the filling prompts (a second run's
    prompts must be new to the pool)."""
    from tiercache.budgets import BudgetController
    from tiercache.engine.kv_cache import kv_pool_budget
    from tiercache.exact.request import GenerationRequest

    pool = engine.kv_pool
    ceiling = pool.budget_bytes  # in force at the next request (a run before may leave it pending)
    floor = ceiling // 8
    block = engine.kv_bytes_per_token * pool.tokens_per_block
    words = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split()
    for i in range(64):  # distinct long prompts until the pool is full
        prompt = " ".join(words[(i * 7 + j * (i + 3)) % len(words)] for j in range(400))
        list(engine.generate(GenerationRequest(f"{tag}{i}: {prompt}", max_tokens=2)))
        if pool.stats().bytes + 2 * block > ceiling:
            break
    filled = pool.stats().bytes
    budget = kv_pool_budget(pool, floor, ceiling)  # as torch_llm builds it
    free = free_bytes()
    controller = BudgetController([budget], free_bytes, headroom_bytes=free * 3 // 4)
    rows: list[Row] = [("kv pool", "filled before the squeeze", "-", "-",
                        f"{filled >> 20} of {ceiling >> 20} MiB",
                        "ok" if filled > ceiling // 2 else "FAIL: pool not filled")]  # fmt: skip

    take(free * 35 // 100)
    try:
        n = ticks_until(controller, lambda: pool.budget_bytes == floor)
        rows.append(("kv pool", "squeezed: budget to its floor", "-", "-",
                     f"{pool.budget_bytes >> 20} MiB after {n} ticks",
                     "ok" if n > 0 else "FAIL: budget not at its floor"))  # fmt: skip
        list(engine.generate(GenerationRequest("a short request after the squeeze", max_tokens=2)))
        held = pool.stats().bytes
        before_release = free_bytes()
        engine.release_cached_memory()
        returned = free_bytes() - before_release
        evicted = filled - held
        rows.append(("kv pool", "next request evicts; memory handed back", "-", "-",
                     f"{held >> 20} MiB held, +{returned >> 20} {memory_label}",
                     "ok" if held <= floor and returned >= evicted // 4
                     else f"FAIL: {evicted >> 20} MiB evicted"))  # fmt: skip
    finally:
        give_back()
    n = ticks_until(controller, lambda: pool.budget_bytes == ceiling)
    rows.append(("kv pool", "memory back: budget to its size", "-", "-",
                 f"{pool.budget_bytes >> 20} MiB after {n} ticks",
                 "ok" if n > 0 else "FAIL: budget did not grow back"))  # fmt: skip
    return rows


# Another process holding memory on a card: what the budgets must answer in a shared machine.
HOLDER = """
import sys, torch
block = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device=sys.argv[2])
block.fill_(1)
torch.cuda.synchronize()
print("holding", flush=True)
sys.stdin.read()
"""


class OtherProcess:
    """`take(n)` starts another Python process that holds n bytes on `device` until
    `give_back()` ends it (its CUDA context comes on top: also taken from the card)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.process: subprocess.Popen[str] | None = None

    def take(self, n: int) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(n), self.device],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], 120.0)  # a hung CUDA start
        line = self.process.stdout.readline().strip() if ready else "(no answer in 120 s)"
        if line != "holding":
            self.give_back()
            raise RuntimeError(f"the other process did not take {n >> 20} MiB: {line!r}")

    def give_back(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        assert process.stdin is not None
        process.stdin.close()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class ThisProcess:
    """`take(n)` holds n bytes on `device` in this process; `give_back()` frees them."""

    def __init__(self, torch: Any, device: str) -> None:
        self.torch, self.device = torch, device
        self.taken: list[Any] = []

    def take(self, n: int) -> None:
        block = self.torch.empty(n, dtype=self.torch.uint8, device=self.device)
        block.fill_(1)
        self.torch.cuda.synchronize()
        self.taken.append(block)

    def give_back(self) -> None:
        self.taken.clear()
        self.torch.cuda.empty_cache()


def engine_on_card(
    torch: Any, what: str, run: Callable[[Any, Callable[[], int]], list[Row]], **options: Any
) -> list[Row]:
    """`run(engine, free_bytes)` with the project's engine on cuda:0 (random weights of
    SmolLM2's architecture, files from build/gpu-spec/; TorchEngine's keywords `options`) and
    NVML's free memory of the card it runs on."""
    import tempfile

    from tiercache.machine import GpuMemoryProbe, nvml_card

    if torch is None:
        return [(what, "on the card", "-", "-", "-", "FAIL: no torch")]
    files = ROOT / "build" / "gpu-spec"
    if not (files / "config.json").exists():
        hint = "FAIL: run speculation_cuda.py --prepare where the model is, and carry it"
        return [(what, "on the card", "-", "-", "no build/gpu-spec", hint)]
    sys.path.insert(0, str(Path(__file__).parent))
    from speculation_cuda import random_engine

    probe = GpuMemoryProbe()
    try:
        with tempfile.TemporaryDirectory(prefix="tiercache-gpu-engine-") as tmp:
            engine = random_engine(files, Path(tmp), "cuda:0", **options)
            index, uuid = engine.card()
            card = nvml_card(index, probe.read(), uuid, os.environ.get("CUDA_VISIBLE_DEVICES"))
            if card is None:
                return [(what, "on the card", "-", "-", "-",
                         f"FAIL: no NVML card for cuda:{index} ({probe.why_none})")]  # fmt: skip
            found = card.index

            def free_bytes() -> int:
                return next(r.free_bytes for r in probe.read() if r.index == found)

            return run(engine, free_bytes)
    finally:
        probe.close()


def check_kv_pool_on_card(torch: Any) -> list[Row]:
    """Issue 20 on the card: the engine's 96 MiB KV pool on cuda:0, its budget following NVML's
    free memory of that card while this process, then another process, takes and returns 35 %
    of it (`squeeze_kv_pool`, once for each)."""

    def run(engine: Any, free_bytes: Callable[[], int]) -> list[Row]:
        rows: list[Row] = []
        for holder, who in ((ThisProcess(torch, engine.device), "this process"),
                            (OtherProcess(engine.device), "another process")):  # fmt: skip
            found = squeeze_kv_pool(engine, free_bytes, holder.take, holder.give_back, tag=who)
            rows += [(r[0], f"{r[1]} ({who})", *r[2:]) for r in found]
        return rows

    return engine_on_card(torch, "kv pool", run, kv_reuse=True, kv_pool_max_bytes=96 << 20)


def squeeze_adapter_slots(
    engine: Any,
    free_bytes: Callable[[], int],
    take: Callable[[int], None],
    give_back: Callable[[], None],
    allocated: Callable[[], int],
) -> list[Row]:
    """The engine's adapter slots holding the three bundled adapters, under the stage's own
    budget (`adapter_slots_budget`, floor one adapter's bytes) and a controller reading
    `free_bytes` while `take` holds 35 % of it (headroom 3/4 of it, as `squeeze_kv_pool`). The
    budget must fall to its floor; the next request (an order for one adapter, as torch_llm's
    call runs it) drop the other two, its answer unchanged, their bytes leaving `allocated`
    (on a card: torch's allocator); and with the memory back (`give_back`) the budget must
    return to its size and another adapter load without dropping the first."""
    from tiercache.adapter_types import AdapterRef, AdapterWeights, adapter_digest
    from tiercache.budgets import BudgetController
    from tiercache.engine.adapters import GENERATE, LOAD, AdapterOrder, adapter_slots_budget
    from tiercache.exact.request import GenerationRequest

    def bundled(name: str, task_id: int) -> AdapterWeights:
        config = (ROOT / "adapters" / name / "adapter_config.json").read_text()
        weights = (ROOT / "adapters" / name / "adapter_model.safetensors").read_bytes()
        ref = AdapterRef(name, task_id, adapter_digest(config.encode(), weights))
        return AdapterWeights(ref, config, weights)

    slots = engine.adapters
    loaded = [bundled(name, n) for n, name in enumerate(("french", "caps", "brief"), 1)]
    for weights in loaded:
        slots.prepare(AdapterOrder(LOAD, weights.ref, weights))
    caps = loaded[1].ref
    ask = GenerationRequest("Say something about the sea.", max_tokens=8, lora_name=caps.name,
                            lora_task_id=caps.task_id, lora_digest=caps.digest)  # fmt: skip

    def answer() -> str:
        slots.prepare(AdapterOrder(GENERATE, needs=caps))  # torch_llm's order for one call
        return "".join(e.text for e in engine.generate(ask))

    before_text = answer()
    ceiling = slots.stats().slot_bytes
    slot = ceiling // 3
    slots.resize(ceiling)  # lora_max_bytes: what the three hold (the stage's ceiling)
    budget = adapter_slots_budget(slots, slot, ceiling)
    controller = BudgetController([budget], free_bytes, headroom_bytes=free_bytes() * 3 // 4)
    held = slots.stats().resident
    rows: list[Row] = [("adapter slots", "three adapters held", "-", "-",
                        f"{ceiling >> 10} KiB in {held} slots",
                        "ok" if held == 3 else "FAIL: not held")]  # fmt: skip

    take(free_bytes() * 35 // 100)
    try:
        n = ticks_until(controller, lambda: budget.current_bytes == slot)
        rows.append(("adapter slots", "squeezed: budget to its floor", "-", "-",
                     f"{budget.current_bytes >> 10} KiB after {n} ticks",
                     "ok" if n > 0 else "FAIL: budget not at its floor"))  # fmt: skip
        before_bytes = allocated()
        after_text = answer()
        engine.release_cached_memory()
        freed = before_bytes - allocated()
        kept = [e["digest"] for e in slots.resident()] == [caps.digest]
        same = after_text == before_text
        rows.append(("adapter slots", "next request drops the other two", "-", "-",
                     f"{slots.stats().resident} held, {freed >> 10} KiB freed, answer "
                     f"{'same' if same else 'CHANGED'}",
                     "ok" if kept and same and freed >= 2 * slot * 9 // 10
                     else f"FAIL: {[e['name'] for e in slots.resident()]}"))  # fmt: skip
    finally:
        give_back()
    n = ticks_until(controller, lambda: budget.current_bytes == ceiling)
    slots.prepare(AdapterOrder(LOAD, loaded[0].ref, loaded[0]))
    both = slots.stats().resident == 2
    rows.append(("adapter slots", "memory back: budget to its size", "-", "-",
                 f"{budget.current_bytes >> 10} KiB after {n} ticks; "
                 f"{slots.stats().resident} held after a load",
                 "ok" if n > 0 and both else "FAIL: budget did not grow back"))  # fmt: skip
    return rows


def check_adapter_slots_on_card(torch: Any) -> list[Row]:
    """Issue 20 on the card: `squeeze_adapter_slots` with the engine on cuda:0, NVML's free
    memory of that card, another process taking it, and torch's allocated bytes."""

    def run(engine: Any, free_bytes: Callable[[], int]) -> list[Row]:
        other = OtherProcess(engine.device)

        def allocated() -> int:
            return int(torch.cuda.memory_allocated(engine.device))

        return squeeze_adapter_slots(engine, free_bytes, other.take, other.give_back, allocated)

    return engine_on_card(torch, "adapter slots", run, lora_slots=3, lora_max_bytes=1 << 30)


def main() -> int:
    native, why = import_native()
    if not machine_has_gpu():
        status = native.cuda_status() if native is not None else why
        print(f"no GPU here ({status}); nothing to check")
        return 0
    if native is None or not native.cuda_compiled():
        found = why if native is None else f"{native.__file__} was built without CUDA"
        if os.environ.get(REBUILT):
            print(f"FAIL: this machine has a GPU, and after the build in {BUILD}: {found}.")
            print("CMake found no CUDA compiler: put nvcc on PATH (or set CUDACXX), remove")
            print(f"{BUILD} and run again.")
            return 1
        print(f"this machine has a GPU and {found}: building it for this card")
        if not build_native():
            return 1
        return run_with_built_module()
    cards = native.cuda_device_count()
    status = native.cuda_status()
    if cards == 0:
        print(f"FAIL: this machine has a GPU, but tiercache_native sees none: {status}")
        print(no_device_hint(status))
        return 1
    testing = importlib.import_module("tiercache_native.testing")
    torch = import_torch()
    torch_note = f", torch {torch.__version__}" if torch is not None else ", no torch"
    print(f"{status} (runtime/driver: 1000 * major + 10 * minor){torch_note}")
    print(f"module: {native.__file__}")
    devices = [0, 0] if cards == 1 else list(range(cards))
    rows = run_check("device publication", lambda: check_device_publication(native, testing))
    rows += run_check("device rows", lambda: check_device_rows(native, testing, torch))
    rows += run_check(
        "pinned host rows", lambda: check_pinned_sources(native, testing, torch, devices)
    )
    for allow_peer in (True, False):
        rows += run_check(
            f"broadcast (allow_peer={allow_peer})",
            partial(check_broadcast, native, testing, devices, allow_peer),
        )
    rows += run_check("teardown", lambda: check_teardown(native, testing, torch, devices))
    rows += run_check("kv reuse isolation", check_kv_reuse_isolation)
    rows += run_check("speculation config", check_speculation_config)
    rows += run_check("speculation cuda", check_speculation_cuda)
    rows += run_check("nvml", lambda: check_nvml_budgets(torch))
    rows += run_check("kv pool", lambda: check_kv_pool_on_card(torch))
    rows += run_check("adapter slots", lambda: check_adapter_slots_on_card(torch))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    failed = sum(r[-1].startswith("FAIL") for r in rows)
    print("all checks passed" if not failed else f"{failed} check(s) FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
