"""Speculative decoding in the CPU engine (tiercache.engine.torch_engine, tiercache.engine.drafts)
on the real model: whatever the drafts, a greedy answer is token for token the one plain decoding
gives (finish reason and counts included), across KV block boundaries and with stop words; a
draft the model agrees with saves forward passes; a sampled answer is plain decoding's for its
seed."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tiercache.engine.drafts import AnswerIndex  # noqa: E402
from tiercache.engine.kv_cache import KvBlockPool  # noqa: E402
from tiercache.errors import InvalidRequest  # noqa: E402
from tiercache.exact.request import GenerationRequest  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")

REPO = Path(__file__).resolve().parents[2]
BLOCK = 16
PROMPT = "Explain what a hash table is and why lookups are fast."
MAX_TOKENS = 40


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
def fresh(engine: Any) -> Iterator[None]:
    engine.kv_pool = KvBlockPool(64 << 20, BLOCK)
    engine.answers = AnswerIndex()  # each test starts without earlier tests' answers
    yield
    engine.speculate = True
    engine.speculate_sampled = False


class Counted:
    """Counts the model's forward passes."""

    def __init__(self, engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        forward = engine.model.forward

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return forward(*args, **kwargs)

        monkeypatch.setattr(engine.model, "forward", counted)


def run(
    engine: Any,
    request: GenerationRequest,
    drafts: tuple[str, ...],
    speculate: bool,
    source: str = "answer",
) -> Any:
    """The answer, finish reason and token count, with `drafts` as the cached answers llm
    would send (source `answer`: the same prompt's, verified in the prefill pass for a greedy
    request; `neighbour`: drafted in aligned steps)."""
    engine.speculate = speculate
    pairs = tuple((source, text) for text in drafts)
    events = list(engine.generate(replace(request, drafts=pairs)))
    final = events[-1]
    return "".join(e.text for e in events), final.finish_reason, final.generated_tokens


def plain(engine: Any, request: GenerationRequest) -> Any:
    """`run`'s result for plain decoding with the cache off: no drafts, no speculation, and no
    prefix KV reused or stored (a pool of its own, `kv_reuse` off). A reference computed after
    a speculative run on the same pool reused the blocks that run's prefill (prompt and draft
    in one pass) stored, and shared its rounding."""
    pool, reuse = engine.kv_pool, engine.kv_reuse
    engine.kv_pool, engine.kv_reuse = KvBlockPool(64 << 20, BLOCK), False
    try:
        return run(engine, request, (), speculate=False)
    finally:
        engine.kv_pool, engine.kv_reuse = pool, reuse


def test_a_draft_the_model_agrees_with_saves_passes_and_changes_nothing(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    request = GenerationRequest(PROMPT, max_tokens=MAX_TOKENS)
    counted = Counted(engine, monkeypatch)
    plain = run(engine, request, (), speculate=False)
    plain_passes, counted.calls = counted.calls, 0
    longer = replace(request, max_tokens=2 * MAX_TOKENS)
    ahead = run(engine, longer, (), speculate=False)[0]  # the same answer, further
    counted.calls = 0
    spec = run(engine, request, (ahead,), speculate=True)  # `answer`: in the prefill pass
    assert spec == plain
    assert counted.calls == 1
    counted.calls = 0
    spec = run(engine, request, (ahead,), speculate=True, source="neighbour")  # aligned steps
    assert spec == plain
    assert 1 < counted.calls <= plain_passes // 3  # prefill + a few verifications of long drafts
    drafter = engine.last_drafter  # every draft token accepted: each step adds one of its own
    steps = len(drafter.steps)
    assert drafter.accepted_total == drafter.proposed >= MAX_TOKENS - 1 - 2 * steps


@pytest.mark.parametrize(
    "drafts",
    [
        (),  # prompt lookup only
        ("Completely unrelated text about gardening and tomatoes, nothing like the answer.",),
        ("A hash table stores keys. " * 20,),  # plausible but wrong
    ],
)
def test_any_draft_gives_plain_decodings_answer(engine: Any, drafts: tuple[str, ...]) -> None:
    request = GenerationRequest(PROMPT, max_tokens=MAX_TOKENS)
    reference = plain(engine, request)
    assert run(engine, request, drafts, speculate=True) == reference
    assert run(engine, request, drafts, speculate=True) == reference  # its prompt blocks reused


def test_stop_words_and_the_token_limit_cut_a_draft_where_plain_decoding_stops(
    engine: Any,
) -> None:
    full = run(engine, GenerationRequest(PROMPT, max_tokens=MAX_TOKENS), (), speculate=False)[0]
    words = full.split()
    stop = words[len(words) // 2]
    for request in (
        GenerationRequest(PROMPT, max_tokens=MAX_TOKENS, stop_words=(stop,)),
        GenerationRequest(PROMPT, max_tokens=7),
    ):
        reference = plain(engine, request)
        assert run(engine, request, (full,), speculate=True) == reference
    assert run(engine, GenerationRequest(PROMPT, max_tokens=7), (full,), True)[1:] == ("length", 7)
    # the draft runs past the stop word: its tokens after the answer's end are not counted
    stopped = GenerationRequest(PROMPT, max_tokens=MAX_TOKENS, stop_words=(stop,))
    final = list(engine.generate(replace(stopped, drafts=(("answer", full),))))[-1]
    assert 0 < final.accepted_tokens <= final.generated_tokens
    assert final.accepted_tokens == sum(a for _, _, a in final.draft_steps)


def test_with_prefix_kv_reuse_across_block_boundaries(engine: Any) -> None:
    """A second request reuses the first one's prompt blocks; its speculative answer is plain
    decoding's, with the answer verified in the prefill pass and with aligned drafts that span
    several blocks of decoded tokens."""
    first = GenerationRequest(PROMPT, max_tokens=3 * BLOCK, tenant_scope="a" * 64)
    answer = run(engine, first, (), speculate=False)[0]
    for source in ("answer", "neighbour"):
        engine.kv_pool = KvBlockPool(64 << 20, BLOCK)
        warm = run(engine, first, (answer,), True, source)  # stores the prompt's blocks
        again = run(engine, first, (answer,), True, source)  # reuses them
        assert warm == again == plain(engine, first)


def test_the_engines_recent_answers_draft_later_requests_of_their_scope_only(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A speculated greedy answer joins the answer index of its scope (model, tenant, adapter):
    the same question asked again with a larger max_tokens, with no drafts sent, is drafted
    from it in its own tenant scope, and not in another tenant's; both answers are plain
    decoding's."""
    request = GenerationRequest(PROMPT, max_tokens=MAX_TOKENS, tenant_scope="a" * 64)
    run(engine, request, (), speculate=True)
    longer = replace(request, max_tokens=MAX_TOKENS + 8)
    plain = run(engine, longer, (), speculate=False)
    assert run(engine, longer, (), speculate=True) == plain
    same_scope = engine.last_drafter.by_source.get("index")
    assert same_scope is not None and same_scope.accepted >= MAX_TOKENS // 2
    other = replace(longer, tenant_scope="b" * 64)
    assert run(engine, other, (), speculate=True) == plain
    assert "index" not in engine.last_drafter.by_source
    events = list(engine.generate(replace(longer, tenant_scope="c" * 64)))
    assert events[-1].accepted_tokens == sum(a for _, _, a in events[-1].draft_steps)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "seeds"),
    [(1.0, 0, 1.0, (3, 11, 2**63 + 5)), (0.4, 40, 0.9, (7, 8))],
)
def test_a_sampled_answer_is_plain_decodings_for_its_seed(
    engine: Any,
    monkeypatch: pytest.MonkeyPatch,
    temperature: float,
    top_k: int,
    top_p: float,
    seeds: tuple[int, ...],
) -> None:
    """A sampled request is verified with its own seeded draw at each answer position: drafted
    from the greedy answer, its answer is token for token the one plain decoding gives for
    that seed, where the sample leaves the draft and a refused position is picked again
    included; where it follows the draft (a low temperature), passes are saved. Its answer
    does not join the scope's answer index (greedy answers only). Sampled requests speculate
    only where the deployment opts in (speculate_sampled): the equality holds for these seeds
    and this prompt; in general a draw within a verification pass's rounding of a boundary
    picks the neighbouring token (2 of 40 answers, docs/speculation.md), which the default
    avoids."""
    engine.speculate_sampled = True
    greedy = run(engine, GenerationRequest(PROMPT, max_tokens=2 * MAX_TOKENS), (), False)[0]
    engine.answers = AnswerIndex()
    counted = Counted(engine, monkeypatch)
    saved = 0
    for seed in seeds:
        request = GenerationRequest(
            PROMPT, max_tokens=MAX_TOKENS, temperature=temperature, top_k=top_k, top_p=top_p,
            seed=seed,
        )  # fmt: skip
        counted.calls = 0
        plain = run(engine, request, (), speculate=False)
        plain_passes, counted.calls = counted.calls, 0
        assert run(engine, request, (greedy,), speculate=True) == plain
        drafter = engine.last_drafter
        assert drafter is not None and drafter.proposed > 0
        saved += plain_passes - counted.calls
    if temperature < 1.0:
        assert saved > 0
    assert engine.answers.scopes() == 0


def test_with_an_adapter_active(engine: Any) -> None:
    """The verification pass runs through the request's adapter, as every plain step does."""
    from tiercache.adapter_types import AdapterRef, AdapterWeights, adapter_digest

    folder = REPO / "adapters" / "caps"
    config = (folder / "adapter_config.json").read_text()
    weights = (folder / "adapter_model.safetensors").read_bytes()
    ref = AdapterRef("caps", 1, adapter_digest(config.encode(), weights))
    engine.adapters.load(AdapterWeights(ref, config, weights))
    try:
        request = GenerationRequest(
            PROMPT,
            max_tokens=MAX_TOKENS,
            lora_name=ref.name,
            lora_task_id=ref.task_id,
            lora_digest=ref.digest,
        )
        plain = run(engine, request, (), speculate=False)
        longer = replace(request, max_tokens=2 * MAX_TOKENS)
        ahead = run(engine, longer, (), speculate=False)[0]
        base = run(engine, GenerationRequest(PROMPT, max_tokens=MAX_TOKENS), (), False)[0]
        assert plain[0] != base  # the adapter is in effect
        assert run(engine, request, (ahead,), speculate=True) == plain
        assert engine.last_drafter.accepted_total > 0
        assert run(engine, request, (base,), speculate=True) == plain  # the base answer: refused
    finally:
        engine.adapters.activate(None)


def verified(engine: Any, request: GenerationRequest, answer: str) -> Any:
    """`request` with `answer` to verify in the prefill pass (source `verify`, as llm sends a
    semantic hit's answer)."""
    engine.speculate = True
    events = list(engine.generate(replace(request, drafts=(("verify", answer),))))
    final = events[-1]
    return "".join(e.text for e in events), final.finish_reason, final.generated_tokens


@pytest.mark.parametrize(
    ("prompt", "max_tokens"),
    [(PROMPT, MAX_TOKENS), ("Say hello.", 60)],  # cut at the limit; ended by itself
)
def test_the_models_own_answer_is_verified_in_the_prefill_pass_alone(
    engine: Any, monkeypatch: pytest.MonkeyPatch, prompt: str, max_tokens: int
) -> None:
    """A semantic hit's answer that is exactly what the model generates is checked in one
    forward pass over prompt plus answer: no decoding step follows, every token counts as
    speculated, and the answer is plain decoding's."""
    request = GenerationRequest(prompt, max_tokens=max_tokens)
    plain = run(engine, request, (), speculate=False)
    counted = Counted(engine, monkeypatch)
    assert verified(engine, request, plain[0]) == plain
    assert counted.calls == 1
    drafter = engine.last_drafter
    assert drafter.by_source["verify"].accepted == plain[2] == drafter.accepted_total
    assert plain[1] == ("length" if prompt == PROMPT else "stop")


def test_a_greedy_requests_cached_answer_is_verified_in_the_prefill_pass(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same prompt's answer cached under a smaller max_tokens (source `answer`) is checked
    whole in the prefill pass, then decoding goes on past it: the answer is plain decoding's,
    and the cached part costs one pass instead of drafts of at most MAX_DRAFT_TOKENS."""
    from tiercache.engine.drafts import MAX_DRAFT_TOKENS

    short = run(engine, GenerationRequest(PROMPT, max_tokens=MAX_DRAFT_TOKENS + 8), (), False)
    assert short[1] == "length"  # cut: the longer request goes on past it
    longer = GenerationRequest(PROMPT, max_tokens=MAX_DRAFT_TOKENS + 24)
    plain = run(engine, longer, (), speculate=False)
    counted = Counted(engine, monkeypatch)
    assert run(engine, longer, (short[0],), speculate=True) == plain
    first = engine.last_drafter.steps[0]
    assert first == ("answer", short[2], short[2])  # the whole cached answer, in one step
    assert counted.calls <= 1 + (plain[2] - short[2])  # the prefill, then at most a pass a token
    sampled = replace(longer, temperature=0.8, seed=4)  # not for a sampled request
    engine.speculate_sampled = True
    run(engine, sampled, (short[0],), speculate=True)
    steps = engine.last_drafter.steps
    assert steps and steps[0][0] == "answer"  # drafted from the answer, in steps
    assert all(proposed <= MAX_DRAFT_TOKENS for _, proposed, _ in steps)


def test_an_answer_whose_text_tokenizes_otherwise_is_drafted_by_its_text(
    engine: Any,
) -> None:
    """SmolLM2 writes a paragraph break as one token that encoding its text splits in two, so
    a cached answer with one leaves the token-aligned draft there; the drafts then follow the
    answer's text (the rest of it tokenized again), and nearly all of it is still drafted."""
    request = GenerationRequest("List three uses of Python in science.", max_tokens=MAX_TOKENS)
    plain = run(engine, request, (), speculate=False)
    assert "\n\n" in plain[0]  # the case this test is about
    assert run(engine, request, (plain[0],), speculate=True) == plain
    drafter = engine.last_drafter
    first = drafter.steps[0]
    assert first[0] == "answer" and first[2] < first[1]  # the prefill pass kept a part
    # every step but the first keeps its whole draft but at a paragraph break: one token each
    answer = drafter.by_source["answer"]
    assert answer.accepted >= plain[2] - 2 * len(drafter.steps)
    assert len(drafter.steps) <= 6


def test_passes_over_several_tokens_run_on_pass_threads(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With pass_threads set, the prefill and every verification pass run on that many torch
    threads and one-token steps on the engine's own; the count is back after the answer, which
    is plain decoding's."""
    request = GenerationRequest(PROMPT, max_tokens=MAX_TOKENS)
    plain = run(engine, request, (), speculate=False)
    own = torch.get_num_threads()
    seen: list[tuple[int, int]] = []  # (tokens in the pass, torch threads during it)
    forward = engine.model.forward

    def recorded(*args: Any, **kwargs: Any) -> Any:
        seen.append((int(kwargs["input_ids"].shape[1]), torch.get_num_threads()))
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", recorded)
    engine.pass_threads = own + 1
    try:
        half = plain[0][: len(plain[0]) // 2]
        assert run(engine, request, (half,), True, "neighbour") == plain
    finally:
        engine.pass_threads = 0
    assert torch.get_num_threads() == own
    assert {threads for tokens, threads in seen if tokens > 1} == {own + 1}
    assert {threads for tokens, threads in seen if tokens == 1} <= {own}
    assert any(tokens > 1 for tokens, _ in seen[1:])  # a verification pass, not only the prefill


@pytest.mark.parametrize(
    "answer",
    [
        "A completely different answer about gardening and tomatoes.",
        "A hash table stores keys. " * 10,  # plausible, then wrong
    ],
)
def test_a_wrong_or_partly_right_answer_to_verify_gives_plain_decodings(
    engine: Any, answer: str
) -> None:
    request = GenerationRequest(PROMPT, max_tokens=MAX_TOKENS)
    reference = plain(engine, request)
    assert verified(engine, request, answer) == reference
    prefix = reference[0][: len(reference[0]) // 2] + " and then something else entirely."
    assert verified(engine, request, prefix) == reference
    assert engine.last_drafter.by_source["verify"].accepted > 0  # its right half was kept


def test_a_verifying_pass_stores_no_blocks_and_the_next_plain_prefill_does(
    engine: Any,
) -> None:
    """A prompt and a cached answer run in one pass, whose shapes round otherwise than the
    prompt's alone (a 250-word prompt's KV 4e-5 apart on 2 threads): its blocks were stored,
    and a request reusing them, even one that asked for no speculation, read what speculation
    computed. They are not stored now; the next plain prefill of the prompt stores them,
    bitwise those of a pool that never saw speculation."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi".split()
    prompt = " ".join(words[i % len(words)] for i in range(250))  # short ones rounded alike
    request = GenerationRequest(prompt, max_tokens=64, tenant_scope="b" * 64)

    def blocks() -> dict[Any, torch.Tensor]:
        return {key: block.payload for key, block in engine.kv_pool._blocks.items()}

    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # as the review measured; short prompts rounded alike here
    try:
        engine.kv_pool = KvBlockPool(64 << 20, BLOCK)
        plain_answer = run(engine, request, (), speculate=False)[0]
        plain_blocks = blocks()
        assert len(plain_blocks) >= 4
        for answer in (plain_answer, "The answer is a list of buckets and keys. " * 10):
            engine.kv_pool = KvBlockPool(64 << 20, BLOCK)
            assert verified(engine, request, answer)[0] == plain_answer
            assert not blocks()  # none from the pass with the answer behind the prompt
            run(engine, request, (), speculate=False)
            stored = blocks()
            assert stored.keys() == plain_blocks.keys()
            assert all(torch.equal(stored[key], plain_blocks[key]) for key in stored)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"max_tokens": -3}, "max_tokens must be >= 1"),
        ({"temperature": 2.5}, "temperature must be in"),
        ({"top_p": 0.0}, "top_p must be in"),
        ({"top_k": -1}, "top_k must be in"),
        ({"temperature": 0.5, "seed": -1}, "seed must fit"),
    ],
)
def test_values_out_of_range_are_refused_before_any_model_work(
    engine: Any, monkeypatch: pytest.MonkeyPatch, change: dict[str, Any], fragment: str
) -> None:
    """An engine call is sealed by llm; the engine still checks what it is handed (max_tokens
    0 gave a token, a negative one kept a whole draft to verify)."""
    counted = Counted(engine, monkeypatch)
    request = replace(GenerationRequest(PROMPT, max_tokens=4), **change)
    with pytest.raises(InvalidRequest, match=fragment):
        next(iter(engine.generate(request)))
    assert counted.calls == 0


def test_a_drafts_text_is_cut_to_what_max_tokens_can_use(engine: Any) -> None:
    """A draft of a megabyte was compared and retokenized at every step; what no answer of
    max_tokens could use is cut first."""
    from tiercache.engine.torch_engine import DRAFT_CHARS_PER_TOKEN

    request = GenerationRequest(PROMPT, max_tokens=4)
    run(engine, request, ("word " * 200_000,), speculate=True, source="neighbour")
    answers = engine.last_drafter._answers
    assert answers and all(len(a.tokens) <= 4 * DRAFT_CHARS_PER_TOKEN for a in answers)


def test_verifying_with_prompt_blocks_reused_and_a_sampled_request(engine: Any) -> None:
    """The prefill pass that verifies runs on the prompt's reused KV blocks too; a sampled
    request's answer (speculate_sampled on) is verified with its seeded draws (plain
    decoding's for this seed: see the test above for why that is not a general guarantee)."""
    request = GenerationRequest(PROMPT, max_tokens=3 * BLOCK, tenant_scope="a" * 64)
    plain = run(engine, request, (), speculate=False)  # stores the prompt's blocks
    assert verified(engine, request, plain[0]) == plain  # reuses them
    assert engine.last_drafter.accepted_total == plain[2]
    sampled = replace(request, temperature=0.8, seed=4)
    engine.speculate_sampled = True
    assert verified(engine, sampled, plain[0]) == run(engine, sampled, (), speculate=False)


def test_by_default_a_sampled_request_is_decoded_plainly_whatever_it_was_sent(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without speculate_sampled a sampled request is not speculated: no drafter, one forward
    pass per token, the drafts it came with unread; its answer is plain decoding's for its
    seed whatever was drafted (a verification pass's rounding could move a draw: seen on an
    H200, docs/speculation.md). A greedy request on the same engine still speculates."""
    greedy = GenerationRequest(PROMPT, max_tokens=MAX_TOKENS)
    answer = run(engine, greedy, (), speculate=False)
    sampled = replace(greedy, temperature=0.8, seed=4)
    counted = Counted(engine, monkeypatch)
    plain = run(engine, sampled, (), speculate=False)
    plain_passes, counted.calls = counted.calls, 0
    assert run(engine, sampled, (answer[0],), speculate=True) == plain
    assert engine.last_drafter is None
    assert counted.calls == plain_passes  # one pass per token, as plain decoding
    counted.calls = 0
    assert run(engine, greedy, (answer[0],), speculate=True) == answer
    assert engine.last_drafter is not None and engine.last_drafter.accepted_total > 0
    assert counted.calls < answer[2]


def test_an_answers_mean_logprob_is_its_own_and_speculation_does_not_change_it(
    engine: Any,
) -> None:
    """The final event's mean_logprob (issue 19's confidence) is the mean of the picked tokens'
    log-probabilities, its end included: transformers' own greedy generation of the same prompt
    gives the same tokens and, from its raw logits, the same mean; a speculated answer (drafted
    by that very answer) reports the same within float noise."""
    request = GenerationRequest(PROMPT, max_tokens=MAX_TOKENS)
    engine.speculate = False
    plain = list(engine.generate(request))[-1]
    engine.speculate = True
    text = "".join(e.text for e in engine.generate(request))
    drafted = list(engine.generate(replace(request, drafts=(("answer", text),))))[-1]
    assert plain.mean_logprob is not None and drafted.mean_logprob is not None
    assert plain.mean_logprob < 0
    assert drafted.mean_logprob == pytest.approx(plain.mean_logprob, abs=1e-3)

    input_ids = engine.prompt_ids(request)
    with torch.inference_mode():
        out = engine.model.generate(
            input_ids,
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=engine.tokenizer.eos_token_id,
        )
    picked = out.sequences[0, input_ids.shape[1] :].tolist()
    logprobs = [
        float(torch.log_softmax(row[0].float(), dim=-1)[token])
        for row, token in zip(out.logits, picked, strict=True)
    ]
    ends = [i for i, t in enumerate(picked) if t in engine.eos_token_ids]
    taken = logprobs[: ends[0] + 1] if ends else logprobs
    assert len(taken) == plain.generated_tokens + (1 if ends else 0)
    assert plain.mean_logprob == pytest.approx(sum(taken) / len(taken), abs=1e-4)


def test_the_draft_replay_takes_the_engines_own_steps(engine: Any) -> None:
    """tiercache_dev.bench.draft_replay models only the seconds: its drafter, fed the recorded
    plain answer, proposes and keeps what the engine's did, step for step (an answer cached
    under a smaller max_tokens, asked with more; and a neighbour's answer that starts
    otherwise), with the prompt's shorter answer in the scope's index."""
    from tiercache.engine.drafts import AnswerIndex
    from tiercache_dev.bench.draft_replay import SCOPE, Case, CostModel, replay

    shorter = GenerationRequest(PROMPT, max_tokens=16)
    short = run(engine, shorter, (), speculate=False)[0]
    # a neighbour's answer that says the same after another start: drafted by its n-grams
    drafts = {"answer": short, "neighbour": "Put simply, " + short}
    request = GenerationRequest(PROMPT, max_tokens=MAX_TOKENS)
    plain = list(engine.generate(request))[-1]  # speculate False since `run`
    case = Case(
        "hash table",
        engine.prompt_ids(request)[0].tolist(),
        [],
        MAX_TOKENS,
        list(plain.token_ids),
        plain.finish_reason == "stop",
    )
    cost = CostModel({1: 0.05, 33: 0.15}, {32: 0.1, 400: 0.5})
    sources: set[str] = set()
    for source, text in drafts.items():
        engine.answers = AnswerIndex()
        engine.speculate = True
        earlier = list(engine.generate(shorter))[-1]  # speculative: indexed in the scope
        spec = list(engine.generate(replace(request, drafts=((source, text),))))[-1]
        case.drafts = [(source, text)]
        index = AnswerIndex()
        index.add(SCOPE, earlier.token_ids)
        replayed = replay(case, cost, engine.encode_text, engine.decode_ids, index.view(SCOPE))
        assert spec.token_ids == plain.token_ids
        assert replayed.steps == list(spec.draft_steps), source
        assert replayed.plain_passes == plain.generated_tokens + (plain.finish_reason == "stop")
        assert 0 < replayed.ceiling_s <= replayed.spec_s
        sources |= {s for s, _, _ in replayed.steps}
    assert {"answer", "neighbour", "index"} <= sources  # each source drafted somewhere
