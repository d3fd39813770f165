"""The OpenAI API's request and response shapes, as the gateway takes and answers them.

Requests are checked here, before anything reaches Triton: a field this server does not know
is a 400 naming it (as OpenAI's own server answers "Unrecognized request argument"; ignoring it
would answer, and cache, a request asking for more, such as vLLM's `guided_json`, as if it had
not), a field of the wrong type or range is a 400 naming it, `n` other than 1 is refused.
Responses follow OpenAI's objects (`chat.completion`, `chat.completion.chunk`,
`text_completion`) plus one documented extra field, `tiercache`, with the cache status and
similarity.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

from tiercache.errors import InvalidRequest
from tiercache.exact.answer_ids import Nonces
from tiercache.exact.request import DEFAULT_LIMITS

MAX_STOP_WORDS = 4  # OpenAI's own limit on `stop`
# the ensemble's history limit plus the last user turn: a longer list is refused before any of
# its messages is read
MAX_MESSAGES = DEFAULT_LIMITS.max_history_turns + 1
MAX_ANSWER_ID_CHARS = 512  # an answer id is 127 characters (tiercache.exact.answer_ids)
CACHE_CONTROL_HEADER_WORDS = ("no-cache", "no-store")
MAX_AGE_RE = re.compile(r"^max-age=(\d+)$")


_RESPONSE_IDS = Nonces()  # `Generation.id`: 24 hex characters


@dataclass(frozen=True, slots=True)
class Generation:
    """One request as the ensemble takes it (tiercache_client.build_inputs's arguments)."""

    prompt: str
    model: str  # as the caller named it: the base model's id or an adapter's name
    lora_name: str | None
    stream: bool
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # not OpenAI's; vLLM-style clients send it (0: off)
    seed: int | None = None
    stop_words: tuple[str, ...] = ()
    cache_control: str | None = None
    user: str | None = None
    chat: bool = True  # /v1/chat/completions; else /v1/completions, whose prompt is sent raw
    include_usage: bool = False  # a stream's `stream_options.include_usage`: a usage chunk
    history: tuple[dict[str, str], ...] = ()  # a chat's turns before its last user message
    created: int = field(default_factory=lambda: int(time.time()))
    # random, not a counter (which would tell callers how busy the gateway is); 12 bytes of the
    # OS's CSPRNG drawn in batches (one getrandom call per id was 6 % of an edge hit's CPU)
    id: str = field(default_factory=lambda: _RESPONSE_IDS.take().hex())


def _number(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(f"'{name}' must be a number, got {type(value).__name__}")
    if not low <= value <= high:
        raise InvalidRequest(f"'{name}' must be in [{low:g}, {high:g}], got {value}")
    return float(value)


def _integer(body: dict[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"'{name}' must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise InvalidRequest(f"'{name}' must be in [{low}, {high}], got {value}")
    return value


def _seed(body: dict[str, Any]) -> int | None:
    """OpenAI's `seed`, a signed 64-bit integer, as the ensemble's uint64: a negative one in
    two's complement (-1 -> 2**64 - 1), so that distinct seeds stay distinct."""
    seed = _integer(body, "seed", -(2**63), 2**63 - 1)
    return None if seed is None else seed % 2**64


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    words = [stop] if isinstance(stop, str) else stop
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise InvalidRequest("'stop' must be a string or a list of strings")
    if len(words) > MAX_STOP_WORDS:
        raise InvalidRequest(f"'stop' takes at most {MAX_STOP_WORDS} strings, got {len(words)}")
    return tuple(w for w in words if w)


def cache_control_words(header: str | None, extra: object) -> str | None:
    """The ensemble's `cache_control`: the HTTP `Cache-Control` request header's `no-cache`,
    `no-store` and `max-age=N` (other HTTP directives ignored, as a cache may), then tiercache's
    own words from the body's `tiercache.cache_control` (a string, passed on as it is: the
    ensemble checks it)."""
    words: list[str] = []
    for raw in (header or "").split(","):
        word = raw.strip().lower()
        name, eq, value = word.partition("=")
        if eq and len(value) >= 2 and value[0] == value[-1] == '"':
            word = f"{name.strip()}={value[1:-1]}"  # max-age="0": the quoted form, RFC 9111
        if word in CACHE_CONTROL_HEADER_WORDS or MAX_AGE_RE.match(word):
            words.append(word)
    if extra is not None:
        if not isinstance(extra, str):
            raise InvalidRequest("'tiercache.cache_control' must be a string")
        if extra.strip():
            words.append(extra.strip())
    return ", ".join(words) or None


def _utf8(name: str, text: str) -> str:
    """`text` if it can travel as UTF-8 (JSON allows lone surrogates, which cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(f"'{name}' is not valid Unicode (a lone surrogate?)") from exc
    return text


CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def _content(message: dict[str, Any], i: int) -> str:
    """A message's text: a string, or a list of text parts (joined by newlines, as OpenAI-
    compatible servers do). Images, audio and tool calls are refused by name."""
    for name in ("tool_calls", "function_call", "tool_call_id"):
        if message.get(name):  # whatever the content beside it: never dropped silently
            raise InvalidRequest(f"'messages[{i}]' carries {name}: tools are not supported")
    content = message.get("content")
    if isinstance(content, str):
        return _utf8(f"messages[{i}].content", content)
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidRequest(
                    f"'messages[{i}].content[{j}]' is a {str(kind)[:40]!r} part: only text parts "
                    "are supported"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidRequest(f"'messages[{i}].content[{j}].text' must be a string")
            texts.append(_utf8(f"messages[{i}].content[{j}].text", text))
        return "\n".join(texts)
    raise InvalidRequest(f"'messages[{i}].content' must be a string or a list of text parts")


def conversation(messages: object) -> tuple[tuple[dict[str, str], ...], str]:
    """`messages` as the ensemble takes a conversation: the earlier turns (`history`, roles
    system, user and assistant; `developer` is a system turn, as OpenAI treats it for models
    without one) and the last user turn (`text_input`). The engine applies the chat template
    to all of it once. The last message must be the user's: a conversation that ends in an
    assistant turn asks for a continuation, which the chat template does not render."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list of {role, content} objects")
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequest(
            f"'messages' has {len(messages)} messages, over the limit of {MAX_MESSAGES} "
            f"({MAX_MESSAGES - 1} turns of history and the last user message)"
        )
    turns: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequest(f"'messages[{i}]' must be an object with a 'role'")
        role = CHAT_ROLES.get(message["role"])
        if role is None:
            raise InvalidRequest(
                f"'messages[{i}].role' {message['role'][:40]!r} is not supported (system, "
                "developer, user, assistant; tools are not)"
            )
        turns.append({"role": role, "content": _content(message, i)})
    if turns[-1]["role"] != "user":
        raise InvalidRequest("the last message must be the user's")
    return tuple(turns[:-1]), turns[-1]["content"]


# Fields the engine cannot honour, and the values that ask nothing of it (null, or these): a
# request asking for more is refused, not answered as if it had not (and cached that way).
_NEUTRAL: dict[str, tuple[object, ...]] = {
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
    "tools": ((),),
    "functions": ((),),
    "tool_choice": ("none",),
    "function_call": ("none",),
    "parallel_tool_calls": (),
    "response_format": ({"type": "text"},),
    "logit_bias": ({},),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "audio": (),
    "modalities": ((), ("text",)),
    "prediction": (),
    # vLLM-style sampling fields the engine does not take (top_k it does: parse_request)
    "min_p": (0,),
    "repetition_penalty": (1,),
}


def _same(value: object, neutral: object) -> bool:
    """`value` is `neutral`: a number of either kind for a number (never a boolean), else the
    same type and value."""
    if isinstance(neutral, (int, float)) and not isinstance(neutral, bool):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value == neutral
    return type(value) is type(neutral) and value == neutral


# Fields read by `parse_request` (by route), and fields that change nothing of the answer
# (OpenAI's bookkeeping: stored completions, their tags, the service tier, the end-user and
# prompt-cache identifiers that replace `user`): accepted, ignored.
_READ_COMMON = frozenset(
    {"model", "n", "max_tokens", "stream", "stream_options", "user", "tiercache", "stop",
     "temperature", "top_p", "top_k", "seed"}
)  # fmt: skip
_READ_CHAT = _READ_COMMON | {"messages", "max_completion_tokens"}
_READ_COMPLETION = _READ_COMMON | {"prompt"}
_BOOKKEEPING = frozenset(
    {"store", "metadata", "service_tier", "safety_identifier", "prompt_cache_key",
     "prompt_cache_retention"}
)  # fmt: skip
_TIERCACHE_FIELDS = frozenset({"cache_control"})


def refuse_unknown(body: dict[str, Any], *, chat: bool) -> None:
    """InvalidRequest naming the first field this server does not know, at the top level or
    inside `tiercache` (a misspelt `cache_control` would otherwise be a request without it)."""
    known = _READ_CHAT if chat else _READ_COMPLETION
    for name in body:
        if name not in known and name not in _NEUTRAL and name not in _BOOKKEEPING:
            raise InvalidRequest(f"unrecognized request argument supplied: {name[:80]!r}")
    extra = body.get("tiercache")
    if isinstance(extra, dict):
        for name in extra:
            if name not in _TIERCACHE_FIELDS:
                raise InvalidRequest(f"unrecognized field in 'tiercache': {name[:80]!r}")


def refuse_unsupported(body: dict[str, Any]) -> None:
    """InvalidRequest naming the first field that asks for something this server does not do
    (log probabilities, tools, JSON mode, logit bias, penalties, echo, suffix, audio)."""
    for name in body:  # a request's few fields, not every name below
        neutral = _NEUTRAL.get(name)
        value = body[name]
        if neutral is None or value is None:
            continue
        if isinstance(value, list):
            value = tuple(value)
        if any(_same(value, ok) for ok in neutral):
            continue
        raise InvalidRequest(
            f"'{name}' is not supported by this server (only its default, or null, is accepted)"
        )


def parse_request(
    body: object, *, chat: bool, base_model: str, adapters: frozenset[str], cache_header: str | None
) -> Generation:
    """`body` (the request's JSON) as one generation; InvalidRequest naming the first problem,
    NotFound-like InvalidRequest for a model that is neither the base nor an adapter."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required (GET /v1/models lists them)")
    if model != base_model and model not in adapters:
        raise UnknownModel(model)
    n = body.get("n")  # null is the default, as for every optional field
    if n is not None and (type(n) is not int or n != 1):
        raise InvalidRequest("'n' must be 1: one completion per request")
    refuse_unknown(body, chat=chat)
    refuse_unsupported(body)
    history: tuple[dict[str, str], ...] = ()
    if chat:
        history, prompt = conversation(body.get("messages"))
        # both checked (a wrong max_tokens is an error even beside max_completion_tokens), the
        # newer name taken first
        legacy = _integer(body, "max_tokens", 1, 2**31 - 1)
        max_tokens = _integer(body, "max_completion_tokens", 1, 2**31 - 1)
        if max_tokens is None:
            max_tokens = legacy
    else:
        text = body.get("prompt")
        if not isinstance(text, str):
            raise InvalidRequest("'prompt' must be a string (lists of prompts are not supported)")
        prompt = text
        max_tokens = _integer(body, "max_tokens", 1, 2**31 - 1)
    stream = body.get("stream")
    stream = False if stream is None else stream
    if not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise InvalidRequest("'stream_options' must be an object")
        if not stream:
            raise InvalidRequest("'stream_options' is only allowed when 'stream' is true")
        asked = options.get("include_usage")
        if asked is not None and not isinstance(asked, bool):  # null: the default
            raise InvalidRequest("'stream_options.include_usage' must be a boolean")
        include_usage = bool(asked)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidRequest("'user' must be a string")
    extra = body.get("tiercache")
    extra = {} if extra is None else extra
    if not isinstance(extra, dict):
        raise InvalidRequest("'tiercache' must be an object")
    for i, word in enumerate(stop_words := _stop(body)):
        _utf8(f"stop[{i}]", word)
    cache_control = cache_control_words(cache_header, extra.get("cache_control"))
    return Generation(
        prompt=_utf8("messages" if chat else "prompt", prompt),
        history=history,
        model=model,
        lora_name=None if model == base_model else model,
        stream=stream,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 0.0, 1.0),
        top_k=_integer(body, "top_k", 0, 2**31 - 1),
        seed=_seed(body),
        stop_words=stop_words,
        cache_control=None if cache_control is None else _utf8("cache_control", cache_control),
        user=user,
        chat=chat,
        include_usage=include_usage,
    )


def parse_feedback(body: object) -> tuple[str, str]:
    """`POST /v1/feedback`'s body as (answer_id, verdict); InvalidRequest naming the problem."""
    if not isinstance(body, dict) or set(body) - {"answer_id", "verdict"}:
        raise InvalidRequest('the body must be {"answer_id": "...", "verdict": "good"|"bad"}')
    answer_id, verdict = body.get("answer_id"), body.get("verdict")
    if not isinstance(answer_id, str) or not answer_id:
        raise InvalidRequest("'answer_id' must be a non-empty string")
    if len(answer_id) > MAX_ANSWER_ID_CHARS:
        raise InvalidRequest(
            f"'answer_id' has {len(answer_id)} characters, over the limit of "
            f"{MAX_ANSWER_ID_CHARS}: not an answer id"
        )
    if verdict not in ("good", "bad"):
        raise InvalidRequest('\'verdict\' must be "good" or "bad"')
    return _utf8("answer_id", answer_id), verdict


class UnknownModel(InvalidRequest):
    """A `model` that is neither the base model nor an adapter (a 404, as OpenAI answers)."""

    def __init__(self, model: str) -> None:
        super().__init__(f"the model {model[:80]!r} does not exist (GET /v1/models lists them)")


@dataclass(slots=True)
class Outcome:
    """What the ensemble answered: the text, the cache status, a semantic hit's similarity and
    how the engine finished (None on a hit)."""

    text: str = ""
    cache_status: str = ""
    similarity: float | None = None
    finish_reason: str | None = None
    # The answer's token counts (a generation's own; a hit's stored generation's), and the
    # prompt tokens this request served from the engine's prefix KV cache, and its answer tokens
    # taken from verified drafts (speculative decoding; a generation only).
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int = 0
    speculated_tokens: int = 0
    answer_id: str | None = None  # for POST /v1/feedback (tiercache.exact.answer_ids)


OPENAI_FINISH_REASONS = frozenset({"stop", "length", "content_filter"})


def finish_reason(outcome: Outcome) -> str:
    """OpenAI's finish_reason: the engine's ("stop", "length", "content_filter"); a cached
    answer was complete when it was stored, so "stop", and so is any other reason (OpenAI's
    clients know only theirs)."""
    reason = outcome.finish_reason
    return reason if reason in OPENAI_FINISH_REASONS else "stop"


def tiercache_field(outcome: Outcome) -> dict[str, Any]:
    """The documented extra field of every response and final chunk."""
    extra: dict[str, Any] = {"cache_status": outcome.cache_status}
    if outcome.similarity is not None:
        extra["similarity"] = round(outcome.similarity, 6)
    if outcome.answer_id is not None:
        extra["answer_id"] = outcome.answer_id
    return extra


def usage(outcome: Outcome) -> dict[str, Any] | None:
    """OpenAI's usage object; None when the ensemble reported no token counts (a padded
    tenant's answers carry none)."""
    if outcome.prompt_tokens is None or outcome.completion_tokens is None:
        return None
    return {
        "prompt_tokens": outcome.prompt_tokens,
        "completion_tokens": outcome.completion_tokens,
        "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens},
        # OpenAI's field for answer tokens confirmed from a prediction: here, from the drafts
        # speculative decoding verified (docs/speculation.md).
        "completion_tokens_details": {"accepted_prediction_tokens": outcome.speculated_tokens},
    }


def usage_chunk(gen: Generation, outcome: Outcome) -> dict[str, Any]:
    """A stream's last chunk when `stream_options.include_usage` asked for it: no choices, the
    usage (null when unknown), as OpenAI sends it."""
    out = chunk(gen, "")
    out["choices"] = []
    out["usage"] = usage(outcome)
    return out


def completion(gen: Generation, outcome: Outcome) -> dict[str, Any]:
    """The non-streamed response object."""
    if gen.chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": outcome.text},
            "finish_reason": finish_reason(outcome),
            "logprobs": None,
        }
        kind = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": outcome.text,
            "finish_reason": finish_reason(outcome),
            "logprobs": None,
        }
        kind = "text_completion"
    return {
        "id": ("chatcmpl-" if gen.chat else "cmpl-") + gen.id,
        "object": kind,
        "created": gen.created,
        "model": gen.model,
        "choices": [choice],
        "usage": usage(outcome),
        "tiercache": tiercache_field(outcome),
    }


def chunk(gen: Generation, text: str, final: Outcome | None = None) -> dict[str, Any]:
    """One streamed chunk: `text` as a delta; with `final`, the finish reason and the extra
    field."""
    finish = None if final is None else finish_reason(final)
    if gen.chat:
        delta: dict[str, Any] = {"content": text} if text else {}
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        kind = "text_completion"
    out: dict[str, Any] = {
        "id": ("chatcmpl-" if gen.chat else "cmpl-") + gen.id,
        "object": kind,
        "created": gen.created,
        "model": gen.model,
        "choices": [choice],
    }
    if gen.include_usage:
        out["usage"] = None  # OpenAI's: every chunk but the usage chunk carries a null usage
    if final is not None:
        out["tiercache"] = tiercache_field(final)
    return out


def first_chunk(gen: Generation) -> dict[str, Any]:
    """A chat stream's first chunk: the assistant role, as OpenAI sends it."""
    out = chunk(gen, "")
    if gen.chat:
        out["choices"][0]["delta"] = {"role": "assistant", "content": ""}
    return out


def error_body(message: str, kind: str, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}
