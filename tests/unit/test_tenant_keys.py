"""API keys -> tenants (tiercache.exact.tenant_keys): keys stored hashed, the tenant taken from
the key, another tenant / adapter / cache_control word refused, the file reloaded when it
changes."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from tiercache.adapter_types import AdapterRef
from tiercache.errors import ConfigError, Forbidden
from tiercache.exact.keys import EngineIdentity, tenant_scope
from tiercache.exact.prompt_cache import PromptCache
from tiercache.exact.request import RawInputs
from tiercache.exact.stores import MemoryStore
from tiercache.exact.tenant_keys import (
    KeyFile,
    add_key,
    hash_key,
    key_from_parameter,
    list_grants,
    revoke_key,
)
from tiercache.exact.tiered import TieredCache
from tiercache.vocabulary import CacheStatus, Tier

SECRET = b"s" * 32
ENGINE = EngineIdentity("model", "rev")


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def prompts() -> PromptCache:
    adapters = {
        "caps": AdapterRef("caps", 1, "c" * 64),
        "french": AdapterRef("french", 2, "f" * 64),
    }
    cache = TieredCache([(Tier.L1, MemoryStore(1 << 20))])
    return PromptCache(cache, SECRET, ENGINE, resolve_adapter=adapters.__getitem__)


def test_keys_are_stored_hashed_in_a_private_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    key, grant = add_key(path, "acme")
    assert key.startswith("tc_") and len(key) > 40
    assert key not in path.read_text()  # only its SHA-256
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert KeyFile(path).authorize(key) == grant
    assert [g.tenant for g in list_grants(path)] == ["acme"]


def test_a_rewritten_key_file_keeps_its_owner_and_mode(tmp_path: Path) -> None:
    """Adding or revoking a key rewrites the file whole: the new one keeps the old one's mode
    (a service group's read bit) and, where this user may give it, its owner and group (an
    operator's sudo must not leave a root-owned 0600 file the server cannot read)."""
    path = tmp_path / "keys.json"
    _, grant = add_key(path, "acme")
    path.chmod(0o640)
    add_key(path, "globex")
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    owner = (54321, 54322) if os.geteuid() == 0 else (os.geteuid(), os.getegid())
    if os.geteuid() == 0:  # only root can give a file away
        os.chown(path, *owner)
    assert revoke_key(path, grant.key_id)
    info = path.stat()
    assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (*owner, 0o640)
    assert [g.tenant for g in list_grants(path)] == ["globex"]


def test_keys_added_and_revoked_through_a_symlink_change_its_target(tmp_path: Path) -> None:
    """The server reads the link's target (`serve` resolves the path): revoking through the
    link must change that file, not put a new file in the link's place."""
    target = tmp_path / "secure" / "keys.json"
    key, grant = add_key(target, "acme")
    link = tmp_path / "keys-link.json"
    link.symlink_to(target)
    other, _ = add_key(link, "globex")
    assert link.is_symlink()
    assert revoke_key(link, grant.key_id)
    assert link.is_symlink()
    served = KeyFile(target)
    with pytest.raises(Forbidden):
        served.authorize(key)
    assert served.authorize(other).tenant == "globex"


def test_a_missing_or_unknown_key_is_forbidden(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    key, _ = add_key(path, "acme")
    keys = KeyFile(path)
    for bad in (None, "", key + "x", "tc_" + "A" * 43):
        with pytest.raises(Forbidden):
            keys.authorize(bad)


def test_the_header_may_carry_a_bearer_key() -> None:
    assert key_from_parameter("Bearer tc_abc") == "tc_abc"
    assert key_from_parameter("tc_abc") == "tc_abc"
    assert key_from_parameter("") is None and key_from_parameter(None) is None


def test_the_tenant_comes_from_the_key(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    key, _ = add_key(path, "acme")
    grant = KeyFile(path).authorize(key)
    front = prompts()
    omitted = front.lookup(RawInputs("What is Triton?"), grant=grant)
    assert omitted.request.tenant_scope == tenant_scope(SECRET, "acme")
    same = front.lookup(RawInputs("What is Triton?", tenant=" acme "), grant=grant)
    assert same.digest == omitted.digest  # the same tenant named (normalized) is fine
    with pytest.raises(Forbidden, match="does not match the API key's tenant"):
        front.lookup(RawInputs("What is Triton?", tenant="globex"), grant=grant)
    with pytest.raises(Forbidden):
        front.lookup(RawInputs("What is Triton?", tenant=""), grant=grant)  # "" is a tenant too


def test_a_key_limits_adapters_and_cache_control_words(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    key, _ = add_key(path, "acme", adapters=["caps"], cache_control=["no-store", "tag"])
    grant = KeyFile(path).authorize(key)
    front = prompts()
    ok = front.lookup(
        RawInputs("hi", lora_name="caps", cache_control="no-store tag=kb:v1"), grant=grant
    )
    assert ok.status is CacheStatus.MISS and ok.request.lora_name == "caps"
    with pytest.raises(Forbidden, match="adapter 'french'"):
        front.lookup(RawInputs("hi", lora_name="french"), grant=grant)
    with pytest.raises(Forbidden, match="no-cache"):
        front.lookup(RawInputs("hi", cache_control="no-cache"), grant=grant)
    with pytest.raises(Forbidden, match="max-age"):
        front.lookup(RawInputs("hi", cache_control="max-age=5"), grant=grant)
    assert front.lookup(RawInputs("hi"), grant=grant).status is CacheStatus.MISS  # base model


def test_the_file_is_reloaded_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    first, first_grant = add_key(path, "acme")
    clock = Clock()
    keys = KeyFile(path, clock=clock)
    second, _ = add_key(path, "globex")
    with pytest.raises(Forbidden):  # checked at most once a second
        keys.authorize(second)
    clock.now_s += 2
    assert keys.authorize(second).tenant == "globex"
    assert revoke_key(path, first_grant.key_id) and not revoke_key(path, first_grant.key_id)
    clock.now_s += 2
    with pytest.raises(Forbidden, match="unknown API key"):
        keys.authorize(first)
    good = path.read_text()
    path.write_text("{not json")  # a broken edit: every key refused until it is mended
    clock.now_s += 2
    with pytest.raises(Forbidden, match="unknown API key"):
        keys.authorize(second)
    path.write_text(good)
    clock.now_s += 2
    assert keys.authorize(second).tenant == "globex"


def test_a_key_file_removed_or_broken_refuses_every_key_until_it_is_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Failing closed: a file deleted, or broken by an edit meant to revoke a leaked key, must
    not leave the keys read before in force (they stayed until a restart). Reported once."""
    path = tmp_path / "keys.json"
    leaked, _ = add_key(path, "acme")
    clock = Clock()
    keys = KeyFile(path, clock=clock)
    assert keys.authorize(leaked).tenant == "acme"
    saved = path.read_text()
    path.unlink()
    for _ in range(3):
        clock.now_s += 2
        with pytest.raises(Forbidden, match="unknown API key"):
            keys.authorize(leaked)
        assert keys.grant_of(hash_key(leaked)) is None
    assert caplog.text.count("every API key is refused") == 1
    path.write_text(saved)
    clock.now_s += 2
    assert keys.authorize(leaked).tenant == "acme"


def test_a_key_file_that_cannot_be_read_is_tried_again_and_used_once_it_can(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A file another user's edit left unreadable to the stages (`sudo tiercache keys add`
    makes it root's, 0600) refuses every key; given back with chown or chmod, which move only
    its ctime, it is read again at the next check (it stayed refused until a restart or
    another edit). The failure is logged once a minute, not at every check."""
    path = tmp_path / "keys.json"
    key, _ = add_key(path, "acme")
    clock = Clock()
    keys = KeyFile(path, clock=clock)
    real = Path.open
    denied = [True]

    def opened(self: Path, *args: Any, **kwargs: Any) -> Any:
        if self == path and denied[0]:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", opened)
    os.utime(path, ns=(1, 1))  # another edit: the next check reads it, and cannot
    for _ in range(3):
        clock.now_s += 2
        with pytest.raises(Forbidden, match="unknown API key"):
            keys.authorize(key)
    assert caplog.text.count("cannot be read") == 1
    denied[0] = False  # given back: nothing of the file changed but its ctime, if that
    clock.now_s += 2
    assert keys.authorize(key).tenant == "acme"


@pytest.mark.parametrize(
    ("document", "fragment"),
    [
        ("[]", "expected"),
        (json.dumps({"version": 1, "keys": {}}), "must be a list"),
        (json.dumps({"version": 1, "keys": [{"tenant": "a", "id": "k"}]}), "sha256"),
        (
            json.dumps(
                {
                    "version": 1,
                    "keys": [
                        {"id": "k", "tenant": "a", "sha256": "0" * 64, "cache_control": ["x"]}
                    ],
                }
            ),
            "unknown cache_control",
        ),
    ],
)
def test_a_malformed_key_file_fails_the_start(tmp_path: Path, document: str, fragment: str) -> None:
    path = tmp_path / "keys.json"
    path.write_text(document)
    with pytest.raises(ConfigError, match=fragment):
        KeyFile(path)
    with pytest.raises(ConfigError, match="cannot be read"):
        KeyFile(tmp_path / "missing.json")


def test_the_keys_command_adds_lists_and_revokes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tiercache.cli import main

    path = tmp_path / "keys.json"
    assert main(["keys", "--file", str(path), "add", "--tenant", " Acme ", "--adapters", ""]) == 0
    added = capsys.readouterr()
    key = added.out.strip()
    assert added.out == key + "\n"  # the key alone: `... add > acme.key` is a key file
    assert "only time the key is shown" in added.err
    grant = KeyFile(path).authorize(key)
    assert (grant.tenant, grant.adapters, grant.cache_control) == ("Acme", frozenset(), None)
    assert main(["keys", "--file", str(path), "list"]) == 0
    listed = capsys.readouterr().out
    assert f"{grant.key_id}\tAcme\tadapters=none\tcache_control=any" in listed
    assert key not in listed
    assert main(["keys", "--file", str(path), "revoke", grant.key_id]) == 0
    assert main(["keys", "--file", str(path), "revoke", grant.key_id]) == 1
    assert list_grants(path) == []
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    capsys.readouterr()
    assert main(["keys", "--file", str(blocked / "keys.json"), "add", "--tenant", "x"]) == 1
    assert "key file" in capsys.readouterr().err  # an error, not a traceback


def test_serve_refuses_ports_out_of_range_and_a_watch_interval_of_zero(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from tiercache.cli import main

    for argv in (
        ["serve", "--gateway-port", "70000"],
        ["serve", "--grpc-port", "-1"],
        ["serve", "--watch-interval-s", "0"],
        ["gateway", "--port", "0"],
        ["serve", "--max-restarts", "-1"],
        ["serve", "--ready-timeout", "nan"],
        ["serve", "--exit-timeout-secs", "-1"],
    ):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2, argv
        err = capsys.readouterr().err
        assert "65535" in err or "more than 0" in err or "0 or more" in err, err


def test_serve_refuses_one_port_named_twice_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same port for gRPC and metrics (or the OpenAI endpoint) passed the probe and
    failed only once every model had loaded, minutes later."""
    from tiercache.cli import main

    state = tmp_path / "state"
    argv = ["serve", "--state-dir", str(state), "--grpc-port", "18001"]
    assert main([*argv, "--metrics-port", "18001"]) == 1
    assert "--metrics-port 18001 is also the gRPC port" in capsys.readouterr().err
    assert main([*argv, "--metrics-port", "18002", "--gateway-port", "18002"]) == 1
    assert "--gateway-port 18002 is also the metrics port" in capsys.readouterr().err


def test_serve_refuses_a_state_dir_another_user_owns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A state dir another user owns (a /tmp path they created first, or a link to theirs):
    they could plant the secret, the admin token or the backend's binaries in it. `serve`
    refuses it before writing or starting anything. The folder here is this test's, and
    `serve` runs as another uid (no root needed to give a folder away)."""
    from tiercache.cli import main

    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    owner = theirs.stat().st_uid
    monkeypatch.setattr(os, "geteuid", lambda: owner + 12345)
    assert main(["serve", "--state-dir", str(theirs)]) == 1
    err = capsys.readouterr().err
    assert f"belongs to uid {owner}, not to this user (uid {owner + 12345})" in err
    assert list(theirs.iterdir()) == []  # nothing written
    link = tmp_path / "link"
    link.symlink_to(theirs)
    assert main(["serve", "--state-dir", str(link)]) == 1


def test_every_cache_control_word_is_one_a_key_can_allow_or_refuse() -> None:
    """A word missing from `used_words` would pass every key's cache_control limit unseen."""
    from tiercache.exact.request import CacheControl
    from tiercache.exact.tenant_keys import used_words

    for word in CacheControl.WORDS:
        assert used_words(CacheControl.parse(word)) == (word,), word
    valued = used_words(CacheControl.parse("max-age=5 tag=kb:v1"))
    assert valued == ("max-age", "tag")


def test_a_key_files_tenant_is_named_as_every_stage_names_tenants(tmp_path: Path) -> None:
    """A key file written by hand with "acme " (or a compatibility form) names the tenant an
    invalidation and a `tenant` input call "acme": one scope, not two."""
    path = tmp_path / "keys.json"
    key, added = add_key(path, " ａｃｍｅ ")  # full-width letters, spaces around
    assert added.tenant == "acme"
    document = json.loads(path.read_text())
    document["keys"][0]["tenant"] = "acme "  # as an operator's editor might leave it
    path.write_text(json.dumps(document))
    grant = KeyFile(path).authorize(key)
    assert grant.tenant == "acme"
    front = prompts()
    keyed = front.lookup(RawInputs("What is Triton?"), grant=grant)
    assert keyed.request.tenant_scope == tenant_scope(SECRET, "acme")
    named = front.lookup(RawInputs("What is Triton?", tenant="acme"), grant=grant)
    assert named.digest == keyed.digest


def test_a_key_file_another_user_could_have_chosen_is_refused_at_every_read(
    tmp_path: Path,
) -> None:
    """The key file is read live by every stage: one replaced by, or reached through, what
    another user may change (a folder others may write) refuses every key from the next
    check on, as a broken file does, and is taken again once it is safe."""
    folder = tmp_path / "keys"
    folder.mkdir()
    path = folder / "keys.json"
    key, _ = add_key(path, "acme")
    clock = Clock()
    keys = KeyFile(path, clock=clock)
    assert keys.authorize(key).tenant == "acme"
    folder.chmod(0o777)  # another user could now rename their own file into place
    os.utime(path, ns=(1, 1))
    clock.now_s += 2
    with pytest.raises(Forbidden, match="unknown API key"):
        keys.authorize(key)
    with pytest.raises(ConfigError, match="another user may write"):
        KeyFile(path)  # and a stage starting now does not start on it
    folder.chmod(0o755)  # made safe again, the file itself untouched: taken at the next check
    clock.now_s += 2
    assert keys.authorize(key).tenant == "acme"


def test_a_revoke_in_force_is_reported_done_whatever_the_folder_sync_or_owner_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Once the new file is renamed into place the change is in force: a folder that then
    cannot be synced (EIO) is logged, not raised (`keys revoke` would otherwise report a
    revoke that took effect as failed); an owner the user namespace cannot map (fchown's
    EINVAL in a rootless container) is logged as one this user may not give."""
    import errno

    from tiercache.exact import keys as keys_module

    path = tmp_path / "keys.json"
    leaked, entry = add_key(path, "acme")
    kept, _ = add_key(path, "acme")
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    def fchown(fd: int, uid: int, gid: int) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "fchown", fchown)
    monkeypatch.setattr(os, "geteuid", lambda: 54321)  # the file is another user's to it
    monkeypatch.setattr(keys_module, "_placed_by_us", lambda folder, where: True)
    assert revoke_key(path, entry.key_id)
    assert "could not be synced" in caplog.text and "now this user's" in caplog.text
    keys = KeyFile(path)
    assert keys.grant_of(hash_key(leaked)) is None
    assert keys.authorize(kept).tenant == "acme"
