"""Prefix KV reuse in the CPU engine (TorchEngine + tiercache.engine.kv_cache) on the real model.

Greedy output with reuse must equal output without it; reuse never crosses tenants or adapters;
reused and computed prompt tokens add up; the pool stays inside its byte budget. One TorchEngine
for the module, on one CPU thread, like tests/unit/test_engine_adapters.py (same state directory
rule: $TIERCACHE_STATE_DIR, else the repository's `.tiercache/`). Each test gets a fresh pool.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402 - after HF_HUB_OFFLINE

from tiercache.adapter_types import AdapterRef, AdapterWeights  # noqa: E402
from tiercache.engine.events import StreamEvent  # noqa: E402
from tiercache.engine.kv_cache import KvBlockPool  # noqa: E402
from tiercache.exact.request import GenerationRequest  # noqa: E402

# peft still asks transformers for the deprecated name.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")

REPO = Path(__file__).resolve().parents[2]
BLOCK = 16  # tokens per block: several blocks in a short prompt
MAX_TOKENS = 8
SCOPE_A, SCOPE_B = "a" * 64, "b" * 64
SYSTEM = (
    "You are the help desk of a small hardware store. Answer in one short sentence, be polite, "
    "never invent prices, and say when you do not know. The store opens at nine, closes at six, "
    "sells tools, paint, garden supplies and screws, and delivers within ten miles for free."
)
TURNS = ("When do you open?", "Do you sell paint?", "Can you deliver to my house?")


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    from tiercache.engine.model_source import resolve_model
    from tiercache.engine.torch_engine import TorchEngine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    state = Path(os.environ.get("TIERCACHE_STATE_DIR") or REPO / ".tiercache")
    try:
        yield TorchEngine(resolve_model(), state / "models", "cpu", 2, tokens_per_block=BLOCK)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def fresh_pool(engine: Any) -> Iterator[None]:
    engine.kv_pool = KvBlockPool(256 << 20, BLOCK)
    engine.kv_reuse = True
    yield
    engine.kv_reuse = True
    engine.adapters.activate(None)


def generate(engine: Any, request: GenerationRequest, reuse: bool = True) -> StreamEvent:
    """The whole answer as one event (the final event's counts); checks every event's counts."""
    engine.kv_reuse = reuse
    events = list(engine.generate(request))
    engine.kv_reuse = True
    final = events[-1]
    for event in events:
        assert event.reused_tokens + event.computed_tokens == event.prompt_tokens
        assert (event.reused_tokens, event.computed_tokens) == (
            final.reused_tokens,
            final.computed_tokens,
        )
    return replace(final, text="".join(e.text for e in events))


def common_prefix(engine: Any, turn: str, other: str) -> int:
    a = engine.prompt_ids(GenerationRequest(f"{SYSTEM} {turn}"))[0].tolist()
    b = engine.prompt_ids(GenerationRequest(f"{SYSTEM} {other}"))[0].tolist()
    pairs = zip(a, b, strict=False)
    return next((i for i, (x, y) in enumerate(pairs) if x != y), min(len(a), len(b)))


def request(turn: str, scope: str = SCOPE_A, **fields: Any) -> GenerationRequest:
    return GenerationRequest(
        f"{SYSTEM} {turn}", max_tokens=MAX_TOKENS, tenant_scope=scope, **fields
    )


def test_reuse_gives_the_same_greedy_output(engine: Any) -> None:
    expected = [generate(engine, request(turn), reuse=False) for turn in TURNS]
    assert all(e.reused_tokens == 0 for e in expected)
    assert engine.kv_stats().lookups == 0  # reuse off: the pool is not touched
    got = [generate(engine, request(turn)) for turn in TURNS]
    assert [g.text for g in got] == [e.text for e in expected]
    assert got[0].reused_tokens == 0
    for index, later in enumerate(got[1:], start=1):
        # Every full block of the prefix shared with an earlier prompt is reused, nothing more.
        shared = max(common_prefix(engine, TURNS[index], TURNS[j]) for j in range(index))
        assert later.reused_tokens == shared // BLOCK * BLOCK > 0
    stats = engine.kv_stats()
    assert (stats.lookups, stats.hit_lookups) == (3, 2)
    assert stats.reused_tokens == sum(g.reused_tokens for g in got)
    assert stats.computed_tokens == sum(g.computed_tokens for g in got)


def test_blocks_join_the_pool_before_decoding_and_stay_pinned_while_used(engine: Any) -> None:
    """A second request reuses the first one's blocks while the first is still decoding (its
    generator is paused after its first token); the first one's blocks are pinned meanwhile."""
    expected = [generate(engine, request(turn), reuse=False).text for turn in TURNS[:2]]
    first = engine.generate(request(TURNS[0]))
    head = next(first)  # prefill done, first token out, blocks stored
    assert head.finish_reason is None
    pinned = engine.kv_stats().pinned_blocks
    assert pinned == head.prompt_tokens // BLOCK
    second = generate(engine, request(TURNS[1]))
    assert second.reused_tokens > 0
    assert engine.kv_stats().pinned_blocks == pinned  # the second one released its own
    rest = "".join(e.text for e in first)
    assert [head.text + rest, second.text] == expected
    assert engine.kv_stats().pinned_blocks == 0


def test_a_fully_cached_prompt_on_a_block_boundary(engine: Any) -> None:
    """A prompt of whole blocks, asked twice: all but its last token come from the pool."""
    turn = "Is it open today?"
    while int(engine.prompt_ids(GenerationRequest(f"{SYSTEM} {turn}")).shape[1]) % BLOCK:
        turn += " ok"
    prompt_tokens = int(engine.prompt_ids(GenerationRequest(f"{SYSTEM} {turn}")).shape[1])
    expected = generate(engine, request(turn), reuse=False)
    first = generate(engine, request(turn))
    again = generate(engine, request(turn))
    assert first.text == again.text == expected.text
    assert (again.reused_tokens, again.computed_tokens) == (prompt_tokens - 1, 1)
    assert engine.kv_stats().blocks == prompt_tokens // BLOCK
    # A longer prompt shares the chain up to where it differs (the chat template's tail follows
    # the user turn, so not the last block).
    longer = generate(engine, request(turn + " Thanks."))
    shared = common_prefix(engine, turn, turn + " Thanks.")
    assert longer.reused_tokens == shared // BLOCK * BLOCK > 0
    assert longer.text == generate(engine, request(turn + " Thanks."), reuse=False).text


def test_another_tenant_never_reuses(engine: Any) -> None:
    generate(engine, request(TURNS[0], SCOPE_A))
    other = generate(engine, request(TURNS[0], SCOPE_B))
    assert other.reused_tokens == 0
    assert generate(engine, request(TURNS[1], SCOPE_B)).reused_tokens > 0  # its own blocks
    stats = engine.kv_stats()
    assert (stats.lookups, stats.hit_lookups) == (3, 1)


def adapter_weights(style: str) -> AdapterWeights:
    folder = REPO / "adapters" / style
    config = (folder / "adapter_config.json").read_text()
    weights = (folder / "adapter_model.safetensors").read_bytes()
    digest = hashlib.sha256(config.encode() + weights).hexdigest()
    return AdapterWeights(AdapterRef(style, 1, digest), config, weights)


def test_reuse_with_an_adapter_stays_with_that_adapter(engine: Any) -> None:
    weights = adapter_weights("caps")
    engine.adapters.load(weights)
    ref = weights.ref

    def with_adapter(turn: str) -> GenerationRequest:
        return request(turn, lora_name=ref.name, lora_task_id=ref.task_id, lora_digest=ref.digest)

    base = generate(engine, request(TURNS[0]))
    assert base.reused_tokens == 0
    expected = [generate(engine, with_adapter(turn), reuse=False) for turn in TURNS[:2]]
    got = [generate(engine, with_adapter(turn)) for turn in TURNS[:2]]
    assert got[0].reused_tokens == 0  # the base model's blocks are not the adapter's
    assert got[1].reused_tokens > 0
    assert [g.text for g in got] == [e.text for e in expected]
    assert got[0].text != base.text  # the adapter really changes the answer
    # The base model reuses only its own blocks, as many as before the adapter's requests.
    assert generate(engine, request(TURNS[1])).reused_tokens == got[1].reused_tokens


def test_pool_stays_inside_a_tiny_budget(engine: Any) -> None:
    block_bytes = engine.kv_bytes_per_token * BLOCK
    assert engine.kv_bytes_per_token == 30 * 2 * 3 * 64 * 4  # SmolLM2-135M, float32
    budget = 5 * block_bytes + block_bytes // 2
    engine.kv_pool = KvBlockPool(budget, BLOCK)
    prompts = [request(turn) for turn in TURNS] + [request(turn, SCOPE_B) for turn in TURNS[:2]]
    for item in prompts:
        got = generate(engine, item)
        assert engine.kv_stats().bytes <= budget
        assert got.text == generate(engine, item, reuse=False).text
    stats = engine.kv_stats()
    assert stats.evictions > 0 and stats.blocks <= 5
    assert stats.pinned_blocks == 0


# ---- the context window ------------------------------------------------------------------------


def test_context_window_comes_from_the_model_config() -> None:
    from types import SimpleNamespace

    from tiercache.engine.torch_engine import context_window

    assert context_window(SimpleNamespace(max_position_embeddings=8192, n_positions=4)) == 8192
    assert context_window(SimpleNamespace(n_positions=1024)) == 1024
    assert context_window(SimpleNamespace(max_position_embeddings=None)) is None
    assert context_window(SimpleNamespace()) is None


def test_check_context_names_both_numbers() -> None:
    from tiercache.engine.torch_engine import check_context
    from tiercache.errors import InvalidRequest

    check_context(100, 28, 128)  # exactly full
    check_context(10**6, 10**6, None)  # no window known: not checked here
    with pytest.raises(InvalidRequest) as info:
        check_context(100, 29, 128)
    assert info.value.message == (
        "the prompt is 100 tokens and max_tokens is 29: 129 tokens do not fit the model's "
        "context window of 128 tokens"
    )


def test_a_request_past_the_context_window_is_refused_before_any_work(engine: Any) -> None:
    from tiercache.errors import InvalidRequest

    window = engine.context_tokens
    assert window == engine.model.config.max_position_embeddings
    prompt_tokens = int(engine.prompt_ids(GenerationRequest("When do you open?")).shape[1])
    fits = GenerationRequest("When do you open?", max_tokens=window - prompt_tokens)
    over = replace(fits, max_tokens=window - prompt_tokens + 1, lora_digest="f" * 64)
    before = engine.kv_pool.stats()
    with pytest.raises(InvalidRequest) as info:
        next(engine.generate(over))  # an unloaded adapter: NotFound if it had got that far
    assert f"the prompt is {prompt_tokens} tokens and max_tokens is {over.max_tokens}" in (
        info.value.message
    )
    assert f"context window of {window} tokens" in info.value.message
    assert engine.kv_pool.stats() == before  # no lookup, no prefill
    first = next(engine.generate(replace(fits, max_tokens=1)))  # the same prompt still runs
    assert first.finish_reason is not None


def test_a_conversations_next_turn_reuses_the_blocks_of_the_turns_before(engine: Any) -> None:
    """Multi-turn chat: the engine templates [*history, user prompt] once, so the second
    turn's prompt starts with the first one's rendering (up to its generation prompt) and
    reuses those blocks; a raw prompt is tokenized as it is, untemplated."""
    first = GenerationRequest(
        TURNS[0], max_tokens=MAX_TOKENS, tenant_scope=SCOPE_A, history=(("system", SYSTEM),)
    )
    answer = generate(engine, first)
    second = replace(
        first,
        prompt=TURNS[1],
        history=(("system", SYSTEM), ("user", TURNS[0]), ("assistant", answer.text)),
    )
    rendered = engine.tokenizer.apply_chat_template(
        [{"role": r, "content": c} for r, c in second.history]
        + [{"role": "user", "content": TURNS[1]}],
        add_generation_prompt=True,
        return_dict=True,
    )["input_ids"]
    assert engine.prompt_ids(second)[0].tolist() == list(rendered)
    followed = generate(engine, second)
    before = engine.prompt_ids(first)[0].tolist()
    assert rendered[: len(before)] == before  # the whole first prompt is the second's prefix
    shared = len(before)
    assert followed.reused_tokens == shared // BLOCK * BLOCK > 0
    assert followed.text == generate(engine, second, reuse=False).text

    raw_text = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": TURNS[2]}], add_generation_prompt=True, tokenize=False
    )
    raw = GenerationRequest(raw_text, max_tokens=MAX_TOKENS, raw_prompt=True)
    templated = GenerationRequest(TURNS[2], max_tokens=MAX_TOKENS)
    assert engine.prompt_ids(raw)[0].tolist() == engine.prompt_ids(templated)[0].tolist()


def test_a_request_cancelled_before_its_prefill_runs_no_prompt_and_pins_nothing(
    engine: Any,
) -> None:
    """The prefill is the longest step (seconds for a long prompt on a CPU): a request its
    caller left before it is answered as cancelled without it, and holds no block. Nor does it
    look its prompt up: a lookup was counted, its blocks' reuses raised and the policy told of
    an access, and its event reported the whole prompt computed."""
    lookups = engine.kv_stats().lookups
    events = list(engine.generate(GenerationRequest(TURNS[0], max_tokens=4), lambda: True))
    assert [(e.text, e.finish_reason) for e in events] == [("", "cancelled")]
    assert (events[0].reused_tokens, events[0].computed_tokens) == (0, 0)
    stats = engine.kv_stats()
    assert stats.blocks == 0 and stats.pinned_blocks == 0
    assert stats.lookups == lookups  # nothing looked up, nothing computed


def test_a_failure_storing_the_prompts_blocks_does_not_fail_the_request(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefill worked: a copy out of memory or a broken pool while storing its blocks
    ended the request."""
    plain = generate(engine, request(TURNS[0]), reuse=False)

    def broken(*args: object, **kwargs: object) -> bool:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(engine.kv_pool, "insert", broken)
    answer = generate(engine, request(TURNS[0]))
    assert (answer.text, answer.finish_reason) == (plain.text, plain.finish_reason)
    assert engine.kv_stats().pinned_blocks == 0


def test_a_lowered_budget_is_taken_up_by_a_request_that_looks_nothing_up(engine: Any) -> None:
    """`resize` records a new budget for the engine thread: a request without a lookup (reuse
    switched off, a caller gone before its prefill) takes it up too, instead of the pool
    holding more than its budget until the next lookup."""
    for turn in TURNS[:3]:
        generate(engine, request(turn))
    held = engine.kv_stats().bytes
    block_bytes = engine.kv_bytes_per_token * BLOCK
    assert held > 2 * block_bytes
    engine.kv_pool.resize(block_bytes)
    generate(engine, request(TURNS[0]), reuse=False)
    assert engine.kv_stats().bytes <= block_bytes
    engine.kv_pool.resize(256 << 20)
    list(engine.generate(request(TURNS[1]), lambda: True))  # gone before its prefill
    assert engine.kv_pool.max_bytes == 256 << 20


def test_a_stream_closed_mid_answer_releases_its_blocks_at_once(engine: Any) -> None:
    """A generation closed mid-answer (torch_llm closes it when a send fails) unpins its
    prompt's blocks then, not whenever the generator is collected."""
    events = engine.generate(GenerationRequest(f"{SYSTEM} {TURNS[0]}", tenant_scope=SCOPE_A))
    next(events)  # the prefill ran: the prompt's blocks are pinned while it streams
    assert engine.kv_stats().pinned_blocks > 0
    events.close()
    assert engine.kv_stats().pinned_blocks == 0
