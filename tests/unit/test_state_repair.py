"""State files other than L2 damaged while no process had them open: the semantic row log (with
its shared tables), the vector cache and the adapters' task ids. Each opens, is repaired or
rebuilt (the damaged file kept aside as `<name>.corrupt-<stamp>`), and answers misses, never a
wrong row or an error. A truncated LMDB used to be SIGBUS on the first read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from tiercache.lora.registry import TASK_IDS_REPAIR_GAP, TaskIds
from tiercache.semantic.index import SemanticIndex
from tiercache.semantic.store import SemanticStore
from tiercache.semantic.vectors import VectorCache

DIMENSIONS = 8
ROWS = 200


def unit(i: int) -> np.ndarray:
    vector = np.random.default_rng(i).standard_normal(DIMENSIONS).astype(np.float32)
    return vector / np.linalg.norm(vector)


def truncate_half(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def overwrite_middle(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        f.write(bytes(range(256)) * 16)


DAMAGE = [truncate_half, overwrite_middle]


def filled_semantic(root: Path) -> Path:
    store = SemanticStore(root / "semantic", 1 << 24)
    store.append_many([("scope", f"d{i:04d}", f"prompt {i} " * 30, unit(i)) for i in range(ROWS)])
    index = SemanticIndex(store, DIMENSIONS)
    assert index.search("scope", unit(7), k=1)[0].digest == "d0007"
    store.close()
    return root / "semantic" / "data.mdb"


@pytest.mark.parametrize("damage", DAMAGE, ids=lambda d: d.__name__)
def test_damaged_semantic_log_is_moved_aside_with_its_tables(tmp_path: Path, damage) -> None:  # noqa: ANN001
    damage(filled_semantic(tmp_path))
    store = SemanticStore(tmp_path / "semantic", 1 << 24)
    try:
        assert len(list(tmp_path.glob("semantic.corrupt-*"))) == 1
        index = SemanticIndex(store, DIMENSIONS)
        assert index.search("scope", unit(7), k=1) == []  # rebuilt empty: a miss
        store.append("scope", "fresh", "a new prompt", unit(7))
        assert [n.digest for n in index.search("scope", unit(7), k=1)] == ["fresh"]
    finally:
        store.close()


def test_damaged_scope_table_is_rebuilt_from_the_log(tmp_path: Path) -> None:
    filled_semantic(tmp_path)
    tables = sorted((tmp_path / "semantic").rglob("*.tbl"))
    assert tables
    for table in tables:
        with open(table, "r+b") as f:
            f.write(b"\xa5" * 64)  # the table's header
    store = SemanticStore(tmp_path / "semantic", 1 << 24)
    try:
        index = SemanticIndex(store, DIMENSIONS)
        assert index.search("scope", unit(7), k=1)[0].digest == "d0007"
    finally:
        store.close()


@pytest.mark.parametrize("damage", DAMAGE, ids=lambda d: d.__name__)
def test_damaged_vector_cache_is_rebuilt_empty(tmp_path: Path, damage) -> None:  # noqa: ANN001
    cache = VectorCache(tmp_path / "vectors", DIMENSIONS)
    for i in range(ROWS * 5):
        cache.put(f"k{i}".encode(), unit(i))
    cache.close()
    damage(tmp_path / "vectors" / "data.mdb")
    cache = VectorCache(tmp_path / "vectors", DIMENSIONS)
    try:
        assert len(list(tmp_path.glob("vectors.corrupt-*"))) == 1
        assert cache.get(b"k7") is None
        cache.put(b"k7", unit(7))
        found = cache.get(b"k7")
        assert found is not None and np.array_equal(found, unit(7))
    finally:
        cache.close()


def task_ids_file(tmp_path: Path) -> Path:
    ids = TaskIds(tmp_path / "lora" / "task_ids.json")
    for name in ("french", "german", "spanish"):
        ids.assign(name)
    return tmp_path / "lora" / "task_ids.json"


@pytest.mark.parametrize(
    ("damage", "kept"),
    [
        (lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), None),
        (lambda p: p.write_bytes(b"\x00\xff garbage \xfe"), {}),
        (lambda p: p.write_text('{"version": 1, "task_ids": ["french"]}'), {}),
    ],
    ids=["truncated", "overwritten", "wrong-shape"],
)
def test_damaged_task_ids_are_salvaged_and_never_reused(
    tmp_path: Path,
    damage,  # noqa: ANN001
    kept: dict[str, int] | None,
) -> None:
    path = task_ids_file(tmp_path)
    before = json.loads(path.read_text())["task_ids"]
    damage(path)
    ids = TaskIds(path)  # a new process
    new_id = ids.assign("italian")
    assert len(list(path.parent.glob("task_ids.json.corrupt-*"))) == 1
    stored = json.loads(path.read_text())  # written back whole
    salvaged = {k: v for k, v in stored["task_ids"].items() if k != "italian"}
    if kept is not None:
        assert salvaged == kept
    assert all(before[name] == task_id for name, task_id in salvaged.items())
    # New ids start above every id the damaged file could have held (lost ones included).
    assert new_id > max(before.values())
    assert new_id >= max(salvaged.values(), default=0) + 1 + TASK_IDS_REPAIR_GAP
    assert ids.assign("french") not in set(before.values()) - {before["french"]}
