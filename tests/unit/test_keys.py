"""Cache keys (tiercache.exact.keys): digest stability and scope, and the server secret."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tiercache.exact.keys import (
    SECRET_BYTES,
    EngineIdentity,
    draft_digest,
    key_fields,
    load_or_create_secret,
    request_digest,
    semantic_scope,
    tenant_scope,
)
from tiercache.exact.request import GenerationRequest

PYTHON_BACKEND = Path(__file__).resolve().parents[2] / "python_backend"
SECRET = b"s" * 32
ENGINE = EngineIdentity("org/model", "rev-1")
REQUEST = GenerationRequest(
    prompt="héllo ☃",
    max_tokens=9,
    temperature=0.5,
    top_p=0.9,
    top_k=4,
    seed=7,
    stop_words=("\n", "END"),
    lora_name="a",
)

_DIGEST_SCRIPT = """
from tiercache.exact.keys import EngineIdentity, request_digest, tenant_scope
from tiercache.exact.request import GenerationRequest
r = GenerationRequest(prompt="h\\u00e9llo \\u2603", max_tokens=9, temperature=0.5, top_p=0.9,
    top_k=4, seed=7, stop_words=("\\n", "END"), lora_name="a")
print(request_digest(tenant_scope(b"s" * 32, "acme"), EngineIdentity("org/model", "rev-1"), r))
"""


def digest(**changes: object) -> str:
    engine_fields = {k: v for k, v in changes.items() if k in ("model_id", "revision")}
    names = {f.name for f in dataclasses.fields(GenerationRequest)}
    request_fields = {k: v for k, v in changes.items() if k in names}
    engine = dataclasses.replace(ENGINE, **engine_fields)  # type: ignore[arg-type]
    request = dataclasses.replace(REQUEST, **request_fields)  # type: ignore[arg-type]
    adapter = str(changes.get("adapter_digest", ""))
    return request_digest(tenant_scope(SECRET, "acme"), engine, request, adapter)


def test_digest_is_hex_sha256() -> None:
    assert re.fullmatch(r"[0-9a-f]{64}", digest())


def test_digest_is_stable_across_processes() -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(PYTHON_BACKEND), *sys.path]),
        "PYTHONHASHSEED": "random",
    }
    out = subprocess.run(
        [sys.executable, "-c", _DIGEST_SCRIPT], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == digest()


def test_tenant_scope_differs_per_tenant_and_secret() -> None:
    scopes = {
        tenant_scope(SECRET, "acme"),
        tenant_scope(SECRET, "other"),
        tenant_scope(SECRET, ""),
        tenant_scope(b"t" * 32, "acme"),
    }
    assert len(scopes) == 4
    assert tenant_scope(SECRET, "acme") == tenant_scope(SECRET, "acme")


def test_digest_differs_per_tenant() -> None:
    a = request_digest(tenant_scope(SECRET, "a"), ENGINE, REQUEST)
    b = request_digest(tenant_scope(SECRET, "b"), ENGINE, REQUEST)
    assert a != b


@pytest.mark.parametrize(
    "change",
    [
        {"revision": "rev-2"},
        {"model_id": "org/other"},
        {"adapter_digest": "abc"},
        {"prompt": "hello ☃"},
        {"max_tokens": 10},
        {"temperature": 0.6},
        {"top_p": 0.8},
        {"top_k": 5},
        {"seed": 8},
        {"seed": None},
        {"stop_words": ("END",)},
        {"stop_words": ("\n", "END", "x")},
        {"lora_name": ""},
        {"history": (("user", "Hi"), ("assistant", "Hello"))},
        {"raw_prompt": True},
    ],
    ids=lambda c: "-".join(f"{k}={v!r}" for k, v in c.items()),
)
def test_digest_changes_with_every_key_field(change: dict[str, object]) -> None:
    assert digest(**change) != digest()


def test_digest_ignores_stream() -> None:
    assert digest(stream=True) == digest(stream=False)


def test_a_one_turn_request_keeps_the_digest_it_had_before_conversations() -> None:
    """History and raw_prompt enter the key only when set: every stored one-turn answer keeps
    its key (the pinned digest is the one releases before conversations computed)."""
    assert "history" not in key_fields(REQUEST) and "raw_prompt" not in key_fields(REQUEST)
    assert digest() == "90cb99dbac7eeefbc93cbd9b5d15dbefc8071c4cbf76917459de05a875becd22"


def test_the_semantic_scope_covers_the_earlier_turns_but_not_the_last() -> None:
    scope = tenant_scope(SECRET, "acme")
    after_a = dataclasses.replace(REQUEST, history=(("user", "Plan a trip"),))
    after_b = dataclasses.replace(REQUEST, history=(("user", "Write a poem"),))
    reworded = dataclasses.replace(after_a, prompt="something else entirely")
    scopes = [semantic_scope(scope, ENGINE, r, "embedder") for r in (after_a, after_b, reworded)]
    assert scopes[0] != scopes[1] and scopes[0] == scopes[2]
    assert semantic_scope(scope, ENGINE, REQUEST, "embedder") not in scopes


# ---------------------------------------------------------------- server secret


def test_secret_created_once_with_mode_0600(tmp_path: Path) -> None:
    path = tmp_path / "state" / "secret"
    first = load_or_create_secret(path)
    assert len(first) == SECRET_BYTES
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    inode = path.stat().st_ino
    assert load_or_create_secret(path) == first
    assert path.stat().st_ino == inode
    assert sorted(p.name for p in path.parent.iterdir()) == ["secret"]


def test_a_secret_others_may_read_is_taken_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A secret volume's default mode is 0644: whoever reads the secret can forge seals and
    sign Redis values. It was taken silently; it is taken with a warning now (0600 is not)."""
    path = tmp_path / "secret"
    load_or_create_secret(path)
    with caplog.at_level("WARNING", logger="tiercache.exact.keys"):
        load_or_create_secret(path)
    assert "can be read by other users" not in caplog.text
    path.chmod(0o644)
    with caplog.at_level("WARNING", logger="tiercache.exact.keys"):
        assert len(load_or_create_secret(path)) == SECRET_BYTES
    assert "can be read by other users (mode 644)" in caplog.text


def test_secret_differs_per_path(tmp_path: Path) -> None:
    assert load_or_create_secret(tmp_path / "a") != load_or_create_secret(tmp_path / "b")


def test_short_secret_file_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(b"short")
    path.chmod(0o600)  # whatever the umask
    with pytest.raises(RuntimeError, match="shorter"):
        load_or_create_secret(path)


def test_a_secret_another_user_could_have_chosen_is_refused(tmp_path: Path) -> None:
    """A secret (or admin token) file that another user may write (writable by others, or by
    a group this process is not in), or that another user (not root) owns in a folder another
    user may write (planted in a shared folder, or reached through a link), is refused with a
    message that says why, rather than used: whoever chose it would hold the seals. Taken: one
    read through a link (a mounted secret); one writable by this process's own group (a
    volume's fsGroup); one of another uid in a folder only this user or root writes (a
    secret bind-mounted into a container running as root)."""
    from tiercache.errors import ConfigError

    path = tmp_path / "secret"
    path.write_bytes(os.urandom(SECRET_BYTES))
    path.chmod(0o666)
    with pytest.raises(ConfigError, match="can be written by other users"):
        load_or_create_secret(path)
    path.chmod(0o660)  # its group is this process's
    link = tmp_path / "mounted"
    link.symlink_to(path)
    assert load_or_create_secret(link) == path.read_bytes()
    if os.geteuid() != 0:  # only root can give a file away
        return
    os.chown(path, 54321, os.getegid())
    assert load_or_create_secret(link) == path.read_bytes()  # in a folder only root writes
    os.chown(path, 54321, 54322)
    with pytest.raises(ConfigError, match="can be written by other users"):
        load_or_create_secret(link)  # its group (not this process's) may write it
    path.chmod(0o640)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    planted = shared / "secret"
    os.link(path, planted)
    with pytest.raises(ConfigError, match="owned by uid 54321.*another user may write"):
        load_or_create_secret(planted)
    # a name for a root-owned file of known content, planted where another user may write:
    # every check of the file itself passes, so the way to it is what is refused
    known = tmp_path / "known"
    known.write_bytes(b"NAME=a file anyone can read\n" * 2)
    known.chmod(0o644)
    theirs = shared / "theirs"
    theirs.symlink_to(known)
    os.lchown(theirs, 54321, 54321)  # another user's link, in a sticky shared folder
    ours = shared / "ours"
    ours.symlink_to(known)  # root's own link, but in a folder others may replace it in
    os.link(known, shared / "hard")  # a hard link: a root-owned file in a shared folder
    for name, fragment in (
        ("theirs", "reached through a link"),
        ("ours", "reached through a link"),
        ("hard", "owned by uid 0.*another user may write"),
    ):
        with pytest.raises(ConfigError, match=fragment):
            load_or_create_secret(shared / name)
    mounted = tmp_path / "via"
    mounted.symlink_to(theirs)  # a trusted link to an untrusted one: the chain is walked
    with pytest.raises(ConfigError, match="reached through a link"):
        load_or_create_secret(mounted)


def test_a_file_other_than_the_one_the_path_names_is_refused(tmp_path: Path) -> None:
    """The file opened must be the one the name leads to now: one swapped in between the open
    and the check (a link moved) is refused rather than trusted on another file's checks."""
    from tiercache.errors import ConfigError
    from tiercache.exact.keys import check_trusted_file

    one, other = tmp_path / "one", tmp_path / "other"
    for path in (one, other):
        path.write_bytes(os.urandom(SECRET_BYTES))
        path.chmod(0o600)
    check_trusted_file(one, one.stat(), "secret file")
    with pytest.raises(ConfigError, match="changed while it was read"):
        check_trusted_file(one, other.stat(), "secret file")


def _race(path: Path, barrier: object, results: object) -> None:
    barrier.wait()  # type: ignore[attr-defined]
    results.put(load_or_create_secret(path))  # type: ignore[attr-defined]


def test_concurrent_creation_yields_one_secret(tmp_path: Path) -> None:
    ctx = mp.get_context("fork")
    workers = 8
    barrier, results = ctx.Barrier(workers), ctx.Queue()
    path = tmp_path / "secret"
    procs = [ctx.Process(target=_race, args=(path, barrier, results)) for _ in range(workers)]
    for p in procs:
        p.start()
    secrets_seen = [results.get(timeout=20) for _ in procs]
    for p in procs:
        p.join(timeout=20)
        assert p.exitcode == 0
    assert len(set(secrets_seen)) == 1
    assert secrets_seen[0] == path.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["secret"]


def test_the_draft_digest_ignores_what_only_changes_the_answers_length() -> None:
    scope = tenant_scope(SECRET, "acme")

    def of(**changes: object) -> str:
        request = dataclasses.replace(REQUEST, **changes)  # type: ignore[arg-type]
        return draft_digest(scope, ENGINE, request, str(changes.get("adapter", "")))

    same = {of(), of(max_tokens=99), of(stop_words=("x",)), of(temperature=0.0, seed=None)}
    assert len(same) == 1
    others = {
        of(prompt="another"),
        of(history=(("user", "Hi"),)),
        of(raw_prompt=True),
        of(lora_name="b"),
        draft_digest(tenant_scope(SECRET, "other"), ENGINE, REQUEST),
        draft_digest(scope, EngineIdentity("org/model", "rev-2"), REQUEST),
    }
    assert len(others) == 6 and not others & same
    assert of() != request_digest(scope, ENGINE, REQUEST)  # never an answer's key


def test_links_in_the_folders_of_the_path_are_checked_and_followed_as_the_kernel_does(
    tmp_path: Path,
) -> None:
    """Every component is followed as the kernel follows it: a link among the folders is
    checked like one in the file's name (another user's, or in a folder others may write, is
    refused), and a relative link through a linked folder resolves from where the link really
    is (a legitimate layout, taken)."""
    from tiercache.errors import ConfigError

    real = tmp_path / "opt" / "conf"
    (real / "tc").mkdir(parents=True)
    (real / "shared").mkdir()
    secret = real / "shared" / "secret"
    secret.write_bytes(os.urandom(SECRET_BYTES))
    secret.chmod(0o600)
    (real / "tc" / "secret").symlink_to(Path("..") / "shared" / "secret")
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "tc").symlink_to(real / "tc")  # /etc/tc -> /opt/conf/tc, then ../shared/secret
    assert load_or_create_secret(etc / "tc" / "secret") == secret.read_bytes()
    assert load_or_create_secret(tmp_path / "etc" / ".." / "etc" / "tc" / "secret")
    shared = tmp_path / "public"
    shared.mkdir()
    shared.chmod(0o1777)
    (shared / "cfg").symlink_to(real / "shared")  # a folder reached through a public link
    with pytest.raises(ConfigError, match="reached through a link"):
        load_or_create_secret(shared / "cfg" / "secret")


def test_a_secret_volume_mounted_read_only_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Kubernetes secret volume: a world-writable (1777) tmpfs folder, mounted read-only,
    holding `secret -> ..data/secret` and `..data -> ..<timestamp>`. Nobody can plant
    anything on a read-only mount, so it is taken; the same folder writable is refused."""
    from tiercache.errors import ConfigError
    from tiercache.exact import keys

    volume = tmp_path / "secret-volume"
    (volume / "..2026_12_07").mkdir(parents=True)
    data = volume / "..2026_12_07" / "secret"
    data.write_bytes(os.urandom(SECRET_BYTES))
    data.chmod(0o444)
    (volume / "..data").symlink_to("..2026_12_07")
    (volume / "secret").symlink_to(Path("..data") / "secret")
    volume.chmod(0o1777)
    with pytest.raises(ConfigError, match="reached through a link"):
        load_or_create_secret(volume / "secret")  # writable: a link there could be planted
    real_statvfs = os.statvfs

    class ReadOnly:
        def __init__(self, result: os.statvfs_result) -> None:
            self.f_flag = result.f_flag | os.ST_RDONLY

    monkeypatch.setattr(
        keys.os,
        "statvfs",
        lambda where: (
            ReadOnly(real_statvfs(where)) if Path(where) == volume else real_statvfs(where)
        ),
    )
    assert load_or_create_secret(volume / "secret") == data.read_bytes()
