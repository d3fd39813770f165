"""The gateway's edge layer (tiercache.gateway.edge) and the terms it must share with the running
stages (tiercache.stages.contract): it serves an exact hit only when the stages published the
terms it computed, never to a padded tenant (not even looked up), never past a refused key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiercache.exact.keys import EngineIdentity
from tiercache.exact.prompt_cache import PromptCache
from tiercache.exact.request import DEFAULT_LIMITS, RawInputs
from tiercache.exact.stores import MemoryStore
from tiercache.exact.tenant_keys import KeyFile, add_key
from tiercache.exact.tiered import TieredCache
from tiercache.gateway.edge import EdgeCache
from tiercache.padding import PaddingPolicy
from tiercache.stages.contract import (
    LLM,
    PROMPT_CACHE,
    ContractCheck,
    contract_path,
    llm_terms,
    prompt_cache_terms,
    write_terms,
)
from tiercache.vocabulary import Tier

SECRET = b"s" * 32
ENGINE = EngineIdentity("model", "rev")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def terms(keys: Path | None = None, padding: PaddingPolicy | None = None) -> dict:
    return {
        PROMPT_CACHE: prompt_cache_terms(keys, SECRET, ENGINE, DEFAULT_LIMITS),
        LLM: llm_terms(padding or PaddingPolicy()),
    }


def publish(state: Path, published: dict) -> None:
    for stage, document in published.items():
        write_terms(state, stage, document)


def check(state: Path, expected: dict, clock: Clock | None = None) -> ContractCheck:
    return ContractCheck(
        {stage: (state, t) for stage, t in expected.items()}, clock=clock or Clock()
    )


def test_the_contract_holds_only_while_every_stage_published_the_same_terms(
    tmp_path: Path,
) -> None:
    clock = Clock()
    contract = check(tmp_path, terms(), clock)
    assert not contract.holds() and "published no terms" in contract.reason
    publish(tmp_path, terms())
    assert not contract.holds()  # checked at most once a second
    clock.now += 1.0
    assert contract.holds() and contract.reason == ""
    other = prompt_cache_terms(tmp_path / "keys.json", SECRET, ENGINE, DEFAULT_LIMITS)
    write_terms(tmp_path, PROMPT_CACHE, other)  # prompt_cache restarted with a key file
    clock.now += 1.0
    assert not contract.holds() and "api_keys_file" in contract.reason
    contract_path(tmp_path, LLM).write_text("{broken")
    write_terms(tmp_path, PROMPT_CACHE, terms()[PROMPT_CACHE])
    clock.now += 1.0
    assert not contract.holds() and "cannot be read" in contract.reason


def test_terms_hold_no_secret(tmp_path: Path) -> None:
    padding = PaddingPolicy(0.05, 0.01, frozenset({"a" * 64}))
    publish(tmp_path, terms(padding=padding))
    text = "".join(contract_path(tmp_path, s).read_text() for s in (PROMPT_CACHE, LLM))
    assert SECRET.decode() not in text and "a" * 64 not in text
    assert json.loads(contract_path(tmp_path, LLM).read_text())["padding"]["floor_s"] == 0.05


def edge(
    tmp_path: Path,
    padding: PaddingPolicy | None = None,
    keys: KeyFile | None = None,
    published: dict | None = None,
) -> tuple[EdgeCache, PromptCache]:
    lookup = PromptCache(TieredCache([(Tier.L1, MemoryStore(1 << 20))]), SECRET, ENGINE)
    keys_path = None if keys is None else keys.path
    expected = terms(keys_path, padding)
    publish(tmp_path, expected if published is None else published)
    contract = check(tmp_path, expected)
    return EdgeCache(lookup, padding or PaddingPolicy(), contract, keys), lookup


def stored(lookup: PromptCache, raw: RawInputs, text: str, grant: object = None) -> None:
    result = lookup.lookup(raw, grant=grant)  # type: ignore[arg-type]
    assert result.digest is not None
    lookup.cache.put(result.digest, text, generated_tokens=4, prompt_tokens=9)


def test_an_exact_hit_is_served_with_its_stored_token_counts(tmp_path: Path) -> None:
    cache, lookup = edge(tmp_path)
    raw = RawInputs("What is Triton?", max_tokens=8)
    assert cache.answer(raw, None) is None  # a miss: the ensemble's
    stored(lookup, raw, "An inference server.")
    hit = cache.answer(raw, None)
    assert hit is not None and (hit.text, hit.tier, hit.tokens) == (
        "An inference server.",
        "l1",
        (9, 4, 0),
    )
    assert (
        cache.answer(RawInputs("What is Triton?", max_tokens=8, cache_control="no-cache"), None)
        is None
    )
    assert cache.answer(RawInputs("", max_tokens=8), None) is None  # refused: the ensemble says why


def test_nothing_is_served_while_the_stages_run_with_other_terms(tmp_path: Path) -> None:
    """A gateway without the stages' key file (the stages have one) serves nothing."""
    published = terms(tmp_path / "keys.json")
    cache, lookup = edge(tmp_path, published=published)
    raw = RawInputs("What is Triton?")
    stored(lookup, raw, "cached")
    assert cache.answer(raw, None) is None


def test_a_padded_tenant_is_not_even_looked_up_a_trusted_one_is_served(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.json"
    padded_key, padded = add_key(keys_file, "padded")
    trusted_key, trusted = add_key(keys_file, "trusted")
    lookup_scope = PromptCache(TieredCache([]), SECRET, ENGINE).scope("trusted")
    padding = PaddingPolicy(0.05, 0.0, frozenset({lookup_scope}))
    cache, lookup = edge(tmp_path, padding, KeyFile(keys_file))
    raw = RawInputs("What is Triton?")
    stored(lookup, raw, "for the padded tenant", padded)
    stored(lookup, raw, "for the trusted tenant", trusted)
    reads = lookup.cache.stores()[0][1].stats().hits
    assert cache.answer(raw, f"Bearer {padded_key}") is None
    assert lookup.cache.stores()[0][1].stats().hits == reads  # no tier was read for it
    hit = cache.answer(raw, f"Bearer {trusted_key}")
    assert hit is not None and hit.text == "for the trusted tenant"
    assert cache.answer(raw, "Bearer not-a-key") is None
    assert cache.answer(raw, None) is None


def test_the_tiers_own_terms_are_part_of_the_contract(tmp_path: Path) -> None:
    """A stage restarted with another ttl_s, Redis (or prefix) or adapters folder publishes
    other terms: an edge built with the old ones serves nothing until it is built again. The
    Redis password never appears."""
    from tiercache.config import PromptCacheConfig
    from tiercache.stages.contract import deployment_terms

    base = PromptCacheConfig(state_dir=str(tmp_path))
    variants = {
        "ttl_s": PromptCacheConfig(state_dir=str(tmp_path), ttl_s=3600.0),
        "redis": PromptCacheConfig(state_dir=str(tmp_path), redis_url="redis://:pw@h:6379/0"),
        "prefix": PromptCacheConfig(
            state_dir=str(tmp_path), redis_url="redis://:pw@h:6379/0", redis_prefix="other:"
        ),
        "adapters": PromptCacheConfig(state_dir=str(tmp_path), adapters_dir=str(tmp_path / "a")),
    }
    expected = {
        PROMPT_CACHE: prompt_cache_terms(
            None, SECRET, ENGINE, DEFAULT_LIMITS, deployment_terms(base)
        )
    }
    clock = Clock()
    contract = check(tmp_path, expected, clock)
    publish(tmp_path, expected)
    clock.now += 1.0
    assert contract.holds()
    for name, config in variants.items():
        published = prompt_cache_terms(
            None, SECRET, ENGINE, DEFAULT_LIMITS, deployment_terms(config)
        )
        assert published != expected[PROMPT_CACHE], name
        write_terms(tmp_path, PROMPT_CACHE, published)
        clock.now += 1.0
        assert not contract.holds() and "deployment" in contract.reason, name
        assert "pw" not in contract_path(tmp_path, PROMPT_CACHE).read_text()
    write_terms(tmp_path, PROMPT_CACHE, expected[PROMPT_CACHE])
    clock.now += 1.0
    assert contract.holds()


def test_prompt_cache_does_not_look_up_what_llm_pads(tmp_path: Path) -> None:
    """llm publishes whom it pads (trusted tenants as hashes of their scopes); prompt_cache
    then treats a padded tenant's request as a miss without reading the cache, and with no
    semantic lookup, so a direct caller learns nothing; trusted tenants are looked up as
    before. Without llm's document, or with padding off, everyone is looked up."""
    from tiercache.exact.keys import tenant_scope
    from tiercache.stages.contract import PaddedTenants

    clock = Clock()
    padded = PaddedTenants(tmp_path, clock=clock)
    lookup = PromptCache(TieredCache([(Tier.L1, MemoryStore(1 << 20))]), SECRET, ENGINE)
    lookup.deferred = padded.pads
    raw_public = RawInputs("What is Triton?", tenant="public")
    raw_trusted = RawInputs("What is Triton?", tenant="acme")
    stored(lookup, raw_public, "the public tenant's answer")
    stored(lookup, raw_trusted, "acme's answer")
    assert lookup.lookup(raw_public).status.value == "exact"  # no document: as before
    trusted = frozenset({tenant_scope(SECRET, "acme")})
    write_terms(tmp_path, LLM, llm_terms(PaddingPolicy(0.05, 0.0, trusted)))
    clock.now += 1.0
    public = lookup.lookup(raw_public)
    assert (public.status.value, public.text, public.semantic_lookup) == ("miss", "", False)
    assert lookup.lookup(raw_trusted).text == "acme's answer"
    assert tenant_scope(SECRET, "acme") not in contract_path(tmp_path, LLM).read_text()
    write_terms(tmp_path, LLM, llm_terms(PaddingPolicy()))  # padding off again
    clock.now += 1.0
    assert lookup.lookup(raw_public).text == "the public tenant's answer"


@pytest.mark.parametrize(
    "damage",
    ["not json", "[]", '{"other": 1}', '{"padding": 7}', '{"padding": {"trusted_hashes": 1}}'],
)
def test_terms_that_cannot_be_read_defer_every_tenant(tmp_path: Path, damage: str) -> None:
    """llm's terms file there but unreadable or not llm's document: prompt_cache cannot know
    whom llm pads, so it defers every tenant (it looked every one up: failing open)."""
    from tiercache.exact.keys import tenant_scope
    from tiercache.stages.contract import PaddedTenants

    clock = Clock()
    padded = PaddedTenants(tmp_path, clock=clock)
    write_terms(tmp_path, LLM, llm_terms(PaddingPolicy()))  # padding off: nobody deferred
    assert not padded.pads(tenant_scope(SECRET, "acme"))
    contract_path(tmp_path, LLM).write_text(damage)
    clock.now += 1.0
    assert padded.pads(tenant_scope(SECRET, "acme"))
    assert padded.pads(tenant_scope(SECRET, "public"))


def test_a_padding_llm_that_cannot_publish_its_terms_does_not_start(tmp_path: Path) -> None:
    """Terms that other stages rely on (whom llm pads) are required: a failed write raises;
    other terms are only logged."""
    from tiercache.errors import ConfigError

    blocked = tmp_path / "state"
    blocked.mkdir()
    (blocked / "edge").write_text("a file where the folder should be")
    with pytest.raises(ConfigError, match="could not publish llm's terms"):
        write_terms(blocked, LLM, llm_terms(PaddingPolicy(0.05, 0.0)), required=True)
    write_terms(blocked, LLM, llm_terms(PaddingPolicy()))  # not required: logged only


def test_with_one_kv_reuse_tenant_the_edge_serves_no_other(tmp_path: Path) -> None:
    """llm refuses every tenant but `trtllm_kv_reuse_tenant`'s, hits included (a 403): the
    edge served another tenant's cached answer with a 200 (and the flip told a hit). It serves
    that tenant only, and an llm published without that restriction breaks the contract."""
    keys_file = tmp_path / "keys.json"
    only_key, only = add_key(keys_file, "only")
    other_key, other = add_key(keys_file, "other")
    scope = PromptCache(TieredCache([]), SECRET, ENGINE).scope("only")
    lookup = PromptCache(TieredCache([(Tier.L1, MemoryStore(1 << 20))]), SECRET, ENGINE)
    expected = {
        PROMPT_CACHE: prompt_cache_terms(keys_file, SECRET, ENGINE, DEFAULT_LIMITS),
        LLM: llm_terms(PaddingPolicy(), scope),
    }
    publish(tmp_path, expected)
    cache = EdgeCache(
        lookup, PaddingPolicy(), check(tmp_path, expected), KeyFile(keys_file), None, None, scope
    )
    raw = RawInputs("What is Triton?")
    stored(lookup, raw, "for the one tenant", only)
    stored(lookup, raw, "for another tenant", other)
    assert cache.answer(raw, f"Bearer {other_key}") is None  # the ensemble answers its 403
    hit = cache.answer(raw, f"Bearer {only_key}")
    assert hit is not None and hit.text == "for the one tenant"
    publish(tmp_path, {LLM: llm_terms(PaddingPolicy())})  # an llm serving every tenant
    stale = check(tmp_path, expected)
    assert not stale.holds()
