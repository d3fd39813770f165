"""tiercache.threads: the kernel knows the stages' threads by their Python names (what top -H,
perf and the soak comparison's thread groups read)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tiercache import threads
from tiercache.threads import KERNEL_NAME_BYTES, NamedThread, name_this_thread


def kernel_name(native_id: int) -> str:
    return Path(f"/proc/self/task/{native_id}/comm").read_text().strip()


def test_a_named_thread_has_its_name_in_the_kernel_cut_to_its_limit() -> None:
    seen: dict[str, str] = {}

    def record() -> None:
        seen[threading.current_thread().name] = kernel_name(threading.get_native_id())

    names = ("metrics", "l1-endorsements-and-more", "tiercache-invalidations", "tiercache-")
    for name in names:
        thread = NamedThread(target=record, name=name, daemon=True)
        thread.start()
        thread.join(10)
    # "tiercache-" is left out (every stage thread would share it), unless it is all there is
    assert seen == {
        "metrics": "metrics",
        "l1-endorsements-and-more": "l1-endorsements",
        "tiercache-invalidations": "invalidations",
        "tiercache-": "tiercache-",
    }
    assert len("l1-endorsements") == KERNEL_NAME_BYTES
    # a plain thread keeps the process's name: what the helper is for
    plain: list[str] = []
    thread = threading.Thread(
        target=lambda: plain.append(kernel_name(threading.get_native_id())), name="plain"
    )
    thread.start()
    thread.join(10)
    assert plain and plain[0] != "plain"


def test_a_pools_workers_take_their_names_with_the_initializer() -> None:
    with ThreadPoolExecutor(
        max_workers=2, thread_name_prefix="llm-serve", initializer=name_this_thread
    ) as pool:
        names = {pool.submit(lambda: kernel_name(threading.get_native_id())).result()}
    assert names <= {"llm-serve_0", "llm-serve_1"} and names


def test_without_proc_naming_is_a_no_op(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(threads, "_COMM", tmp_path / "missing" / "comm")
    assert name_this_thread("anything") is False
    done: list[bool] = []
    thread = NamedThread(target=lambda: done.append(True), name="still-runs")
    thread.start()
    thread.join(10)
    assert done == [True]
