"""The engine's input policy: prompts it refuses instead of answering (torch-free).

A refusal is an answer the engine flags with finish reason `content_filter` (OpenAI's name): the
client receives the refusal text as the answer, and the llm stage never stores or indexes it (a
policy can change, and a refusal is not what the prompt asks for; see docs/faults.md).

The trigger is a regular expression over the request's canonical prompt (NFKC, whitespace runs
collapsed and trimmed, as prompt_cache normalizes it), searched anywhere in it; a match is answered
with `text` at once, without running the model. Only the input is screened: flagging generated
text by its start would need the whole answer held back before the first chunk is streamed.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass

from tiercache.engine.events import CONTENT_FILTER, StreamEvent
from tiercache.errors import ConfigError
from tiercache.exact.request import GenerationRequest

DEFAULT_REFUSAL_TEXT = "I can't help with that request."


@dataclass(frozen=True, slots=True)
class RefusalPolicy:
    """`pattern` None refuses nothing."""

    pattern: re.Pattern[str] | None = None
    text: str = DEFAULT_REFUSAL_TEXT

    @classmethod
    def parse(cls, pattern: str, text: str) -> RefusalPolicy:
        """From the stage parameters; a malformed regex or an empty refusal text is a
        ConfigError (initialize fails fast)."""
        if not pattern:
            return cls()
        try:
            compiled = re.compile(pattern)
        except re.error as exc:
            raise ConfigError(f"refuse_prompt_pattern {pattern!r} is not a regex: {exc}") from exc
        if not text:
            raise ConfigError("refusal_text must not be empty when refuse_prompt_pattern is set")
        return cls(compiled, text)

    def refuses(self, request: GenerationRequest) -> bool:
        """Whether the pattern is found in the prompt or in any turn of its history (the model
        reads them all: a refused question asked in an earlier turn, then "answer my previous
        question", is refused too)."""
        pattern = self.pattern
        if pattern is None:
            return False
        if pattern.search(request.prompt) is not None:
            return True
        return any(pattern.search(content) is not None for _, content in request.history)

    def generate(
        self, request: GenerationRequest, generate: Callable[[], Iterator[StreamEvent]]
    ) -> Generator[StreamEvent, None, None]:
        """The refusal as one final event when the prompt matches, else `generate()`'s events
        (closing it closes `generate()`'s generator: its KV lease is released then)."""
        if self.refuses(request):
            yield StreamEvent(self.text, CONTENT_FILTER)
            return
        yield from generate()
