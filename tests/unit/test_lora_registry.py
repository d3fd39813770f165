"""tiercache.lora.registry: names -> versions, change detection, stable task ids, the manifest."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tiercache.adapter_types import AdapterRef
from tiercache.errors import ConfigError, InvalidRequest, NotFound, Unavailable
from tiercache.lora import registry as registry_module
from tiercache.lora.registry import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterRegistry,
    TaskIds,
    adapter_digest,
    check_ref,
)

ADAPTERS = Path(__file__).resolve().parents[2] / "adapters"


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "adapters"
    root.mkdir()
    for name in ("french", "caps"):
        shutil.copytree(ADAPTERS / name, root / name)
    return root


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def registry_of(root: Path, state: Path, clock: FakeClock, **kwargs: object) -> AdapterRegistry:
    return AdapterRegistry(root, state, clock=clock, **kwargs)  # type: ignore[arg-type]


def changed_weights(path: Path) -> bytes:
    """The safetensors file at `path` with its last data byte changed: another version, whole."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    return bytes(data)


def rewrite(path: Path, data: bytes) -> None:
    """Replace a file as an operator's copy does: a new file renamed over the old one."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def test_digest_is_the_documented_encoding(root: Path, state: Path, clock: FakeClock) -> None:
    ref = registry_of(root, state, clock).resolve("french")
    config = (root / "french" / CONFIG_FILE).read_bytes()
    weights = (root / "french" / WEIGHTS_FILE).read_bytes()
    assert ref.digest == adapter_digest(config, weights)
    # The length prefixes keep the boundary between the files in the encoding.
    assert adapter_digest(b"ab", b"c") != adapter_digest(b"a", b"bc")
    assert ref.name == "french" and ref.task_id >= 1


def test_changed_file_is_a_new_version_with_the_same_task_id(
    root: Path, state: Path, clock: FakeClock
) -> None:
    registry = registry_of(root, state, clock)
    old = registry.resolve("french")
    config = json.loads((root / "french" / CONFIG_FILE).read_text())
    config["lora_alpha"] = 32
    rewrite(root / "french" / CONFIG_FILE, json.dumps(config).encode())
    new = registry.resolve("french")
    assert new.digest != old.digest
    assert new.task_id == old.task_id
    # read() of the old version now fails: its files are gone from disk.
    with pytest.raises(Unavailable, match="changed since this request was resolved"):
        registry.read(old)
    weights = registry.read(new)
    assert weights.ref == new
    assert json.loads(weights.config_json)["lora_alpha"] == 32
    assert weights.weights == (root / "french" / WEIGHTS_FILE).read_bytes()


def test_unchanged_files_are_not_read_again(
    root: Path, state: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = registry_of(root, state, clock, wall_clock_ns=in_a_minute)
    first = registry.resolve("caps")
    reads = count_reads(monkeypatch)
    for _ in range(5):
        assert registry.resolve("caps") == first
    assert reads == []
    rewrite(root / "caps" / WEIGHTS_FILE, changed_weights(root / "caps" / WEIGHTS_FILE))
    assert registry.resolve("caps").digest != first.digest
    assert {p.name for p in reads} == {CONFIG_FILE, WEIGHTS_FILE}


def count_reads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The adapter files the registry reads from here on (each read appends its path)."""
    reads: list[Path] = []
    original = registry_module._read_regular

    def counting(name: str, path: Path) -> bytes:
        reads.append(path)
        return original(name, path)

    monkeypatch.setattr(registry_module, "_read_regular", counting)
    return reads


def test_a_future_mtime_does_not_make_every_resolve_read_again(
    root: Path, state: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files copied with their times from a host whose clock runs ahead: the change time,
    which the kernel sets, decides whether a signature is fresh, not the mtime."""
    ahead_ns = time.time_ns() + 3600 * 10**9
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        os.utime(root / "caps" / name, ns=(ahead_ns, ahead_ns))
    registry = registry_of(root, state, clock, wall_clock_ns=in_a_minute)
    first = registry.resolve("caps")
    reads = count_reads(monkeypatch)
    for _ in range(5):
        assert registry.resolve("caps") == first
    assert reads == []


def test_an_adapter_file_that_is_not_a_regular_file_or_too_large_is_refused(
    root: Path, state: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A FIFO in place of the weights (a read would block, and the registry's lock with it) and
    a file over MAX_ADAPTER_FILE_BYTES: Unavailable naming the adapter, at once; the other
    adapters resolve as before."""
    piped = root / "piped"
    piped.mkdir()
    shutil.copy(root / "caps" / CONFIG_FILE, piped / CONFIG_FILE)
    os.mkfifo(piped / WEIGHTS_FILE)
    registry = registry_of(root, state, clock, wall_clock_ns=in_a_minute)
    opened: list[str] = []
    real_open = os.open

    def recorded(path: Any, *args: Any, **kwargs: Any) -> int:
        opened.append(str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(registry_module.os, "open", recorded)
    started = time.monotonic()
    with pytest.raises(Unavailable, match="piped.*not a regular file"):
        registry.resolve("piped")
    assert time.monotonic() - started < 5
    assert str(piped / WEIGHTS_FILE) not in opened  # refused by its type, never opened
    monkeypatch.undo()
    assert registry.resolve("caps").name == "caps"
    monkeypatch.setattr(registry_module, "MAX_ADAPTER_FILE_BYTES", 64)
    with pytest.raises(Unavailable, match="french.*over the"):
        registry_of(root, state / "2", clock, wall_clock_ns=in_a_minute).resolve("french")


def in_a_minute() -> int:
    """A wall clock a minute ahead: files written now are old enough to trust their stat."""
    return time.time_ns() + 60 * 10**9


def test_fresh_files_are_read_again_until_their_timestamps_are_old(
    root: Path, state: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write in the same timestamp tick as the last stat leaves the signature as it was (here
    forced: same inode, same size, mtime restored as `cp -p` does); files that recent are not
    trusted by their stat alone."""
    registry = registry_of(root, state, clock)  # the real wall clock: the copies are fresh
    old = registry.resolve("caps")
    target = root / "caps" / WEIGHTS_FILE
    before = os.stat(target)
    data = bytearray(target.read_bytes())
    data[-1] ^= 1
    with open(target, "r+b") as out:
        out.write(data)
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))
    signature = registry._entries["caps"].signature
    monkeypatch.setattr("tiercache.lora.registry._signature", lambda name, folder: signature)
    assert registry.resolve("caps").digest != old.digest


def test_task_ids_are_stable_across_instances_and_never_reused(
    root: Path, state: Path, clock: FakeClock
) -> None:
    a = registry_of(root, state, clock)
    ids = {name: a.resolve(name).task_id for name in ("french", "caps")}
    assert sorted(ids.values()) == [1, 2]
    shutil.copytree(ADAPTERS / "brief", root / "brief")
    b = registry_of(root, state, clock)  # a second process, a restart
    assert b.resolve("brief").task_id == 3
    assert {name: b.resolve(name).task_id for name in ("caps", "french")} == ids
    shutil.rmtree(root / "caps")
    shutil.copytree(ADAPTERS / "caps", root / "other")
    c = registry_of(root, state, clock)
    assert c.resolve("other").task_id == 4  # caps's id stays retired for caps
    stored = json.loads((state / "lora" / "task_ids.json").read_text())
    assert stored["task_ids"] == {
        "brief": 3,
        "caps": ids["caps"],
        "french": ids["french"],
        "other": 4,
    }


def test_unknown_and_invalid_names(root: Path, state: Path, clock: FakeClock) -> None:
    registry = registry_of(root, state, clock)
    with pytest.raises(NotFound, match=r"unknown adapter 'nope' \(known: caps, french\)"):
        registry.resolve("nope")
    for bad in ("", "../french", ".hidden", "a/b", "x" * 65, "sp ace"):
        with pytest.raises(InvalidRequest, match="invalid adapter name"):
            registry.resolve(bad)


def test_new_folders_appear_at_once_when_root_changes(
    root: Path, state: Path, clock: FakeClock
) -> None:
    registry = registry_of(root, state, clock, rescan_interval_s=5.0)
    shutil.copytree(ADAPTERS / "brief", root / "brief")
    assert registry.resolve("brief").name == "brief"  # root's mtime moved: rescanned now
    assert registry.names() == ("brief", "caps", "french")


def test_rescans_are_paced_when_root_looks_unchanged(
    root: Path, state: Path, clock: FakeClock
) -> None:
    registry = registry_of(root, state, clock, rescan_interval_s=5.0)
    mtime = root.stat().st_mtime_ns
    shutil.copytree(ADAPTERS / "brief", root / "brief")
    os.utime(root, ns=(mtime, mtime))  # a file system whose directory mtime did not move
    with pytest.raises(NotFound):
        registry.resolve("brief")  # scanned at construction, not due yet
    clock.now += 5.0
    assert registry.resolve("brief").name == "brief"


def test_removed_folder_disappears(root: Path, state: Path, clock: FakeClock) -> None:
    registry = registry_of(root, state, clock)
    ref = registry.resolve("caps")
    shutil.rmtree(root / "caps")
    with pytest.raises(NotFound, match="caps"):
        registry.resolve("caps")
    with pytest.raises(Unavailable):
        registry.read(ref)
    clock.now += 10
    assert registry.names() == ("french",)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda d: (d / WEIGHTS_FILE).unlink(), f"has no {WEIGHTS_FILE}"),
        (lambda d: (d / CONFIG_FILE).write_text("{not json"), "not valid JSON"),
        (lambda d: (d / CONFIG_FILE).write_text('{"peft_type": "IA3"}'), "expected 'LORA'"),
        (lambda d: (d / CONFIG_FILE).write_text("[]"), "not a JSON object"),
        (lambda d: (d / CONFIG_FILE).write_text("[" * 100_000), "not valid JSON"),  # nesting
        (lambda d: (d / WEIGHTS_FILE).write_bytes(b"\x10\x00"), "not a whole safetensors"),
        # copied in place and read half-written: the header whole, part of the data
        (
            lambda d: (d / WEIGHTS_FILE).write_bytes((d / WEIGHTS_FILE).read_bytes()[:-100]),
            "still being written",
        ),
    ],
)
def test_broken_folder_is_unavailable_naming_the_adapter(
    root: Path, state: Path, clock: FakeClock, change: object, fragment: str
) -> None:
    registry = registry_of(root, state, clock)
    change(root / "caps")  # type: ignore[operator]
    with pytest.raises(Unavailable, match=fragment) as info:
        registry.resolve("caps")
    assert "'caps'" in info.value.message
    # the other adapters are unaffected; listing reports the problem, refs leaves caps out
    assert registry.resolve("french").name == "french"
    listing = {item.name: item for item in registry.listing()}
    assert listing["caps"].ref is None and fragment in listing["caps"].problem
    assert [r.name for r in registry.refs()] == ["french"]


def test_broken_folder_recovers_when_fixed(root: Path, state: Path, clock: FakeClock) -> None:
    registry = registry_of(root, state, clock)
    before = registry.resolve("caps")
    good = (root / "caps" / CONFIG_FILE).read_bytes()
    rewrite(root / "caps" / CONFIG_FILE, b'{"peft_type": "IA3"}')
    for _ in range(2):  # the problem is remembered for these files, and raised each time
        with pytest.raises(Unavailable):
            registry.resolve("caps")
    rewrite(root / "caps" / CONFIG_FILE, good)
    assert registry.resolve("caps") == before


def test_a_broken_folders_error_does_not_grow_with_each_request(
    root: Path, state: Path, clock: FakeClock
) -> None:
    """The remembered problem was raised again as the same object: each raise added the
    caller's frames to its traceback (each request's prompt kept alive) for as long as the
    folder stayed broken. Each request gets its own error now."""
    later = time.time_ns() + 10_000_000_000  # the files are old by then: their problem is kept
    registry = registry_of(root, state, clock, wall_clock_ns=lambda: later)
    rewrite(root / "caps" / CONFIG_FILE, b'{"peft_type": "IA3"}')
    raised = []
    for _ in range(50):
        with pytest.raises(Unavailable) as info:
            registry.resolve("caps")
        raised.append(info.value)
    assert len({id(e) for e in raised}) == 50
    depth = 0
    tb = raised[-1].__traceback__
    while tb is not None:
        depth, tb = depth + 1, tb.tb_next
    assert depth < 10
    assert raised[-1].message == raised[0].message


def test_missing_root_serves_no_adapters(tmp_path: Path, state: Path, clock: FakeClock) -> None:
    registry = registry_of(tmp_path / "absent", state, clock)
    assert registry.names() == ()
    with pytest.raises(NotFound, match="known: none"):
        registry.resolve("french")


def test_read_checks_the_digest(root: Path, state: Path, clock: FakeClock) -> None:
    registry = registry_of(root, state, clock)
    ref = registry.resolve("french")
    forged = AdapterRef("french", ref.task_id, "0" * 64)
    with pytest.raises(Unavailable, match="changed since"):
        registry.read(forged)
    with pytest.raises(InvalidRequest, match="digest"):
        registry.read(AdapterRef("french", ref.task_id, "xyz"))
    with pytest.raises(InvalidRequest, match="task id"):
        check_ref(AdapterRef("french", 0, ref.digest))


def write_manifest(path: Path, adapters: list[dict[str, object]]) -> Path:
    path.write_text(json.dumps({"adapters": adapters}))
    return path


def test_manifest_names_outside_root_and_fixes_task_ids(
    root: Path, tmp_path: Path, state: Path, clock: FakeClock
) -> None:
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(ADAPTERS / "brief", elsewhere / "short")
    manifest = write_manifest(
        elsewhere / "manifest.json",
        [
            {"name": "brief", "path": "short", "task_id": 7, "pin": True},
            {"name": "french", "path": str(root / "french")},
        ],
    )
    registry = registry_of(root, state, clock, manifest=manifest)
    assert registry.resolve("brief").task_id == 7
    assert registry.pinned() == ("brief",)
    assert registry.names() == ("brief", "caps", "french")
    assert registry.resolve("caps").task_id == 8  # ids after the manifest's
    # a declared folder that is missing is a problem, not an unknown name
    shutil.rmtree(elsewhere / "short")
    with pytest.raises(Unavailable, match="'brief'"):
        registry.resolve("brief")


@pytest.mark.parametrize(
    ("adapters", "fragment"),
    [
        ([{"name": "a", "task_id": 3}, {"name": "b", "task_id": 3}], "task id 3 is given to both"),
        ([{"name": "a"}, {"name": "a"}], "listed twice"),
        ([{"name": "../a"}], "invalid adapter name"),
        ([{"name": "a", "task_id": 0}], "task_id"),
        ([{"name": "a", "task_id": True}], "task_id"),
        ([{"name": "a", "pin": "yes"}], "pin"),
        ([{"name": "a", "colour": "red"}], "unknown keys"),
    ],
)
def test_bad_manifests_are_config_errors(
    root: Path,
    tmp_path: Path,
    state: Path,
    clock: FakeClock,
    adapters: list[dict[str, object]],
    fragment: str,
) -> None:
    manifest = write_manifest(tmp_path / "manifest.json", adapters)
    with pytest.raises(ConfigError, match=fragment):
        registry_of(root, state, clock, manifest=manifest)


def test_manifest_cannot_take_an_id_given_to_another_name(
    root: Path, tmp_path: Path, state: Path, clock: FakeClock
) -> None:
    registry = registry_of(root, state, clock)
    caps_id = registry.resolve("caps").task_id
    manifest = write_manifest(tmp_path / "m.json", [{"name": "french", "task_id": caps_id}])
    with pytest.raises(ConfigError, match="never reused"):
        registry_of(root, state, clock, manifest=manifest)


def test_unreadable_manifest_is_a_config_error(
    root: Path, tmp_path: Path, state: Path, clock: FakeClock
) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        registry_of(root, state, clock, manifest=tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"adapters": 3}')
    with pytest.raises(ConfigError, match="expected"):
        registry_of(root, state, clock, manifest=tmp_path / "bad.json")


def test_concurrent_assignment_gives_each_name_one_id(tmp_path: Path) -> None:
    """Two TaskIds on one file (as two processes; flock locks each open file separately)."""
    path = tmp_path / "lora" / "task_ids.json"
    tables = [TaskIds(path), TaskIds(path)]
    names = [f"adapter{i}" for i in range(30)]
    results: list[dict[str, int]] = [{}, {}]

    def run(k: int) -> None:
        for name in names if k == 0 else reversed(names):
            results[k][name] = tables[k].assign(name)

    threads = [threading.Thread(target=run, args=(k,)) for k in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert results[0] == results[1]
    assert sorted(results[0].values()) == list(range(1, 31))


def test_a_task_id_that_cannot_be_recorded_fails_one_resolve_not_the_adapter(
    root: Path, state: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ids file cannot be written once (a full disk): that resolve is unavailable, the next
    one loads the adapter, and the listing names the problem meanwhile instead of failing."""
    registry = registry_of(root, state, clock, wall_clock_ns=in_a_minute)
    assign = registry._task_ids.assign
    failures = [1]

    def full_disk(name: str) -> int:
        if failures[0]:
            failures[0] -= 1
            raise OSError(28, "No space left on device")
        return assign(name)

    monkeypatch.setattr(registry._task_ids, "assign", full_disk)
    with pytest.raises(Unavailable, match="task id could not be recorded"):
        registry.resolve("caps")
    assert registry.resolve("caps").name == "caps"
    assert {item.name for item in registry.listing()} == {"caps", "french"}


def test_reading_a_changed_adapter_does_not_hold_up_the_others(
    root: Path, state: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An adapter's files are read and hashed without the registry's lock: while a large
    changed adapter is read, another adapter resolves at once (prompt_cache resolves on its
    hit path)."""
    registry = registry_of(root, state, clock, wall_clock_ns=in_a_minute)
    registry.resolve("caps"), registry.resolve("french")
    reading, release = threading.Event(), threading.Event()
    read_files = registry_module._read_files

    def slow(name: str, folder: Path) -> Any:
        if name == "caps":
            reading.set()
            assert release.wait(10)
        return read_files(name, folder)

    monkeypatch.setattr(registry_module, "_read_files", slow)
    rewrite(root / "caps" / WEIGHTS_FILE, changed_weights(root / "caps" / WEIGHTS_FILE))
    changed: list[AdapterRef] = []
    reader = threading.Thread(target=lambda: changed.append(registry.resolve("caps")))
    reader.start()
    assert reading.wait(10)
    started = time.monotonic()
    assert registry.resolve("french").name == "french"
    waited = time.monotonic() - started
    release.set()
    reader.join(10)
    assert waited < 1.0, f"resolving another adapter waited {waited:.2f} s"
    assert changed and changed[0].name == "caps"


def test_concurrent_resolves_of_a_changed_adapter_read_its_files_once(
    root: Path, state: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst of requests naming an adapter just changed (the gateway's edge resolves on up to
    32 threads): each read the whole files at once (up to 2 GiB each). One reads; the others
    wait for its result."""
    import threading

    from tiercache.lora import registry as registry_module

    later = time.time_ns() + 10_000_000_000  # the files are not racy: one read settles them
    registry = registry_of(root, state, clock, wall_clock_ns=lambda: later)
    before = registry.resolve("caps")
    rewrite(root / "caps" / CONFIG_FILE, (root / "caps" / CONFIG_FILE).read_bytes() + b" ")
    reads = []
    real = registry_module._read_checked

    def slow(name: str, folder: Path) -> object:
        reads.append(name)
        time.sleep(0.2)
        return real(name, folder)

    monkeypatch.setattr(registry_module, "_read_checked", slow)
    found: list[object] = []
    threads = [
        threading.Thread(target=lambda: found.append(registry.resolve("caps"))) for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert reads == ["caps"] and len(set(found)) == 1 and found[0] != before
