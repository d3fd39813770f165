"""The exact-hit path's memos (tiercache.exact.memo): a repeated request skips canonicalizing,
digesting and sealing, and gets exactly what a cache without memos computes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiercache.adapter_types import AdapterRef
from tiercache.errors import Forbidden, InvalidRequest
from tiercache.exact import prompt_cache as prompt_cache_module
from tiercache.exact.keys import EngineIdentity
from tiercache.exact.memo import MEMO_MAX_CHARS, Memo
from tiercache.exact.prompt_cache import PromptCache
from tiercache.exact.request import RawInputs
from tiercache.exact.stores import MemoryStore
from tiercache.exact.tenant_keys import KeyFile, add_key
from tiercache.exact.tiered import TieredCache
from tiercache.vocabulary import CacheStatus, Tier

SECRET = b"s" * 32
ENGINE = EngineIdentity("model", "rev")

REQUESTS = [
    RawInputs("What is Triton?"),
    RawInputs("What is Triton?", max_tokens=8, stream=True),
    RawInputs("  What   is Triton?  ", tenant="acme"),
    RawInputs(b"What is Triton?", stop_words=[b"\n", "."], cache_control="tag=docs"),
    RawInputs("Sample me", temperature=0.7, seed=3),
    RawInputs("Sample me", temperature=0.7),  # no seed: not cacheable (bypass)
    RawInputs("Bonjour", lora_name="french"),
    RawInputs("What is Triton?", cache_control="no-store, max-age=60"),
]


def prompts(adapters: dict[str, AdapterRef] | None = None) -> PromptCache:
    versions = adapters if adapters is not None else {"french": AdapterRef("french", 2, "f" * 64)}
    cache = TieredCache([(Tier.L1, MemoryStore(1 << 20))])
    return PromptCache(cache, SECRET, ENGINE, resolve_adapter=lambda name: versions[name])


def test_a_full_memo_turns_a_generation_and_keeps_what_was_asked_for_since() -> None:
    """A new key that finds the current generation full makes it the old one (the generation
    before it is forgotten); a key found in the old one moves to the current one."""
    memo: Memo[int] = Memo(2)
    memo.put("a", 1)
    memo.put("b", 2)
    assert memo.put("b", 3) == 3 and len(memo) == 2  # an old key is replaced, nothing turned
    memo.put("c", 4)  # full: {a, b} are the old generation now, {c} the current one
    assert (memo.get("c"), len(memo)) == (4, 3)
    assert memo.get("a") == 1  # from the old generation, moved to the current one
    memo.put("d", 5)  # full again ({c, a}): {a, b} forgotten, {c, a} the old generation
    assert (memo.get("b"), memo.get("a"), memo.get("c"), memo.get("d")) == (None, 1, 4, 5)
    with pytest.raises(ValueError, match="at least one"):
        Memo(0)


def test_a_memo_generation_is_full_at_its_characters_too() -> None:
    memo: Memo[int] = Memo(100, max_chars=MEMO_MAX_CHARS)
    memo.put("a", 1, MEMO_MAX_CHARS - 10)
    memo.put("b", 2, 10)
    assert (len(memo), memo.chars) == (2, MEMO_MAX_CHARS)
    memo.put("b", 3, 10)  # an old key is replaced, counted once
    assert (memo.get("b"), len(memo), memo.chars) == (3, 2, MEMO_MAX_CHARS)
    memo.put("c", 4, 1)  # one character over: a new generation first
    assert (memo.get("c"), len(memo), memo.chars) == (4, 3, MEMO_MAX_CHARS + 1)
    memo.put("d", 5, MEMO_MAX_CHARS + 1)  # larger than a generation: not kept, nothing lost
    assert (memo.get("d"), memo.get("c"), memo.get("b")) == (None, 4, 3)  # b moved: {c, b}
    assert memo.chars == MEMO_MAX_CHARS + 11  # b counts in each generation until the next turn
    assert memo.get("a") == 1  # 4,086 characters do not fit beside c and b: a turn, {a} now
    assert (memo.chars, memo.get("c"), memo.get("b")) == (4086 + 11, 4, 3)
    with pytest.raises(ValueError, match="characters"):
        Memo(10, max_chars=MEMO_MAX_CHARS - 1)


def test_a_memo_generation_full_at_its_entries_starts_counting_again() -> None:
    memo: Memo[int] = Memo(2)
    memo.put("a", 1, 100)
    memo.put("b", 2, 200)
    memo.put("c", 3, 7)
    assert (memo.get("c"), len(memo), memo.chars) == (3, 3, 307)
    memo.put("d", 4, 1)
    memo.put("e", 5, 2)  # {a, b} forgotten
    assert (memo.get("a"), len(memo), memo.chars) == (None, 3, 10)


def test_hot_keys_outlive_the_cold_ones_passing_by() -> None:
    """A hot set asked for between turns survives any number of keys asked for once: a memo
    cleared when full lost it at every clear (here every 128 keys, the two generations'
    entries)."""
    memo: Memo[int] = Memo(64)
    hot = [f"hot {i}" for i in range(32)]
    for key in hot:
        memo.put(key, 1)
    for cold in range(10_000):
        memo.put(f"cold {cold}", 0)
        key = hot[cold % len(hot)]  # each hot key asked for once every 32 cold keys
        assert memo.get(key) == 1, (cold, key)
    assert len(memo) <= 2 * 64


def test_an_issue_steps_keys_stay_memoized_past_a_generation_of_live_entries() -> None:
    """llm's decoded hits are keyed by their envelope, which names its issue step: each step
    brings every hot prompt's key anew. 3,000 hot prompts in a memo of 4,096 entries a
    generation: within the second step every prompt's second request hits (a memo cleared when
    full threw away the step's first 1,096 keys when it filled, and asked for them again)."""
    memo: Memo[str] = Memo()
    prompts = [f"prompt {i}" for i in range(3000)]
    for step in (1, 2, 3):
        for prompt in prompts:
            if memo.get((prompt, step)) is None:
                memo.put((prompt, step), prompt, 100)
        assert all(memo.get((prompt, step)) == prompt for prompt in prompts), step


def test_padding_the_inputs_counts_in_the_memos() -> None:
    """Spaces that normalization removes are still held by the memo's key (the inputs as
    received): they count, so padded requests cannot fill a memo past its characters."""
    cache = prompts()
    padded = RawInputs("What is Triton?" + " " * 3000, cache_control=" " * 500)
    cache.lookup(padded)
    assert cache._canonical.chars >= 3515 and cache._requests.chars >= 3515
    plain = prompts()
    plain.lookup(RawInputs("What is Triton?"))
    assert plain._canonical.chars < 100


def test_a_few_thousand_hot_prompts_stay_memoized() -> None:
    """2,048 distinct prompts asked in turn: after the first pass every lookup is a memo hit
    (1,024 entries were cleared every 1,024 new requests, so none ever hit), and the memos
    count each entry's text."""
    cache = prompts()
    raws = [RawInputs(f"What is the capital of country number {i}?") for i in range(2048)]
    first = [cache.lookup(raw) for raw in raws]
    held = (len(cache._canonical), len(cache._requests))
    assert held == (2048, 2048) and cache._canonical.chars > 2048 * 2 * 38
    again = [cache.lookup(raw) for raw in raws]
    assert again == first
    # the memoized request objects themselves: nothing was canonicalized or digested again
    assert all(a.request is b.request for a, b in zip(again, first, strict=True))
    assert (len(cache._canonical), len(cache._requests)) == held


def test_repeated_lookups_equal_a_fresh_cache_s() -> None:
    memoized = prompts()
    for raw in REQUESTS:
        first = memoized.lookup(raw)
        again = memoized.lookup(raw)
        assert first == again
        assert again == prompts().lookup(raw), raw
    stored = memoized.lookup(REQUESTS[0])
    assert stored.digest is not None
    memoized.cache.put(stored.digest, "Triton serves models.")
    hit = memoized.lookup(REQUESTS[0])
    assert (hit.status, hit.text) == (CacheStatus.EXACT, "Triton serves models.")


def test_a_new_adapter_version_is_a_new_key_at_once() -> None:
    versions = {"french": AdapterRef("french", 2, "f" * 64)}
    cache = prompts(versions)
    raw = RawInputs("Bonjour", lora_name="french")
    old = cache.lookup(raw)
    versions["french"] = AdapterRef("french", 2, "e" * 64)  # the folder changed
    new = cache.lookup(raw)
    assert new.request.lora_digest == "e" * 64 and new.digest != old.digest
    assert new == prompts(versions).lookup(raw)


def test_the_same_inputs_under_two_keys_stay_two_tenants(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    acme_key, _ = add_key(path, "acme")
    globex_key, _ = add_key(path, "globex", adapters=[])
    keys = KeyFile(path)
    cache = prompts()
    raw = RawInputs("What is Triton?")
    as_acme = cache.lookup(raw, grant=keys.authorize(acme_key))
    as_globex = cache.lookup(raw, grant=keys.authorize(globex_key))
    assert as_acme.request.tenant_scope != as_globex.request.tenant_scope
    assert as_acme.digest != as_globex.digest
    assert cache.lookup(raw, grant=keys.authorize(acme_key)) == as_acme
    # a grant's limits are checked on every request, memoized or not
    with pytest.raises(Forbidden):
        cache.lookup(RawInputs("Bonjour", lora_name="french"), grant=keys.authorize(globex_key))


def counting_canonicalize(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every request canonicalized from now on (not taken from a memo), by its prompt."""
    made: list[str] = []
    real = prompt_cache_module.canonicalize

    def counted(raw: RawInputs, *args: object) -> object:
        made.append(str(raw.text_input))
        return real(raw, *args)

    monkeypatch.setattr(prompt_cache_module, "canonicalize", counted)
    return made


def test_one_tenants_request_is_not_memoized_for_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With API keys the raw inputs name no tenant: the canonical form is kept per tenant, so
    another tenant's identical request takes none of it (a memo's hit is a few microseconds
    faster: it would tell that caller what another tenant asked lately). Two keys of one
    tenant share it, as they share its cache."""
    path = tmp_path / "keys.json"
    acme_key, _ = add_key(path, "acme")
    acme_again, _ = add_key(path, "acme")
    globex_key, _ = add_key(path, "globex")
    keys = KeyFile(path)
    cache = prompts()
    made = counting_canonicalize(monkeypatch)
    raw = RawInputs("What is Triton?")
    cache.lookup(raw, grant=keys.authorize(acme_key))
    assert len(made) == 1
    cache.lookup(raw, grant=keys.authorize(globex_key))
    assert len(made) == 2  # not acme's
    cache.lookup(raw, grant=keys.authorize(acme_again))
    cache.lookup(raw, grant=keys.authorize(globex_key))
    assert len(made) == 2


def test_a_padded_tenants_requests_are_never_memoized(monkeypatch: pytest.MonkeyPatch) -> None:
    """A padded tenant's time in prompt_cache must not depend on what was asked before (its
    padding starts in llm): its requests are canonicalized and digested every time, and kept
    in no memo, while another tenant's are."""
    cache = prompts()
    padded = cache.scope("public")
    cache.deferred = lambda scope: scope == padded
    made = counting_canonicalize(monkeypatch)
    public = RawInputs("What is Triton?", tenant="public")
    first = cache.lookup(public)
    again = cache.lookup(public)
    assert len(made) == 2 and first == again
    assert first.status is CacheStatus.MISS  # not looked up here: llm does, padded
    assert len(cache._canonical) == 0 and len(cache._requests) == 0
    cache.lookup(RawInputs("What is Triton?", tenant="acme"))
    cache.lookup(RawInputs("What is Triton?", tenant="acme"))
    assert len(made) == 3 and len(cache._canonical) == 1 and len(cache._requests) == 1


def test_bad_and_long_requests_are_not_memoized() -> None:
    cache = prompts()
    for _ in range(2):
        with pytest.raises(InvalidRequest, match="max_tokens"):
            cache.lookup(RawInputs("What is Triton?", max_tokens=0))
    assert len(cache._canonical) == 0 and len(cache._requests) == 0
    long = RawInputs("word " * (MEMO_MAX_CHARS // 5 + 1))
    assert cache.lookup(long) == prompts().lookup(long)
    assert len(cache._canonical) == 0 and len(cache._requests) == 0
    cache.lookup(REQUESTS[0])
    assert len(cache._canonical) == 1 and len(cache._requests) == 1
    # short raw, long once normalized: U+FDFA is one character NFKC makes 18 (bounded by the
    # raw key's length alone, 1,024 of them took 83 MiB of memo)
    grown = RawInputs("\ufdfa" * 900)
    assert len(grown.text_input or "") <= MEMO_MAX_CHARS
    assert cache.lookup(grown) == prompts().lookup(grown)
    assert len(cache._canonical) == 1 and len(cache._requests) == 1
