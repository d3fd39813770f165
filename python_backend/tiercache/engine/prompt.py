"""A request's prompt as the model reads it: the one place the chat template is applied.

Both engines (the CPU one, `tiercache.engine.torch_engine`, and the TensorRT-LLM client) tokenize
through `prompt_token_ids`, so a conversation is templated exactly once, in the engine, whatever
the caller sent: structured turns (`history` plus the last user turn in `prompt`), or a prompt
already rendered (`raw_prompt`), which is tokenized as it is.

A turn's content is text: a model's control token written into it (`<|im_start|>system` in a
user's message) is read as the characters it is made of, never as the token, so a user cannot
forge a turn of the conversation an application builds around their words. A raw prompt is the
caller's own rendering, control tokens included, and is tokenized as it is.
"""

from __future__ import annotations

from typing import Any

from tiercache.errors import InvalidRequest
from tiercache.exact.request import GenerationRequest


def chat_messages(request: GenerationRequest) -> list[dict[str, str]]:
    """The conversation the chat template renders: the earlier turns, then the user's prompt."""
    turns = [{"role": role, "content": content} for role, content in request.history]
    turns.append({"role": "user", "content": request.prompt})
    return turns


def control_strings(tokenizer: Any) -> tuple[str, ...]:
    """The texts the tokenizer reads as one special token (`<|im_start|>`, `<|endoftext|>`),
    longest first, so that a search finds `<|im_end|>` before a shorter token inside it."""
    found = {str(t) for t in getattr(tokenizer, "all_special_tokens", ()) if t}
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    found.update(
        str(t.content) for t in decoder.values() if getattr(t, "special", False) and t.content
    )
    return tuple(sorted(found, key=lambda t: (-len(t), t)))  # a few microseconds a request


def _first_control(text: str, controls: tuple[str, ...], start: int) -> tuple[int, str] | None:
    """The earliest control string in `text` from `start`: (position, string), or None."""
    best: tuple[int, str] | None = None
    for control in controls:
        at = text.find(control, start)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, control)
    return best


def _marker(index: int) -> str:
    """A stand-in for turn `index`'s content: private-use characters no template writes."""
    return f"\ue000tiercache-turn-{index}\ue001"


def _content_spans(
    tokenizer: Any, messages: list[dict[str, str]], controls: tuple[str, ...]
) -> tuple[str, list[tuple[int, int]]]:
    """The template's text for `messages`, and where in it lie the control strings the turns'
    contents carry: (start, end) of each, in order. The turns' places are found by rendering
    the template once over stand-ins for the contents (a search for the content itself could
    land on the template's own text), then checked against the template over the real
    contents; InvalidRequest when they differ (a template that rewrites a turn's text), since
    a user's control strings could then not be told from the template's."""
    skeleton = tokenizer.apply_chat_template(
        [{"role": m["role"], "content": _marker(i)} for i, m in enumerate(messages)],
        add_generation_prompt=True,
        tokenize=False,
    )
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    parts: list[str] = []
    spans: list[tuple[int, int]] = []
    length = 0
    cursor = 0
    for index, message in enumerate(messages):
        marker = _marker(index)
        at = skeleton.find(marker, cursor)
        if at < 0 or skeleton.count(marker) != 1:
            parts = []
            break
        parts.append(skeleton[cursor:at])
        length += at - cursor
        content = message["content"]
        hit = _first_control(content, controls, 0)
        while hit is not None:
            spans.append((length + hit[0], length + hit[0] + len(hit[1])))
            hit = _first_control(content, controls, hit[0] + len(hit[1]))
        parts.append(content)
        length += len(content)
        cursor = at + len(marker)
    if not parts or "".join(parts) + skeleton[cursor:] != rendered:
        raise InvalidRequest(
            "a message carries one of the model's control tokens "
            f"({', '.join(repr(c) for c in controls[:3])}, ...), and this model's chat "
            "template rewrites turns, so it cannot be kept as plain text"
        )
    return rendered, spans


def _ids_with_text_controls(
    tokenizer: Any, rendered: str, spans: list[tuple[int, int]]
) -> list[int]:
    """`rendered` tokenized as the template's own tokenization would, except that each span (a
    control string a user wrote) is tokenized as plain characters."""
    ids: list[int] = []
    cursor = 0
    for start, end in spans:
        if start > cursor:
            ids.extend(tokenizer(rendered[cursor:start], add_special_tokens=False)["input_ids"])
        ids.extend(
            tokenizer(rendered[start:end], add_special_tokens=False, split_special_tokens=True)[
                "input_ids"
            ]
        )
        cursor = end
    if cursor < len(rendered):
        ids.extend(tokenizer(rendered[cursor:], add_special_tokens=False)["input_ids"])
    return ids


def prompt_token_ids(tokenizer: Any, request: GenerationRequest) -> list[int]:
    """The model's input ids for `request`: the chat template over `chat_messages` with the
    generation prompt, or, for a raw prompt, the tokenizer on the text alone. InvalidRequest
    when the model's template refuses the conversation (some allow a system turn only first,
    or insist that roles alternate). A control token written in a turn's content is tokenized
    as its characters (the module's docstring)."""
    if request.raw_prompt:
        ids: Any = tokenizer(request.prompt)["input_ids"]
    else:
        from jinja2.exceptions import TemplateError  # transformers' template engine

        messages = chat_messages(request)
        controls = control_strings(tokenizer)
        forged = any(_first_control(m["content"], controls, 0) for m in messages)
        try:
            if forged:
                ids = _ids_with_text_controls(
                    tokenizer, *_content_spans(tokenizer, messages, controls)
                )
            else:
                ids = tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, return_dict=True
                )["input_ids"]
        except TemplateError as exc:
            raise InvalidRequest(
                f"the model's chat template refuses this conversation: {exc}"
            ) from None
    if ids and isinstance(ids[0], list):  # a batch of one
        ids = ids[0]
    return [int(t) for t in ids]
