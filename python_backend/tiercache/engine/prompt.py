"""A request's prompt as the model reads it: the one place the chat template is applied.

Both engines (the CPU one, `tiercache.engine.torch_engine`, and the TensorRT-LLM client) tokenize
through `prompt_token_ids`, so a conversation is templated exactly once, in the engine, whatever
the caller sent: structured turns (`history` plus the last user turn in `prompt`), or a prompt
already rendered (`raw_prompt`), which is tokenized as it is.
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


def prompt_token_ids(tokenizer: Any, request: GenerationRequest) -> list[int]:
    """The model's input ids for `request`: the chat template over `chat_messages` with the
    generation prompt, or, for a raw prompt, the tokenizer on the text alone. InvalidRequest
    when the model's template refuses the conversation (some allow a system turn only first,
    or insist that roles alternate)."""
    if request.raw_prompt:
        ids: Any = tokenizer(request.prompt)["input_ids"]
    else:
        from jinja2.exceptions import TemplateError  # transformers' template engine

        try:
            encoded = tokenizer.apply_chat_template(
                chat_messages(request), add_generation_prompt=True, return_dict=True
            )
        except TemplateError as exc:
            raise InvalidRequest(
                f"the model's chat template refuses this conversation: {exc}"
            ) from None
        ids = encoded["input_ids"]
    if ids and isinstance(ids[0], list):  # a batch of one
        ids = ids[0]
    return [int(t) for t in ids]
