"""What an engine streams back, shared by the engine and the llm stage (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

CONTENT_FILTER = "content_filter"  # the engine refused: answered with its refusal, never cached
FINISH_REASONS = ("stop", "length", "cancelled", CONTENT_FILTER)


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """One step of a generation: new text (may be empty) and, on the last event, why it ended."""

    text: str
    finish_reason: str | None = None  # one of FINISH_REASONS on the last event
    generated_tokens: int = 0
    prompt_tokens: int = 0
    # Prompt tokens served from the engine's prefix KV pool and computed (they add up to
    # prompt_tokens); 0 and 0 from engines that do not report them.
    reused_tokens: int = 0
    computed_tokens: int = 0
    # Speculative decoding so far: draft tokens verified, and of those, kept (each kept one is
    # a forward pass saved, less the verification's extra cost); 0 and 0 when not speculated.
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    # On the last event of a speculated generation: (draft source, proposed, accepted) per
    # verification step (tiercache.engine.drafts), for the engine's metrics.
    draft_steps: tuple[tuple[str, int, int], ...] = ()
    # On the last event: the answer's mean token log-probability under the model (each picked
    # token's, its end included, at temperature 1); None when the engine does not report it (a
    # refusal, TensorRT-LLM). exp() of it is the answer's confidence (tiercache.confidence).
    mean_logprob: float | None = None
    # On the last event: the seconds the engine spent on this request, from when its worker took
    # it up (adapter switch, prefill, decoding), not counting the wait behind earlier requests;
    # None when the engine does not report it (TensorRT-LLM's path). An answer's cost is this.
    engine_s: float | None = None
    # On the last event: the answer's token ids (its end token not included); empty from
    # engines that do not report them (TensorRT-LLM's path).
    token_ids: tuple[int, ...] = ()
