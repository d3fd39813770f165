"""The semantic index (row log + shared tables), the vector cache and the stage's search."""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest

from tiercache.exact.codec import CacheEntry
from tiercache.exact.keys import EngineIdentity, semantic_scope, tenant_scope
from tiercache.exact.request import GenerationRequest
from tiercache.exact.stores import MemoryStore
from tiercache.exact.tiered import TieredCache
from tiercache.machine import DiskReading, DiskRoom
from tiercache.semantic.graph_files import file_digest
from tiercache.semantic.index import SemanticIndex, estimated_graph_bytes
from tiercache.semantic.row_log import (
    INITIAL_CAPACITY,
    IndexRow,
    decode_row,
    encode_row,
    scope_tag,
)
from tiercache.semantic.scope_search import ScopeSearch
from tiercache.semantic.stage import EmbeddingCache, SemanticOutcome
from tiercache.semantic.store import SemanticStore
from tiercache.semantic.vectors import (
    ENTRY_OVERHEAD_BYTES,
    VectorCache,
    encode_vector,
    vector_key,
)
from tiercache.vocabulary import Tier

DIM = 8


def unit(*values: float) -> np.ndarray:
    v = np.zeros(DIM, dtype=np.float32)
    v[: len(values)] = values
    return v / np.linalg.norm(v)


def test_rows_written_by_one_index_are_seen_by_another_and_after_reopen(tmp_path: Path) -> None:
    writer = SemanticIndex(SemanticStore(tmp_path / "sem"), DIM)
    reader = SemanticIndex(SemanticStore(tmp_path / "sem2"), DIM)  # a different host: sees nothing
    writer.add("s", "d1", "p1", unit(1, 0))
    assert [n.digest for n in writer.search("s", unit(1, 0))] == ["d1"]
    assert reader.search("s", unit(1, 0)) == []
    writer.close()
    reopened = SemanticIndex(SemanticStore(tmp_path / "sem"), DIM)
    hits = reopened.search("s", unit(1, 0.1))
    assert [(n.digest, n.prompt) for n in hits] == [("d1", "p1")]
    assert hits[0].similarity == pytest.approx(float(unit(1, 0) @ unit(1, 0.1)))


def test_two_processes_views_of_one_store_stay_in_step(tmp_path: Path) -> None:
    """Two SemanticIndex objects on one LMDB path stand for two stage processes on one host."""
    store = SemanticStore(tmp_path / "sem")
    a, b = SemanticIndex(store, DIM), SemanticIndex(store, DIM)
    a.add("s", "d1", "p1", unit(1, 0))
    b.add("s", "d2", "p2", unit(0, 1))
    assert {n.digest for n in a.search("s", unit(1, 1), k=5)} == {"d1", "d2"}
    assert {n.digest for n in b.search("s", unit(1, 1), k=5)} == {"d1", "d2"}


def test_search_never_leaves_its_scope(tmp_path: Path) -> None:
    index = SemanticIndex(SemanticStore(tmp_path / "sem"), DIM)
    index.add("tenant-a", "da", "p", unit(1, 0))
    index.add("tenant-b", "db", "p", unit(1, 0))
    assert [n.digest for n in index.search("tenant-a", unit(1, 0), k=10)] == ["da"]
    assert index.search("tenant-c", unit(1, 0)) == []


def test_nearest_first_and_duplicate_digests_once(tmp_path: Path) -> None:
    index = SemanticIndex(SemanticStore(tmp_path / "sem"), DIM)
    index.add("s", "far", "p", unit(0, 1))
    index.add("s", "near", "p", unit(1, 0.1))
    index.add("s", "near", "p", unit(1, 0.1))
    assert [n.digest for n in index.search("s", unit(1, 0), k=5)] == ["near", "far"]
    assert index.size("s") == 2


def test_hnsw_above_the_flat_limit_finds_the_same_rows(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((300, DIM)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    store = SemanticStore(tmp_path / "sem")
    store.append_many([("s", f"d{i}", f"p{i}", v) for i, v in enumerate(vectors)])
    flat = SemanticIndex(store, DIM, flat_max_rows=10_000)
    graph = SemanticIndex(store, DIM, flat_max_rows=50)
    agree = sum(
        flat.search("s", v, k=1)[0].digest == graph.search("s", v, k=1)[0].digest
        for v in vectors[:100]
    )
    assert agree >= 95


def _damage_row(path: Path, seq: int) -> None:
    """Flip the last byte of the log's row `seq` (bit rot: its checksum no longer holds)."""
    env = lmdb.open(str(path))
    with env.begin(write=True) as txn:
        key = b"r" + seq.to_bytes(8, "big")
        blob = bytearray(txn.get(key))
        blob[-1] ^= 0xFF
        txn.put(key, bytes(blob))
    env.close()


def test_damaged_row_is_skipped(tmp_path: Path) -> None:
    store = SemanticStore(tmp_path / "sem")
    store.append("s", "good", "p", unit(1, 0))
    seq = store.append("s", "bad", "p", unit(1, 0.1))
    store.close()
    _damage_row(tmp_path / "sem", seq)
    index = SemanticIndex(SemanticStore(tmp_path / "sem"), DIM)
    assert [n.digest for n in index.search("s", unit(1, 0), k=5)] == ["good"]


def test_vector_cache_l1_l2_and_corruption(tmp_path: Path) -> None:
    cache = VectorCache(tmp_path / "vec", DIM)
    key = vector_key("emb@1", "hello")
    assert cache.get(key) is None
    cache.put(key, unit(1, 2))
    assert np.array_equal(cache.get(key), unit(1, 2))
    cache.close()
    reopened = VectorCache(tmp_path / "vec", DIM)
    assert np.array_equal(reopened.get(key), unit(1, 2))
    assert reopened.stats().l2_hits == 1
    reopened.close()
    env = lmdb.open(str(tmp_path / "vec"))
    with env.begin(write=True) as txn:
        txn.put(key, b"\x00" * 20)
    env.close()
    damaged = VectorCache(tmp_path / "vec", DIM)
    assert damaged.get(key) is None
    assert damaged.stats().corrupt == 1
    damaged.close()
    # a value whose checksum holds but that no embedder gives (norm 2, a NaN): it would
    # score past every true neighbour; refused as corrupt, dropped, and embedded again
    for planted in (np.full(DIM, 2.0 / np.sqrt(DIM), dtype=np.float32), unit(1) * np.nan):
        env = lmdb.open(str(tmp_path / "vec"))
        with env.begin(write=True) as txn:
            txn.put(key, encode_vector(planted))
        env.close()
        forged = VectorCache(tmp_path / "vec", DIM)
        assert forged.get(key) is None and forged.stats().corrupt == 1
        assert forged.get(key) is None and forged.stats().corrupt == 1  # dropped: a miss now
        forged.close()
    assert vector_key("emb@1", "hello") != vector_key("emb@2", "hello")


def test_vector_cache_short_of_disk_keeps_vectors_in_l1_only(tmp_path: Path) -> None:
    free = [60]  # short: under the headroom (100), over half of it
    disk = DiskRoom(
        tmp_path, 100, interval_s=0.0, read=lambda p: DiskReading(str(p), 1000, free[0])
    )
    cache = VectorCache(tmp_path / "vec", DIM, disk=disk)
    short, kept = vector_key("emb@1", "short"), vector_key("emb@1", "kept")
    cache.put(short, unit(1, 2))
    assert np.array_equal(cache.get(short), unit(1, 2)) and cache.stats().l2_skipped == 1
    free[0] = 100
    cache.put(kept, unit(2, 1))
    cache.close()
    reopened = VectorCache(tmp_path / "vec", DIM)
    assert reopened.get(short) is None and reopened.get(kept) is not None
    reopened.close()


def test_a_full_vector_l2_starts_over_keeps_the_new_vector_and_logs_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """L2's map full: it is emptied (vectors are recomputable) and the vector that met the full
    map is written after it, never lost from L2 nor failed; the warning comes once a minute
    however often it fills."""
    dims = 1024
    cache = VectorCache(tmp_path / "vec", dims, l1_max_bytes=0, l2_max_bytes=256 << 10)
    rng = np.random.default_rng(0)
    with caplog.at_level(logging.WARNING, logger="tiercache.semantic.vectors"):
        for i in range(400):
            key, vector = vector_key("emb@1", f"text {i}"), rng.random(dims, dtype=np.float32)
            vector /= np.linalg.norm(vector)  # as the embedder gives them (L2 refuses others)
            cache.put(key, vector)
            assert np.array_equal(cache.get(key), vector)  # from L2 (L1 holds nothing)
    assert cache.l2_clears >= 2 and cache.stats().l2_clears == cache.l2_clears
    assert [r.getMessage() for r in caplog.records] == [
        "vector cache L2 is full; cleared (clears so far: 1; "
        "raise vector_l2_max_bytes if this recurs)"
    ]
    cache.close()


def test_vector_cache_l1_is_an_lru_in_bytes_that_resizes_and_values_its_next_byte(
    tmp_path: Path,
) -> None:
    """L1 keeps the most recently used vectors within its budget; a resize evicts at once; a
    miss on a vector it evicted lately is credited with what serving it cost (an L2 read, or
    the embedding when L2 lost it too): what one more byte of L1 would have saved."""
    size = DIM * 4 + ENTRY_OVERHEAD_BYTES
    cache = VectorCache(tmp_path / "vec", DIM, l1_max_bytes=3 * size)
    keys = [vector_key("emb@1", f"text {i}") for i in range(4)]
    for i, key in enumerate(keys[:3]):
        cache.put(key, unit(1, i), cost_s=0.5)
    assert cache.l1_bytes == 3 * size
    assert cache.get(keys[0]) is not None  # keys[0] now most recent; keys[1] least
    cache.put(keys[3], unit(2, 0), cost_s=0.5)
    assert cache.l1_bytes == 3 * size and cache.stats().l1_entries == 3
    assert cache.shadow_reading() == (0.0, float(size))  # keys[1] evicted, in the shadow
    hits = cache.stats().l2_hits
    assert np.array_equal(cache.get(keys[1]), unit(1, 1))  # from L2: a shadow hit
    assert cache.stats().l2_hits == hits + 1
    gained, spanned = cache.shadow_reading()
    assert 0.0 < gained < 0.5  # an L2 read's time, not the embedding's
    assert cache.resize(size) == size
    assert cache.l1_bytes == size and cache.stats().l1_entries == 1
    assert cache.get(keys[1]) is not None  # the most recent survived the shrink
    # an evicted vector that L2 lost too is embedded again: credited with the embedding
    victim = keys[3]
    assert victim in cache._shadow  # evicted by the shrink
    cache.put(victim, unit(2, 0), cost_s=0.25)
    assert cache.shadow_reading()[0] == pytest.approx(gained + 0.25)
    with pytest.raises(ValueError):
        cache.resize(0)
    cache.close()


def test_semantic_scope_separates_tenant_model_adapter_sampling_and_embedder() -> None:
    engine = EngineIdentity("m", "r1")
    greedy = GenerationRequest("a question", max_tokens=16)
    base = semantic_scope(tenant_scope(b"k" * 32, "t1"), engine, greedy, "emb@1")
    reworded = GenerationRequest("the same question, reworded", max_tokens=16)
    assert semantic_scope(tenant_scope(b"k" * 32, "t1"), engine, reworded, "emb@1") == base
    others = [
        semantic_scope(tenant_scope(b"k" * 32, "t2"), engine, greedy, "emb@1"),
        semantic_scope(tenant_scope(b"k" * 32, "t1"), EngineIdentity("m", "r2"), greedy, "emb@1"),
        semantic_scope(tenant_scope(b"k" * 32, "t1"), engine, greedy, "emb@1", "adapter"),
        semantic_scope(
            tenant_scope(b"k" * 32, "t1"),
            engine,
            GenerationRequest("a question", max_tokens=16, temperature=0.7, seed=1),
            "emb@1",
        ),
        semantic_scope(
            tenant_scope(b"k" * 32, "t1"), engine, GenerationRequest("q", max_tokens=17), "emb@1"
        ),
        semantic_scope(tenant_scope(b"k" * 32, "t1"), engine, greedy, "emb@2"),
    ]
    assert base not in others and len(set(others)) == len(others)


class _Embed:
    def __init__(self, table: dict[str, np.ndarray]) -> None:
        self.table = table
        self.calls: list[list[str]] = []

    def __call__(self, texts: list[str]) -> np.ndarray:
        self.calls.append(list(texts))
        return np.stack([self.table[t] for t in texts])


def _stage(tmp_path: Path, embed: _Embed, accept_all: bool = True) -> EmbeddingCache:
    answers = TieredCache([(Tier.L1, MemoryStore(1 << 20))])
    return EmbeddingCache(
        VectorCache(tmp_path / "vec", DIM),
        SemanticIndex(SemanticStore(tmp_path / "sem"), DIM),
        answers,
        embed,
        (lambda q, cands: 0 if cands else None) if accept_all else (lambda q, cands: None),
        "emb@1",
        min_similarity=0.5,
    )


def test_stage_hits_a_stored_answer_and_embeds_each_text_once(tmp_path: Path) -> None:
    embed = _Embed({"q1": unit(1, 0), "q1 reworded": unit(1, 0.05)})
    stage = _stage(tmp_path, embed)
    stage.answers.store(Tier.L1).put("digest-1", CacheEntry("answer one", 0.0))  # type: ignore[union-attr]
    stage.index.add("scope", "digest-1", "q1", unit(1, 0))
    (hit,) = stage.lookup(["q1 reworded"], ["scope"])
    assert (hit.outcome, hit.text) == (SemanticOutcome.HIT, "answer one")
    assert hit.similarity == pytest.approx(float(unit(1, 0) @ unit(1, 0.05)))
    (again,) = stage.lookup(["q1 reworded"], ["other-scope"])
    assert again.outcome is SemanticOutcome.MISS and again.vector_cached
    assert embed.calls == [["q1 reworded"]]


def test_a_damaged_table_row_is_a_miss_not_another_answers_hit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One value of a scope's table row changed on disk (the table has no checksum, the row
    log has) would give that row any similarity and its answer to every query of the scope:
    a candidate whose row is no longer a unit vector is left out (logged), a miss."""
    embed = _Embed({"how do i reset my password": unit(0, 1)})
    stage = _stage(tmp_path, embed)
    stage.answers.store(Tier.L1).put("digest-1", CacheEntry("Paris", 0.0))  # type: ignore[union-attr]
    stage.index.add("scope", "digest-1", "what is the capital of france", unit(1, 0))
    (before,) = stage.lookup(["how do i reset my password"], ["scope"])
    assert before.outcome is SemanticOutcome.MISS
    (table,) = (tmp_path / "sem").rglob("*.tbl")
    at = table.read_bytes().find(unit(1, 0).tobytes())
    assert at > 0
    with table.open("r+b") as damaged:  # the mapped table sees it at once (MAP_SHARED)
        damaged.seek(at + 4)  # the row's second value: 0.0 -> 50.0
        damaged.write(np.float32(50.0).tobytes())
    (after,) = stage.lookup(["how do i reset my password"], ["scope"])
    assert after.outcome is SemanticOutcome.MISS and after.text == ""
    assert "table rows found damaged" in caplog.text


def test_a_table_row_that_is_not_its_ids_row_in_the_log_is_a_miss_not_its_answer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two rows' vectors swapped in a scope's table file (or an id changed: either pairs a
    sound unit vector with another row's id): the query's nearest row would name the other
    row, whose answer was served as a semantic hit. A candidate whose table vector is not its
    row's in the log (a fingerprint kept with the row's metadata) is left out: a miss."""
    embed = _Embed({"how do i reset my password": unit(0, 1)})
    stage = _stage(tmp_path, embed)
    answers = stage.answers.store(Tier.L1)
    answers.put("digest-a", CacheEntry("Open Settings, then Reset", 0.0))  # type: ignore[union-attr]
    answers.put("digest-b", CacheEntry("Paris", 0.0))  # type: ignore[union-attr]
    stage.index.add("scope", "digest-a", "how to reset a password", unit(0, 1))
    stage.index.add("scope", "digest-b", "what is the capital of france", unit(1, 0))
    (before,) = stage.lookup(["how do i reset my password"], ["scope"])
    assert (before.outcome, before.text) == (SemanticOutcome.HIT, "Open Settings, then Reset")
    (table,) = (tmp_path / "sem").rglob("*.tbl")
    data = table.read_bytes()
    a, b = data.find(unit(0, 1).tobytes()), data.find(unit(1, 0).tobytes())
    assert a > 0 and b > 0
    width = len(unit(0, 1).tobytes())
    with table.open("r+b") as damaged:  # the mapped table sees it at once (MAP_SHARED)
        damaged.seek(a)
        damaged.write(unit(1, 0).tobytes())
        damaged.seek(b)
        damaged.write(unit(0, 1).tobytes())
    assert table.read_bytes()[b : b + width] == unit(0, 1).tobytes()
    (after,) = stage.lookup(["how do i reset my password"], ["scope"])
    assert after.outcome is SemanticOutcome.MISS and after.text == ""
    assert "is not its row" in caplog.text


def test_a_vector_the_index_refuses_is_a_miss_and_not_kept(tmp_path: Path) -> None:
    """An embedder that misbehaves (a vector not of unit length would score past every true
    neighbour; one of another width fails the search): the prompt is a miss without a search,
    its vector is neither kept nor indexed, and it is counted."""
    embed = _Embed({"q": 3.0 * unit(1, 0), "wide": np.ones(DIM + 1, np.float32) / 3.0})
    stage = _stage(tmp_path, embed)
    stage.answers.store(Tier.L1).put("digest-1", CacheEntry("answer", 0.0))  # type: ignore[union-attr]
    stage.index.add("scope", "digest-1", "p", unit(1, 0))
    for _ in range(2):
        (refused,) = stage.lookup(["q"], ["scope"])
        assert refused.outcome is SemanticOutcome.MISS and len(refused.vector) == 0
    assert embed.calls == [["q"], ["q"]]  # not kept: embedded again
    (wide,) = stage.lookup(["wide"], ["scope"])
    assert wide.outcome is SemanticOutcome.MISS and len(wide.vector) == 0
    assert stage.bad_vectors == 3


def test_stage_keeps_vectors_per_tenant(tmp_path: Path) -> None:
    """A vector embedded for one tenant never answers another's lookup: its fast path would
    tell the second tenant that someone sent the same text before."""
    embed = _Embed({"a shared question": unit(1, 0)})
    stage = _stage(tmp_path, embed)
    first, second = "a" * 64, "b" * 64
    (one,) = stage.lookup(["a shared question"], ["scope-a"], [first])
    (other,) = stage.lookup(["a shared question"], ["scope-b"], [second])
    (again,) = stage.lookup(["a shared question"], ["scope-a"], [first])
    assert (one.vector_cached, other.vector_cached, again.vector_cached) == (False, False, True)
    assert embed.calls == [["a shared question"], ["a shared question"]]
    assert vector_key("emb@1", "x", first) != vector_key("emb@1", "x", second)


def test_stage_guard_rejection_and_stale_answers(tmp_path: Path) -> None:
    embed = _Embed({"q": unit(1, 0)})
    refusing = _stage(tmp_path / "a", embed, accept_all=False)
    refusing.index.add("scope", "d", "p", unit(1, 0))
    assert refusing.lookup(["q"], ["scope"])[0].outcome is SemanticOutcome.REJECTED
    stale = _stage(tmp_path / "b", embed)
    stale.index.add("scope", "gone", "p", unit(1, 0))  # its answer was never stored / evicted
    assert stale.lookup(["q"], ["scope"])[0].outcome is SemanticOutcome.STALE


def test_a_lookup_that_does_not_hit_names_its_nearest_neighbours_as_drafts(
    tmp_path: Path,
) -> None:
    """Refused, stale or under the similarity floor: the nearest rows at or above the draft
    floor are named (nearest first, at most draft_neighbours); a hit names none; 0 names none."""
    embed = _Embed({"q": unit(1, 0)})
    stage = _stage(tmp_path / "a", embed, accept_all=False)
    stage.draft_neighbours, stage.draft_min_similarity = 2, 0.3
    stage.index.add("scope", "near", "p1", unit(1, 0.1))
    stage.index.add("scope", "nearer", "p2", unit(1, 0.01))
    stage.index.add("scope", "farther", "p3", unit(1, 0.6))  # cosine ~0.86: third, left out
    stage.index.add("scope", "far", "p4", unit(0, 1))  # cosine 0: under the draft floor
    (refused,) = stage.lookup(["q"], ["scope"])
    assert refused.outcome is SemanticOutcome.REJECTED
    assert refused.drafts == ("nearer", "near")
    stale = _stage(tmp_path / "b", embed)
    stale.draft_neighbours, stale.draft_min_similarity = 4, 0.3
    stale.index.add("scope", "gone", "p", unit(1, 0))
    assert stale.lookup(["q"], ["scope"])[0].drafts == ("gone",)  # llm finds nothing: skipped
    below = _stage(tmp_path / "c", embed)  # min_similarity 0.5: no candidate, one draft
    below.draft_neighbours, below.draft_min_similarity = 2, 0.3
    below.index.add("scope", "loose", "p", unit(1, 2))  # cosine 0.45
    (miss,) = below.lookup(["q"], ["scope"])
    assert miss.outcome is SemanticOutcome.MISS and miss.drafts == ("loose",)
    hit = _stage(tmp_path / "d", embed)
    hit.draft_neighbours = 2
    hit.answers.store(Tier.L1).put("d", CacheEntry("a", 0.0))  # type: ignore[union-attr]
    hit.index.add("scope", "d", "p", unit(1, 0))
    (served,) = hit.lookup(["q"], ["scope"])
    assert served.outcome is SemanticOutcome.HIT and served.drafts == ()
    off = _stage(tmp_path / "e", embed, accept_all=False)  # draft_neighbours 0 by default
    off.index.add("scope", "d", "p", unit(1, 0))
    assert off.lookup(["q"], ["scope"])[0].drafts == ()


def test_stage_ignores_candidates_under_the_similarity_floor(tmp_path: Path) -> None:
    embed = _Embed({"q": unit(1, 0)})
    stage = _stage(tmp_path, embed)
    stage.answers.store(Tier.L1).put("d", CacheEntry("a", 0.0))  # type: ignore[union-attr]
    stage.index.add("scope", "d", "p", unit(0, 1))  # cosine 0
    assert stage.lookup(["q"], ["scope"])[0].outcome is SemanticOutcome.MISS


def test_prompts_over_the_embedders_window_are_neither_embedded_nor_looked_up(
    tmp_path: Path,
) -> None:
    embed = _Embed({"short": unit(1, 0)})
    stage = _stage(tmp_path, embed)
    reasons = {"a very long prompt": "too_long", "한국어": "unsupported"}
    stage._screen = reasons.get  # type: ignore[method-assign]
    stage.answers.store(Tier.L1).put("d", CacheEntry("a", 0.0))  # type: ignore[union-attr]
    stage.index.add("scope", "d", "p", unit(1, 0))
    long_result, korean, short_result = stage.lookup(
        ["a very long prompt", "한국어", "short"], ["scope"] * 3
    )
    assert long_result.outcome is SemanticOutcome.TOO_LONG and long_result.vector.size == 0
    assert korean.outcome is SemanticOutcome.UNSUPPORTED and korean.vector.size == 0
    assert short_result.outcome is SemanticOutcome.HIT
    assert embed.calls == [["short"]]


@pytest.fixture(scope="module")
def screen() -> Any:
    from tiercache.semantic.embedder import Screen

    return Screen()


def test_screen_counts_the_embedders_tokens(screen: Any) -> None:
    assert screen.max_tokens == 256
    assert screen.check("What is the capital of France?") is None
    shared = "Follow the policy below carefully. " * 60  # about 360 tokens
    assert screen.check(shared + "How do I cancel my hotel booking?") == "too_long"


def test_screen_counts_tokens_of_non_ascii_text(screen: Any) -> None:
    """Past the ASCII shortcut the tokenizer counts: 300 characters of accented Latin text
    are 300 tokens (over the window); before, a 227-character Korean prompt of 357 tokens
    passed as short, and two of them sharing a preamble got one vector (cosine 1.0)."""
    accented = "é," * 150
    assert screen.check(accented) == "too_long"
    assert screen.check("é," * 100) is None


@pytest.mark.parametrize(
    "text",
    [
        "How do I reset my password " + "x" * 120,  # a word over 100 characters is one [UNK]
        # a control character the tokenizer deletes joins two words of 60 into one of 120
        "what is " + "a" * 60 + "\x1f" + "a" * 60 + "b?",
        "What does 😀 mean in a text message?",  # emoji: [UNK]
        "如何重置我的密码？",  # CJK: [UNK] each
        "비밀번호를 재설정하려면 어떻게 해야 하나요?",  # Hangul: tokens, but not Latin
        "Как сбросить мой пароль?",  # Cyrillic
    ],
)
def test_screen_refuses_what_the_embedder_cannot_tell_apart(screen: Any, text: str) -> None:
    assert screen.check(text) == "unsupported"


@pytest.mark.parametrize(
    "text",
    [
        "Où est la gare ? Je cherche un café près d'ici.",
        "Schöne Grüße aus Köln",
        "Tôi muốn đặt phòng khách sạn",  # Vietnamese: Latin Extended Additional
    ],
)
def test_screen_takes_latin_text_with_accents(screen: Any, text: str) -> None:
    assert screen.check(text) is None


def test_full_row_log_compacts_rows_whose_answers_are_gone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = SemanticStore(tmp_path / "sem", max_bytes=256 * 1024)
    live = {"d0"}  # and the 20 newest answers: the older ones were evicted
    for i in range(2000):  # far more rows than 256 KiB holds
        live.add(f"d{i}")
        if i > 20:
            live.discard(f"d{i - 20}")
        store.append_or_compact("s", f"d{i}", "p" * 40, unit(1, i / 400), live.__contains__)
        assert store.wait_compacted()  # answers come slower than a compaction of this log
    kept = {r.digest for r in store.rows_since(0)}
    assert 20 <= len(kept) < 2000
    assert {"d0", "d1999"} <= kept  # a live old answer's row stays; the newest made it in
    assert "failed" not in caplog.text and "not indexed" not in caplog.text
    store.close()


def test_a_full_log_does_not_hold_up_the_writer(tmp_path: Path) -> None:
    """A miss's write-back ran a whole-log compaction before its answer was delivered (seconds
    for a 2 GiB log); now it returns at once and the row lands after the compaction."""
    store = SemanticStore(tmp_path / "sem", max_bytes=256 * 1024)
    gate = threading.Event()

    def slow_exists(digest: str) -> bool:
        gate.wait(10)  # compaction checks every row's answer: held here
        return False

    i = 0
    while store.append_or_compact("s", f"d{i}", "p" * 40, unit(1, i), slow_exists) is not None:
        i += 1  # until the log is full
    started = time.perf_counter()
    assert store.append_or_compact("s", "late", "p", unit(0, 1), slow_exists) is None
    assert time.perf_counter() - started < 1.0  # did not wait for the compaction
    gate.set()
    assert store.wait_compacted()
    assert {r.digest for r in store.rows_since(0)} >= {f"d{i}", "late"}
    store.close()


def test_compaction_keeps_rows_with_live_answers(tmp_path: Path) -> None:
    store = SemanticStore(tmp_path / "sem")
    for i in range(10):
        store.append("s", f"d{i}", "p", unit(1, i))
    deleted = store.compact(lambda digest: digest in {"d2", "d7"})
    assert deleted == 8
    assert [r.digest for r in store.rows_since(0)] == ["d2", "d7"]


def test_a_row_claimed_back_after_compaction_scanned_is_spared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An answer whose row compaction's scan found gone, generated and stored again before
    the delete: its append hands the existing row back (one row per digest), and the delete
    then removed it, leaving a live answer with no row on this host for its lifetime. The
    row is spared now, and the next compaction deletes it only if its answer is gone again."""
    store = SemanticStore(tmp_path / "sem")
    for i in range(4):
        store.append("s", f"d{i}", "p", unit(1, i))
    delete = store.delete_compacted
    came_back: list[int] = []

    def delete_after_a_comeback(rows: Any, spare_claimed_after: int | None = None) -> Any:
        if not came_back:  # d1's answer is stored again between the scan and the delete
            came_back.append(store.append("s", "d1", "p", unit(1, 1)))
        return delete(rows, spare_claimed_after)

    monkeypatch.setattr(store, "delete_compacted", delete_after_a_comeback)
    assert store.compact(lambda digest: digest == "d3") == 2  # d0 and d2; d1 came back
    monkeypatch.undo()
    assert came_back == [1]  # the existing row, handed back
    assert [r.digest for r in store.rows_since(0)] == ["d1", "d3"]
    index = SemanticIndex(store, DIM)
    assert index.search("s", unit(1, 1), k=1)[0].digest == "d1"
    assert store.compact(lambda digest: digest == "d3") == 1  # gone again: deleted this time
    assert [r.digest for r in store.rows_since(0)] == ["d3"]
    store.close()


def test_when_every_answer_lives_compaction_gives_up_the_rows_worth_least(tmp_path: Path) -> None:
    """The exact cache's value of each row's answer (its L2 value: TieredCache.answer_value)
    ranks what goes; equal values, and no ranking at all, go oldest first."""
    store = SemanticStore(tmp_path / "sem")
    for i in range(10):
        store.append("s", f"d{i}", "p", unit(1, i))
    worth = {"d0": 9.0, "d1": 8.0, "d4": 0.5, "d6": 0.5, "d9": 0.1}  # the others: 1.0

    def value(digest: str) -> float:
        return worth.get(digest, 1.0)

    assert store.compact(lambda digest: True, 0.3, value) == 3
    assert [r.digest for r in store.rows_since(0)] == ["d0", "d1", "d2", "d3", "d5", "d7", "d8"]
    assert store.compact(lambda digest: True, 0.3) == 2  # no ranking: the oldest
    assert [r.digest for r in store.rows_since(0)] == ["d2", "d3", "d5", "d7", "d8"]
    store.close()


def test_one_compaction_at_a_time_on_the_host(tmp_path: Path) -> None:
    """The llm stage's compaction thread and the Redis row follower compact the same log; two
    at once each gave up a tenth. The second waits for the first (the host's flock, across
    processes as across threads) and, the log under its mark after it, deletes nothing."""
    store = SemanticStore(tmp_path / "sem")
    for i in range(20):
        store.append("s", f"d{i}", "p", unit(1, i))
    inside, release = threading.Event(), threading.Event()

    def slow_exists(digest: str) -> bool:
        inside.set()
        release.wait(10)
        return True

    first: list[int] = []
    worker = threading.Thread(target=lambda: first.append(store.compact(slow_exists, 0.1)))
    worker.start()
    assert inside.wait(10)
    second: list[int] = []
    waiter = threading.Thread(target=lambda: second.append(store.compact(lambda d: True, 0.1)))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive()  # waiting for the first compaction
    release.set()
    worker.join(10)
    waiter.join(10)
    assert (first, second) == ([2], [0])
    assert len(list(store.rows_since(0))) == 18
    assert store.compact(lambda d: True, 0.1) == 1  # alone, an explicit compaction runs
    store.close()


# ---- saved HNSW graphs ----------------------------------------------------------------------
# LMDB opens an environment once per process, so the "processes" below share one SemanticStore;
# each SemanticIndex has its own graph, as each stage process does.


def _random_rows(count: int, seed: int) -> np.ndarray:
    vectors = np.random.default_rng(seed).standard_normal((count, DIM)).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def _fill(store: SemanticStore, vectors: np.ndarray, first: int = 0) -> None:
    store.append_many([("s", f"d{first + i}", f"p{first + i}", v) for i, v in enumerate(vectors)])


def _start(store: SemanticStore) -> SemanticIndex:
    """A process starting on the host's row log: HNSW above 50 rows."""
    index = SemanticIndex(store, DIM, flat_max_rows=50)
    index.refresh()
    return index


def _graph_files(store: SemanticStore) -> list[Path]:
    return sorted((store.path / "graphs").glob("*.hnsw"))


def _agree_with_flat(index: SemanticIndex, queries: np.ndarray) -> int:
    flat = SemanticIndex(index.store, DIM, persist_graphs=False)
    return sum(
        index.search("s", q, k=1)[0].digest == flat.search("s", q, k=1)[0].digest for q in queries
    )


def test_a_saved_graph_is_loaded_at_start_and_rows_appended_after_it_are_found(
    tmp_path: Path,
) -> None:
    store = SemanticStore(tmp_path / "sem")
    _fill(store, _random_rows(300, 0))
    first = _start(store)
    assert (first.stats().graphs_built, first.stats().graphs_saved) == (1, 1)
    (saved,) = _graph_files(store)
    assert saved.name.split(".")[1] == "300"

    later = _random_rows(10, 1)  # appended after the save: under the re-save share
    _fill(store, later, first=300)
    second = _start(store)
    stats = second.stats()
    assert (stats.graphs_built, stats.graphs_loaded, stats.graphs_saved) == (0, 1, 0)
    assert stats.rows == 310
    for i, v in enumerate(later):
        (hit,) = second.search("s", v, k=1)
        assert hit.digest == f"d{300 + i}"
        assert hit.similarity == pytest.approx(1.0, abs=1e-5)
    assert _agree_with_flat(second, _random_rows(100, 2)) >= 95

    second.save_graphs()  # what close does: the graph grew since its file, the older file goes
    (resaved,) = _graph_files(store)
    assert resaved.name.split(".")[1] == "310"
    third = _start(store)
    assert (third.stats().graphs_built, third.stats().graphs_loaded) == (0, 1)
    third.close()
    assert _graph_files(store) == [resaved]  # nothing new to save at close


def test_a_load_that_adds_many_rows_on_top_saves_the_larger_graph(tmp_path: Path) -> None:
    store = SemanticStore(tmp_path / "sem")
    _fill(store, _random_rows(300, 0))
    _start(store)  # builds and saves 300 rows, then never closes (a crash)
    _fill(store, _random_rows(100, 1), first=300)
    index = _start(store)
    assert (index.stats().graphs_loaded, index.stats().graphs_saved) == (1, 1)
    assert [f.name.split(".")[1] for f in _graph_files(store)] == ["400"]


@pytest.mark.parametrize("damage", ["truncated", "flipped byte", "empty"])
def test_a_damaged_graph_file_is_rebuilt_and_results_stay_right(
    tmp_path: Path, damage: str
) -> None:
    store = SemanticStore(tmp_path / "sem")
    _fill(store, _random_rows(300, 0))
    _start(store)
    (saved,) = _graph_files(store)
    data = bytearray(saved.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "flipped byte":
        data[len(data) // 2] ^= 0x01
    else:
        data = bytearray()
    saved.write_bytes(bytes(data))

    index = _start(store)
    stats = index.stats()
    assert (stats.graphs_loaded, stats.graphs_built, stats.graph_files_rejected) == (0, 1, 1)
    assert _agree_with_flat(index, _random_rows(100, 2)) >= 95
    (rebuilt,) = _graph_files(store)  # the damaged file is gone, a good one took its place
    assert rebuilt.read_bytes() != bytes(data)
    assert _start(store).stats().graphs_loaded == 1


def test_a_graph_of_other_rows_is_never_used(tmp_path: Path) -> None:
    other = SemanticStore(tmp_path / "other")
    _fill(other, _random_rows(300, 7))
    _start(other)
    (foreign,) = _graph_files(other)
    # Same scope, same row count, other rows: the prefix digest in its name does not match.
    store = SemanticStore(tmp_path / "sem")
    _fill(store, _random_rows(300, 0))
    (store.path / "graphs").mkdir()
    (store.path / "graphs" / foreign.name).write_bytes(foreign.read_bytes())
    index = _start(store)
    stats = index.stats()
    assert (stats.graphs_loaded, stats.graphs_built, stats.graph_files_rejected) == (0, 1, 1)
    assert _agree_with_flat(index, _random_rows(100, 2)) >= 95

    # The foreign graph renamed to claim this log's rows still fails the vector spot check.
    (own,) = _graph_files(store)
    tag, rows, prefix, _, ext = own.name.split(".")
    own.unlink()
    tmp = store.path / "graphs" / "forged"
    tmp.write_bytes(foreign.read_bytes())
    tmp.rename(tmp.with_name(f"{tag}.{rows}.{prefix}.{file_digest(tmp)}.{ext}"))
    forged = _start(store)
    assert (forged.stats().graphs_loaded, forged.stats().graph_files_rejected) == (0, 1)
    assert _agree_with_flat(forged, _random_rows(100, 2)) >= 95


def test_a_graph_whose_labels_are_not_the_tables_rows_is_refused(tmp_path: Path) -> None:
    """A graph written by someone who can write the state folder, with this log's prefix and a
    matching digest but labels past the table: its spot check raised hnswlib's RuntimeError
    (not a GraphFileError: never deleted, retried each minute), and a label past the rows
    failed every search of the scope."""
    import hnswlib

    from tiercache.semantic.graph_files import HNSW_EF_CONSTRUCTION, HNSW_M

    store = SemanticStore(tmp_path / "sem")
    vectors = _random_rows(300, 0)
    _fill(store, vectors)
    _start(store)
    (own,) = _graph_files(store)
    tag, rows, prefix, _, ext = own.name.split(".")
    own.unlink()
    forged = hnswlib.Index(space="ip", dim=DIM)
    forged.init_index(max_elements=300, M=HNSW_M, ef_construction=HNSW_EF_CONSTRUCTION)
    forged.add_items(vectors, np.arange(1000, 1300))  # the right vectors, labels past the rows
    tmp = store.path / "graphs" / "forged"
    forged.save_index(str(tmp))
    tmp.rename(tmp.with_name(f"{tag}.{rows}.{prefix}.{file_digest(tmp)}.{ext}"))
    index = _start(store)
    stats = index.stats()
    assert (stats.graphs_loaded, stats.graph_files_rejected) == (0, 1)
    assert _agree_with_flat(index, _random_rows(100, 2)) >= 95
    assert index.search("s", vectors[7], k=1)[0].digest == "d7"


def test_a_graph_saved_before_compaction_is_not_used_after_it(tmp_path: Path) -> None:
    store = SemanticStore(tmp_path / "sem")
    rows = _random_rows(300, 0)
    _fill(store, rows)
    _start(store)
    store.compact(lambda digest: digest != "d5")  # one early row's answer is gone
    _fill(store, _random_rows(5, 3), first=1000)
    index = _start(store)  # 304 rows; the file's first 300 are not this log's first 300
    assert (index.stats().graphs_loaded, index.stats().graphs_built) == (0, 1)
    assert all(n.digest != "d5" for n in index.search("s", rows[5], k=5))


def test_a_compaction_that_shrinks_a_scope_deletes_its_larger_graphs(tmp_path: Path) -> None:
    """A graph covering more rows than the compacted scope holds can never match again (a row
    inside it is gone): it stayed on disk until the scope grew past it."""
    store = SemanticStore(tmp_path / "sem")
    _fill(store, _random_rows(300, 0))
    _start(store)
    assert [f.name.split(".")[1] for f in _graph_files(store)] == ["300"]
    store.compact(lambda digest: digest not in {"d5", "d6"})
    assert _graph_files(store) == []


def test_saving_a_graph_of_the_same_rows_again_writes_nothing(tmp_path: Path) -> None:
    store = SemanticStore(tmp_path / "sem")
    _fill(store, _random_rows(300, 0))
    index = _start(store)
    assert index.graphs is not None
    (saved,) = _graph_files(store)
    _, rows, prefix, _, _ = saved.name.split(".")
    assert index.graphs.save("s", int(rows), prefix, index._scopes["s"].hnsw) is None
    assert _graph_files(store) == [saved]
    assert not list((store.path / "graphs").glob(".*.tmp"))


def test_scopes_under_the_flat_limit_write_no_graph(tmp_path: Path) -> None:
    store = SemanticStore(tmp_path / "sem")
    _fill(store, _random_rows(40, 0))
    index = _start(store)
    index.close()
    assert _graph_files(store) == [] and index.stats().graphs_built == 0


# ---- the shared tables (tiercache_native.SharedTable per scope) -----------------------------
# Processes below are real (spawn, as Triton starts model instances): LMDB and the tables are
# opened once per process, as in the stages.


def _table_of(index: SemanticIndex, scope: str = "s") -> Any:
    return index._scopes[scope].table


def _write_through_llm_path(path: str, first: int, count: int) -> None:
    """The llm stage's process: `append_or_compact` on its own store after each answer."""
    store = SemanticStore(Path(path))
    _append_like_llm(store, first, count)
    store.close()


def _append_like_llm(store: SemanticStore, first: int, count: int) -> None:
    for i in range(first, first + count):
        store.append_or_compact("s", f"d{i}", f"p{i}", _random_rows(1, i)[0], lambda d: True)


def _read_in_a_process(path: str, first: int, count: int, found: Any) -> None:
    index = SemanticIndex(SemanticStore(Path(path)), DIM)
    found.put(
        [
            index.search("s", _random_rows(1, i)[0], k=1)[0].digest
            for i in range(first, first + count)
        ]
    )
    index.close()


def _log_then_die(path: str, seq_out: Any) -> None:
    """A writer that dies after its log append, before publishing to the table."""
    store = SemanticStore(Path(path))
    seqs, _ = store.log_rows([("s", "orphan", "p", unit(0, 0, 1))])
    seq_out.put(seqs[0])
    os._exit(1)


def test_a_writer_process_and_a_reader_process_see_each_others_rows(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    path = str(tmp_path / "sem")
    reader = SemanticIndex(SemanticStore(Path(path)), DIM)
    assert reader.search("s", unit(1, 0)) == []
    writer = ctx.Process(target=_write_through_llm_path, args=(path, 0, 20))
    writer.start()
    writer.join(60)
    assert writer.exitcode == 0
    for i in range(20):
        (hit,) = reader.search("s", _random_rows(1, i)[0], k=1)
        assert hit.digest == f"d{i}" and hit.similarity == pytest.approx(1.0, abs=1e-5)
    # The other way round: this process writes, a reader process finds the rows.
    _append_like_llm(reader.store, 20, 5)
    found = ctx.Queue()
    other = ctx.Process(target=_read_in_a_process, args=(path, 18, 7, found))
    other.start()
    assert found.get(timeout=60) == [f"d{i}" for i in range(18, 25)]
    other.join(60)
    table = _table_of(reader)
    assert table.count() == 25 and sorted(np.asarray(table.ids()).tolist()) == list(range(25))
    reader.close()


def test_a_row_logged_by_a_writer_that_died_before_publishing_is_recovered(
    tmp_path: Path,
) -> None:
    ctx = multiprocessing.get_context("spawn")
    path = tmp_path / "sem"
    store = SemanticStore(path)
    store.append("s", "d0", "p0", unit(1, 0))
    reader = SemanticIndex(store, DIM)
    assert [n.digest for n in reader.search("s", unit(1, 0), k=5)] == ["d0"]
    seq_out = ctx.SimpleQueue()  # put writes to the pipe at once, before the exit
    dying = ctx.Process(target=_log_then_die, args=(str(path), seq_out))
    dying.start()
    dying.join(60)
    orphan = seq_out.get()
    assert dying.exitcode == 1
    # Logged, not published: no reader serves it, and nothing half-written is in the table.
    assert [n.digest for n in reader.search("s", unit(0, 0, 1), k=5)] == ["d0"]
    assert _table_of(reader).count() == 1
    # A process that opens the table now finds it behind the log and publishes the row.
    fresh = SemanticIndex(store, DIM)
    assert fresh.search("s", unit(0, 0, 1), k=1)[0].digest == "orphan"
    # The next write publishes its own row once, the recovered row is not duplicated.
    store.append("s", "d2", "p2", unit(0, 1))
    table = _table_of(reader)
    ids = np.asarray(table.ids()).tolist()
    assert sorted(ids) == sorted([0, orphan, orphan + 1]) and len(set(ids)) == len(ids)
    rows = np.asarray(table.snapshot())
    assert np.array_equal(rows[ids.index(orphan)], unit(0, 0, 1))
    assert {n.digest for n in reader.search("s", unit(0, 0, 1), k=5)} == {"d0", "orphan", "d2"}


def test_the_next_publish_recovers_a_row_a_dead_writer_left_unpublished(tmp_path: Path) -> None:
    store = SemanticStore(tmp_path / "sem")
    reader = SemanticIndex(store, DIM)
    store.append("s", "d0", "p0", unit(1, 0))
    reader.search("s", unit(1, 0))
    store.log_rows([("s", "orphan", "p", unit(0, 0, 1))])  # the writer's first step only
    assert _table_of(reader).count() == 1
    store.append("s", "d2", "p2", unit(0, 1))
    assert _table_of(reader).count() == 3
    assert reader.search("s", unit(0, 0, 1), k=1)[0].digest == "orphan"


@pytest.mark.parametrize("loss", ["files deleted", "emptied by a reboot"])
def test_tables_lost_or_emptied_are_rebuilt_from_the_log(tmp_path: Path, loss: str) -> None:
    store = SemanticStore(tmp_path / "sem")
    _fill(store, _random_rows(40, 0))
    store.close()
    tables = sorted((tmp_path / "sem" / "tables").glob("*.tbl"))
    assert len(tables) == 1
    if loss == "files deleted":  # e.g. /dev/shm after a reboot
        shutil.rmtree(tmp_path / "sem" / "tables")
    else:  # the native table resets itself when its header names another boot
        data = bytearray(tables[0].read_bytes())
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip().encode()
        at = data.find(boot)
        assert at > 0
        data[at : at + len(boot)] = b"0" * len(boot)
        tables[0].write_bytes(bytes(data))
    index = SemanticIndex(SemanticStore(tmp_path / "sem"), DIM)
    assert index.refresh() == 40
    assert _table_of(index).count() == 40
    for i, v in enumerate(_random_rows(40, 0)[:10]):
        assert index.search("s", v, k=1)[0].digest == f"d{i}"


def test_compaction_retires_the_table_and_readers_reopen(tmp_path: Path) -> None:
    store = SemanticStore(tmp_path / "sem")
    for i in range(10):
        store.append("s", f"d{i}", "p", unit(1, i))
    reader = SemanticIndex(store, DIM)
    assert reader.size("s") == 10
    old = _table_of(reader)
    assert store.compact(lambda digest: digest in {"d2", "d7"}) == 8
    assert old.retired()
    hits = reader.search("s", unit(1, 2), k=10)
    assert [n.digest for n in hits] == ["d2", "d7"]
    assert reader.stats().tables_reopened == 1 and _table_of(reader).count() == 2
    assert len(list((tmp_path / "sem" / "tables").glob("*.tbl"))) == 1  # the old file is gone


def test_a_scope_left_without_rows_loses_its_table_and_graphs(tmp_path: Path) -> None:
    """Scopes include the seed, max_tokens, adapter and model revision: many are never used
    again. Before, each kept an allocated table (1.5 MB at least) and its graphs forever."""
    store = SemanticStore(tmp_path / "sem")
    _fill(store, _random_rows(300, 0))  # scope "s": a graph is saved at start
    for i in range(5):
        store.append(f"seed-{i}", f"x{i}", "p", unit(1, i))
    reader = _start(store)
    reader.size("seed-0")
    assert _graph_files(store) and len(list((store.path / "tables").glob("*.tbl"))) == 6
    assert store.compact(lambda digest: digest == "x0") == 304
    assert list((store.path / "tables").glob("*.tbl")) == [
        store.tables.table_path(scope_tag("seed-0"), 0)
    ]
    assert _graph_files(store) == [] and reader.search("s", unit(1, 0), k=1) == []
    assert reader.size("seed-1") == 0 and reader.size("seed-0") == 1
    store.append("s", "again", "p", unit(1, 0))  # a new row starts the scope over
    assert [n.digest for n in reader.search("s", unit(1, 0), k=1)] == ["again"]


def test_a_full_table_grows_into_a_new_one_and_a_graph_keeps_its_rows(tmp_path: Path) -> None:
    store = SemanticStore(tmp_path / "sem")
    _fill(store, _random_rows(300, 0))
    reader = _start(store)  # a graph of 300 rows
    assert reader.stats().graphs_built == 1
    old = _table_of(reader)
    old_capacity = old.capacity()
    vectors = np.concatenate([_random_rows(300, 0), _random_rows(old_capacity, 3)])
    for first in range(300, len(vectors), 100):  # past the table's capacity
        _fill(store, vectors[first : first + 100], first=first)
    assert old.retired()
    (hit,) = reader.search("s", vectors[-1], k=1)
    assert hit.digest == f"d{len(vectors) - 1}"
    stats = reader.stats()
    assert (stats.tables_reopened, stats.graphs_built, stats.rows) == (1, 1, len(vectors))
    assert _table_of(reader).capacity() > old_capacity >= INITIAL_CAPACITY
    assert _agree_with_flat(reader, _random_rows(100, 2)) >= 95


def test_a_row_whose_checksum_holds_over_fields_of_other_types_is_damaged(
    tmp_path: Path,
) -> None:
    """A row no encode_row of this release wrote (a digest that is a number, a created_s that
    is NaN), its checksum made over it, is skipped as damaged: taken as a row it stopped
    compaction (AttributeError in every retry) and failed every lookup that chose it."""
    good = IndexRow(0, "s", "d", "p", unit(1, 0), 5.0)
    assert decode_row(0, encode_row(good)) is not None
    for planted in (
        IndexRow(0, "s", 123, "p", unit(1, 0), 5.0),  # type: ignore[arg-type]
        IndexRow(0, ["s"], "d", "p", unit(1, 0), 5.0),  # type: ignore[arg-type]
        IndexRow(0, "s", "d", None, unit(1, 0), 5.0),  # type: ignore[arg-type]
        IndexRow(0, "s", "d", "p", unit(1, 0), float("nan")),
    ):
        assert decode_row(0, encode_row(planted)) is None
    store = SemanticStore(tmp_path / "sem")
    store.append("s", "good", "p", unit(1, 0))
    seq = store.append("s", "bad", "p", unit(1, 0.1))
    store.close()
    env = lmdb.open(str(tmp_path / "sem"))
    with env.begin(write=True) as txn:  # the row's digest a number, its checksum made again
        planted = IndexRow(seq, "s", 123, "p", unit(1, 0.1), 5.0)  # type: ignore[arg-type]
        txn.put(b"r" + seq.to_bytes(8, "big"), encode_row(planted))
    env.close()
    reopened = SemanticStore(tmp_path / "sem")
    index = SemanticIndex(reopened, DIM)
    assert [n.digest for n in index.search("s", unit(1, 0), k=5)] == ["good"]
    reopened.close()


def test_a_damaged_row_missing_from_the_table_is_dropped_from_the_log(tmp_path: Path) -> None:
    store = SemanticStore(tmp_path / "sem")
    store.append("s", "good", "p", unit(1, 0))
    seqs, _ = store.log_rows([("s", "bad", "p", unit(1, 0.1))])  # logged, never published
    store.close()
    _damage_row(tmp_path / "sem", seqs[0])
    reopened = SemanticStore(tmp_path / "sem")
    index = SemanticIndex(reopened, DIM)
    assert [n.digest for n in index.search("s", unit(1, 0), k=5)] == ["good"]
    tag = scope_tag("s")
    assert reopened.live_count(tag) == 1 and reopened.scope_seqs(tag) == [0]


def test_a_damaged_row_compaction_deletes_leaves_its_scope(tmp_path: Path) -> None:
    """A published row that bit rot damaged: compaction deletes it, and now its scope's entry
    and live count with it (a damaged row names no scope, and a sync reads only the rows its
    table lacks, so the entry stayed, counted live, for good)."""
    store = SemanticStore(tmp_path / "sem")
    store.append("s", "good", "p", unit(1, 0))
    bad = store.append("s", "bad", "p", unit(1, 0.1))
    store.append("other", "elsewhere", "p", unit(0, 1))
    store.close()
    _damage_row(tmp_path / "sem", bad)
    reopened = SemanticStore(tmp_path / "sem")
    tag = scope_tag("s")
    assert reopened.live_count(tag) == 2
    assert reopened.compact(lambda digest: True) == 1  # the damaged row alone
    assert reopened.live_count(tag) == 1 and reopened.scope_seqs(tag) == [0]
    assert reopened.live_count(scope_tag("other")) == 1
    index = SemanticIndex(reopened, DIM)
    assert [n.digest for n in index.search("s", unit(1, 0), k=5)] == ["good"]
    reopened.close()


def test_a_long_tail_joins_the_graph_a_bounded_step_a_search(tmp_path: Path) -> None:
    """Rows past a scope's graph (thousands, caught up from Redis after an outage) were all
    added inside one search, under the index's lock: seconds of every lookup. Each search adds
    at most _GRAPH_ADD_ROWS now; the rest is scanned flat, so every row is found meanwhile."""
    from tiercache.semantic import index as index_module

    store = SemanticStore(tmp_path / "sem")
    vectors = _random_rows(1_800, 3)
    _fill(store, vectors[:100])
    index = _start(store)
    scope = index._scopes["s"]
    assert scope.hnsw is not None and scope.graph_rows == 100
    _fill(store, vectors[100:], first=100)
    step, tail = index_module._GRAPH_ADD_ROWS, index_module._GRAPH_TAIL_ROWS
    expected = 100
    for _ in range(4):
        assert index.search("s", vectors[1_799], k=1)[0].digest == "d1799"  # the tail, flat
        if 1_800 - expected >= tail:  # a tail this short waits for more rows
            expected += min(step, 1_800 - expected)
        assert scope.graph_rows == expected
    assert expected == 100 + 3 * step  # three steps taken, the last 164 rows scanned flat
    assert index.search("s", vectors[50], k=1)[0].digest == "d50"
    store.close()


def test_a_graph_needed_while_serving_is_built_off_the_search_path(tmp_path: Path) -> None:
    """A scope that crosses flat_max_rows (or whose rows compaction rewrote) got its graph built
    inside search(), holding the index lock: every lookup of the process waited (1.6 s per
    20,000 rows). Now searches scan flat until a background build is swapped in."""
    store = SemanticStore(tmp_path / "sem")
    reader = SemanticIndex(store, DIM, flat_max_rows=50, persist_graphs=False)
    vectors = _random_rows(300, 0)
    _fill(store, vectors[:40])
    assert reader.search("s", vectors[0], k=1)[0].digest == "d0"  # flat, under the limit
    _fill(store, vectors[40:], first=40)
    gate = threading.Event()
    build = ScopeSearch.build_hnsw

    def slow_build(scope: Any, rows: np.ndarray) -> None:
        assert gate.wait(10)
        build(scope, rows)

    ScopeSearch.build_hnsw = slow_build  # type: ignore[method-assign]
    try:
        found: list[Any] = []
        searching = threading.Thread(target=lambda: found.extend(reader.search("s", vectors[299])))
        searching.start()
        searching.join(5)  # over the limit: answered by the flat scan, the build still held
        assert not searching.is_alive() and found[0].digest == "d299"
        assert reader.stats().graphs_built == 0
    finally:
        gate.set()
        ScopeSearch.build_hnsw = build  # type: ignore[method-assign]
    assert reader.wait_graphs()
    assert reader.stats().graphs_built == 1
    assert _agree_with_flat(reader, _random_rows(50, 5)) >= 48
    assert store.compact(lambda digest: digest != "d1") == 1  # rows rewritten: graph dropped
    assert reader.search("s", vectors[0], k=1)[0].digest == "d0"
    assert reader.wait_graphs() and reader.stats().graphs_built == 2
    reader.close()


def test_a_log_restored_from_a_backup_never_pairs_a_row_with_another_rows_vector(
    tmp_path: Path,
) -> None:
    """Tables were keyed by scope and epoch only: a log restored from a backup gives out seqs
    the table already holds for other rows, and a search for the old row's vector served the
    new row (similarity 1.0, past the guard)."""
    tables = tmp_path / "tables"  # outside the log's folder, as tables_path allows
    store = SemanticStore(tmp_path / "sem", tables_path=tables)
    store.append("s", "password", "how do I reset my password", unit(1, 0))
    store.close()
    shutil.copytree(tmp_path / "sem", tmp_path / "backup")
    store = SemanticStore(tmp_path / "sem", tables_path=tables)
    store.append("s", "refund", "how do I get a refund", unit(0, 1))  # seq 1, in the table
    store.close()
    shutil.rmtree(tmp_path / "sem")
    shutil.copytree(tmp_path / "backup", tmp_path / "sem")  # restored: next seq is 1 again
    store = SemanticStore(tmp_path / "sem", tables_path=tables)
    store.append("s", "joke", "tell me a joke", unit(1, 1))  # seq 1 again, another row
    index = SemanticIndex(store, DIM, persist_graphs=False)
    found = index.search("s", unit(0, 1), k=2)
    assert all(n.digest != "joke" or n.similarity < 0.99 for n in found)
    assert {n.digest for n in index.search("s", unit(1, 1), k=2)} == {"joke", "password"}
    index.close()


def test_a_reader_publishing_a_writers_rows_first_is_not_taken_for_another_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Between a writer's log append and its publish, a reader (or compaction) may publish the
    same rows; the writer then finds its seqs in the table with its own vectors: no rebuild."""
    store = SemanticStore(tmp_path / "sem")
    store.append("s", "first", "p", unit(1, 0))
    _, fresh = store.log_rows([("s", "second", "q", unit(0, 1))])  # appended, not published
    reader = SemanticIndex(store, DIM, persist_graphs=False)  # opens the table: publishes it
    assert {n.digest for n in reader.search("s", unit(0, 1), k=2)} == {"first", "second"}
    epoch = store.manifest(scope_tag("s")).epoch  # type: ignore[union-attr]
    for tag, (seqs, vectors) in fresh.items():
        store.tables.publish(tag, seqs, np.asarray(vectors))  # the writer's second step
    assert store.manifest(scope_tag("s")).epoch == epoch  # type: ignore[union-attr]
    assert "another row log" not in caplog.text
    assert reader.size("s") == 2
    reader.close()


def test_the_graphs_follow_a_byte_budget_and_are_valued_by_the_searches_they_save(
    tmp_path: Path,
) -> None:
    """`resize_graphs` (issue 20): the graph of the scope searched longest ago is dropped
    first, its scope is scanned flat with the same answers and is counted as wanting a graph
    in the value's span; a graph that grows past the budget is dropped at the next search; a
    scope that crosses the flat limit while the budget is full gets no graph; a larger budget
    lets a dropped graph come back, loaded from its file, not built again."""
    store = SemanticStore(tmp_path / "sem")
    rows = {name: _random_rows(300, seed) for seed, name in enumerate(("old", "new", "late"))}
    store.append_many(
        [(name, f"{name}{i}", f"p{i}", v) for name in ("old", "new") for i, v in
         enumerate(rows[name])]
    )  # fmt: skip
    index = SemanticIndex(store, DIM, flat_max_rows=50)
    index.refresh()
    for name in ("old", "new"):  # searched in this order: "old" longest ago
        for v in rows[name][:20]:
            assert index.search(name, v, k=1)[0].digest.startswith(name)
    both = index.graph_bytes()
    one = both // 2
    assert index.resize_graphs(both - 1) == both - 1
    assert index.graphs_dropped == 1 and index.graph_bytes() == one
    for i, v in enumerate(rows["old"][:20]):  # flat now: the same rows
        (hit,) = index.search("old", v, k=1)
        assert hit.digest == f"old{i}" and hit.similarity == pytest.approx(1.0, abs=1e-5)
    gained, spanned = index.graphs_value_reading()
    assert spanned == one + estimated_graph_bytes(300, DIM) and gained >= 0.0
    # a scope crossing the flat limit while the budget is full: searched flat, wanting a graph
    store.append_many([("late", f"late{i}", f"p{i}", v) for i, v in enumerate(rows["late"])])
    assert index.search("late", rows["late"][0], k=1)[0].digest == "late0"
    assert index.wait_graphs() and index.graph_bytes() == one
    _, spanned = index.graphs_value_reading()
    assert spanned == one + 2 * estimated_graph_bytes(300, DIM)
    # the held graph grows (rows past its end) beyond the budget: dropped at its next search
    index.resize_graphs(one)
    more = _random_rows(600, 9)
    store.append_many([("new", f"more{i}", f"p{i}", v) for i, v in enumerate(more)])
    assert index.search("new", more[0], k=1)[0].digest == "more0"
    assert index.graph_bytes() <= one and index.graphs_dropped == 2
    # room again: the next searches attach graphs (loaded from their files where they match)
    index.resize_graphs(1 << 30)
    for name in ("old", "new", "late"):
        index.search(name, rows[name][0], k=1)
    assert index.wait_graphs()
    for name in ("old", "new", "late"):
        index.search(name, rows[name][0], k=1)
    assert index.graphs_value_reading()[1] == index.graph_bytes()  # nothing wanting
    assert index.stats().graphs_loaded >= 1
    index.close()


def test_a_damaged_table_is_rebuilt_in_a_new_epoch_and_its_readers_follow(
    tmp_path: Path,
) -> None:
    """A scope's table whose header counts are damaged (here `claimed`, which leaves a reader's
    own reads working): the next process to open it rebuilds it from the log in the next
    epoch, and a process that had the damaged file mapped finds it retired and reopens, so it
    sees rows published after the rebuild."""
    store = SemanticStore(tmp_path / "sem")
    vectors = _random_rows(12, 3)
    _fill(store, vectors[:10])
    reader = SemanticIndex(store, DIM)
    assert reader.search("s", vectors[0], k=1)[0].digest == "d0"
    damaged = Path(_table_of(reader).path)
    with open(damaged, "r+b") as f:  # layout version 1: `claimed` at byte 192
        f.seek(192)
        f.write((1 << 40).to_bytes(8, "little"))
    writer = SemanticIndex(store, DIM)  # another process of the host (its own mapping)
    assert writer.search("s", vectors[1], k=1)[0].digest == "d1"  # rebuilt from the log
    assert Path(_table_of(writer).path) != damaged and not damaged.exists()
    _fill(store, vectors[10:], first=10)
    assert reader.search("s", vectors[11], k=1)[0].digest == "d11"
    assert reader.stats().tables_reopened >= 1
    store.close()


def test_the_verifiers_kept_scores_serve_one_search_only(tmp_path: Path) -> None:
    """VerifiedChoice keeps the last query's scores for the retries of one search; kept across
    searches, a lookup that found them (no model call: milliseconds faster) would tell its
    caller that someone, in any scope, had just asked the same against the same candidate."""
    from tiercache.semantic.verifier import VerifiedChoice

    class Guard:
        def score(self, query: str, candidate: str, cosine: float) -> float:
            return cosine

    calls: list[int] = []

    def score_pairs(queries: list[str], texts: list[str], guard: list[float]) -> np.ndarray:
        calls.append(len(texts))
        return np.full(len(texts), 0.9)

    choose = VerifiedChoice(Guard(), score_pairs, 0.5)
    embed = _Embed({"q1 reworded": unit(1, 0.05)})
    stage = _stage(tmp_path, embed)
    stage._choose = choose
    stage.answers.store(Tier.L1).put("digest-1", CacheEntry("answer one", 0.0))  # type: ignore[union-attr]
    stage.index.add("scope-a", "digest-1", "q1", unit(1, 0))
    stage.index.add("scope-b", "digest-2", "q1", unit(1, 0))
    (first,) = stage.lookup(["q1 reworded"], ["scope-a"])
    assert first.outcome is SemanticOutcome.HIT and calls == [1]
    stage.lookup(["q1 reworded"], ["scope-b"])  # another scope, the same texts
    assert calls == [1, 1]  # scored again, not read from the first search's scores
    choose("q", [("c", 0.9)])
    choose("q", [("c", 0.9)])  # within one search (a retry): kept
    assert calls == [1, 1, 1]
    choose.forget()
    choose("q", [("c", 0.9)])
    assert calls == [1, 1, 1, 1]


def test_processes_starting_cold_together_build_a_scope_s_graph_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two indexes (two stage processes) open the same large scope at once with no saved
    graph: the first builds it while holding the scope's build lock; the second waits for
    the lock and loads the graph the first saved instead of building its own."""
    store = SemanticStore(tmp_path / "sem")
    _fill(store, _random_rows(300, 0))
    real_build = ScopeSearch.build_hnsw
    builders: list[str] = []

    def slow_build(self: ScopeSearch, rows: np.ndarray) -> None:
        builders.append(threading.current_thread().name)
        time.sleep(0.5)  # long enough for the other to arrive meanwhile
        real_build(self, rows)

    monkeypatch.setattr(ScopeSearch, "build_hnsw", slow_build)
    started: dict[str, SemanticIndex] = {}

    def start(name: str) -> None:
        started[name] = _start(store)

    threads = [threading.Thread(target=start, args=(n,), name=n) for n in ("first", "second")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(started) == ["first", "second"]
    (builder,) = builders  # whichever got the lock first; the other loaded its file
    (loader,) = {"first", "second"} - {builder}
    built, loaded = started[builder].stats(), started[loader].stats()
    assert (built.graphs_built, built.graphs_loaded) == (1, 0)
    assert (loaded.graphs_built, loaded.graphs_loaded) == (0, 1)
    assert len(_graph_files(store)) == 1
    assert _agree_with_flat(started[loader], _random_rows(50, 3)) >= 47


def test_a_build_lock_held_too_long_is_given_up_and_the_caller_builds(tmp_path: Path) -> None:
    from tiercache.semantic.graph_files import GraphFiles

    graphs = GraphFiles(tmp_path / "graphs")
    with graphs.building("s") as held:
        assert held
        with graphs.building("t", wait_s=0.2) as other_scope:
            assert other_scope  # one lock per scope
        started = time.monotonic()
        with graphs.building("s", wait_s=0.2) as again:
            assert not again  # waited its 0.2 s; builds all the same
        assert 0.15 < time.monotonic() - started < 5
    with graphs.building("s", wait_s=0.2) as after:
        assert after
    unwritable = GraphFiles(tmp_path / "file" / "graphs")
    (tmp_path / "file").write_text("not a folder")
    with unwritable.building("s") as none:
        assert not none


def test_an_l3_that_cannot_be_read_stops_a_compaction_instead_of_emptying_it(
    tmp_path: Path,
) -> None:
    """Answers held only in Redis are not gone while Redis is down: `exists` raises, and the
    compaction deletes nothing (it would have deleted the row of every such answer)."""
    from tiercache.errors import Unavailable
    from tiercache.exact.redis_tier import RedisLink, RedisStore

    link = RedisLink.from_url("redis://127.0.0.1:1/0", secret=b"s" * 32, environ={})
    cache = TieredCache([(Tier.L1, MemoryStore(1 << 20)), (Tier.L3, RedisStore(link))])
    cache.put("d-local", "held here", created_s=time.time() - 1)
    store = SemanticStore(tmp_path / "sem")
    for digest in ("d-local", "d-shared"):
        store.append("s", digest, "p", unit(1, 0))
    assert cache.exists("d-local")
    with pytest.raises(Unavailable):
        cache.exists("d-shared")
    with pytest.raises(Unavailable):
        store.compact(cache.exists)
    assert [r.digest for r in store.rows_since(0)] == ["d-local", "d-shared"]
    cache.close()


def test_a_vector_kept_in_l1_does_not_keep_its_batch_alive(tmp_path: Path) -> None:
    """The embedder returns a batch; each text's vector is a row of it. L1 counts one row's
    bytes per entry, so it must hold a copy, not a view pinning the whole batch."""
    cache = VectorCache(tmp_path / "vec", DIM)
    batch = np.stack([unit(1, i) for i in range(8)])
    key = vector_key("emb@1", "third")
    cache.put(key, batch[3])
    held = cache._l1[key]
    assert held.base is None and np.array_equal(held, batch[3])
    cache.close()


def test_one_damaged_scope_fails_neither_the_start_nor_the_others_lookups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scope whose table cannot be opened (damaged files): a start's refresh logs it and
    opens the rest; in a batch, its request is a miss and the others are served."""
    embed = _Embed({"q good": unit(1, 0.05), "q bad": unit(1, 0.05)})
    stage = _stage(tmp_path, embed)
    stage.answers.store(Tier.L1).put("d-good", CacheEntry("good answer", 0.0))  # type: ignore[union-attr]
    stage.answers.store(Tier.L1).put("d-bad", CacheEntry("bad answer", 0.0))  # type: ignore[union-attr]
    stage.index.add("scope-good", "d-good", "q", unit(1, 0))
    stage.index.add("scope-bad", "d-bad", "q", unit(1, 0))
    tables = stage.index.store.tables
    open_current = tables.open_current
    broken = scope_tag("scope-bad")

    def damaged(tag: str, width: int) -> Any:
        if tag == broken:
            raise ValueError("a table's manifest says capacity 0")
        return open_current(tag, width)

    monkeypatch.setattr(tables, "open_current", damaged)
    stage.index._scopes.clear()  # as after a restart: every scope opened again
    stage.index.refresh()  # did raise: the stage never loaded
    assert stage.index.scopes_failed == 1
    good, bad = stage.lookup(["q good", "q bad"], ["scope-good", "scope-bad"])
    assert (good.outcome, good.text) == (SemanticOutcome.HIT, "good answer")
    assert bad.outcome is SemanticOutcome.MISS and stage.search_failures == 1


def test_a_row_pointing_at_another_adapters_answer_is_not_served(tmp_path: Path) -> None:
    """A scope names its adapter, and so does each answer: a row of the base model's scope
    that points at an adapter's answer (a damaged log, a forged shared row) is refused."""
    embed = _Embed({"q reworded": unit(1, 0.05)})
    stage = _stage(tmp_path, embed)
    l1 = stage.answers.store(Tier.L1)
    l1.put("d-caps", CacheEntry("AN ANSWER IN CAPS", 0.0, adapter="c" * 64))  # type: ignore[union-attr]
    stage.index.add("scope", "d-caps", "q", unit(1, 0))
    (base,) = stage.lookup(["q reworded"], ["scope"], None, None, [""])
    assert base.outcome is SemanticOutcome.STALE and stage.scope_mismatches == 1
    (caps,) = stage.lookup(["q reworded"], ["scope"], None, None, ["c" * 64])
    assert (caps.outcome, caps.text) == (SemanticOutcome.HIT, "AN ANSWER IN CAPS")


# -- compaction after a review: progress, forgotten rows, a compaction cut short ----------------


def test_a_compaction_that_frees_too_little_also_takes_the_rows_worth_least(
    tmp_path: Path,
) -> None:
    """A few dead rows at every pass (answers evicted all the time) freed too little: the log
    stayed past its mark and every write started another full pass, for good."""
    store = SemanticStore(tmp_path / "sem")
    _fill(store, _random_rows(100, 1))
    assert store.compact(lambda digest: digest != "d5") == 1  # under the mark: the dead row
    store._compactor._compact_at_bytes = 0  # noqa: SLF001 - still past the mark after it
    assert store.compact(lambda digest: digest != "d6") == 1 + 9  # and a tenth of the rest
    assert store.live_count(scope_tag("s")) == 100 - 11
    store.close()


def test_forgotten_rows_are_compacted_away_with_their_lists(tmp_path: Path) -> None:
    """An invalidated digest's row stayed live (and a copy was added each time its answer was
    indexed again); its forgotten list was never freed."""
    from tiercache.semantic.row_log import _FORGOTTEN, _tag_bytes

    store = SemanticStore(tmp_path / "sem")
    index = SemanticIndex(store, DIM, persist_graphs=False)
    index.add("s", "d1", "p1", unit(1, 0))
    index.add("s", "d2", "p2", unit(0, 1))
    assert index.search("s", unit(1, 0))
    assert index.forget(["d1"]) == 1
    index.add("s", "d1", "p1 again", unit(1, 0.1))  # generated and indexed again
    tag = scope_tag("s")
    assert store.live_count(tag) == 3
    assert store.compact(lambda digest: True) == 1  # the forgotten copy, nothing live
    assert store.live_count(tag) == 2
    with store._env.begin() as txn:  # noqa: SLF001
        assert txn.get(_FORGOTTEN + _tag_bytes("s") + b"d1") is None
    assert [n.prompt for n in index.search("s", unit(1, 0), k=2)][0] == "p1 again"
    index.close()


def test_a_table_ahead_of_the_log_is_synced_at_its_next_open(tmp_path: Path) -> None:
    """A compaction cut short between its deletes and its sync left the scope's table with
    rows the log no longer has: an emptied scope kept its place under the caps for good."""
    store = SemanticStore(tmp_path / "sem")
    _fill(store, _random_rows(10, 2))
    tag = scope_tag("s")
    seqs = store.scope_seqs(tag)
    store.delete_compacted([(seq, ("s", f"d{i}")) for i, seq in enumerate(seqs[:4])])  # no sync
    table = store.tables.open_current(tag, DIM)
    assert table is not None and table.count() == 6 == store.live_count(tag)
    table.close()
    store.close()


def test_a_table_whose_count_is_damaged_after_it_was_mapped_is_rebuilt_not_failed(
    tmp_path: Path,
) -> None:
    """The published count of a table a process already maps, damaged past its capacity: the
    table's own reads refuse it (TableFormatError) but do not retire it, so every search of
    the scope in that process failed until a restart. The search opens it again, which
    rebuilds it from the log, and answers."""
    store = SemanticStore(tmp_path / "sem")
    vectors = _random_rows(6, 4)
    _fill(store, vectors)
    reader = SemanticIndex(store, DIM)
    assert reader.search("s", vectors[0], k=1)[0].digest == "d0"
    damaged = Path(_table_of(reader).path)
    with open(damaged, "r+b") as f:  # layout version 1: `count` at byte 128
        f.seek(128)
        f.write((1 << 40).to_bytes(8, "little"))
    assert reader.search("s", vectors[3], k=1)[0].digest == "d3"
    assert Path(_table_of(reader).path) != damaged
    store.close()
