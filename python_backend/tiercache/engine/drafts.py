"""Draft tokens for speculative decoding: guesses of what the model generates next, taken from
token sequences the request already has at hand (cached answers in its own scope, its prompt).

The engine verifies a draft in one forward pass and keeps only the prefix the model itself would
have produced (tiercache.engine.torch_engine), so a draft never changes the output, only how
many forward passes it takes. Pure Python, no torch: the sources are lists of token ids.

Two ways a sequence proposes a continuation of the tokens generated so far:
- aligned: a cached answer to the same prompt starts where the generation starts; while the
  generated tokens are that answer's prefix, its next tokens are the draft (an answer cached
  under a smaller `max_tokens`, or another stop set, is the case this serves);
- n-gram: the longest suffix of the context (prompt and generated tokens, `min_ngram` to
  `max_ngram` tokens) that occurs in a sequence proposes what followed its latest occurrence
  there (prompt lookup decoding; a neighbour's answer that says the same in other words).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

DEFAULT_DRAFT_TOKENS = 8
MAX_DRAFT_TOKENS = 32
MIN_DRAFT_TOKENS = 2


@dataclass(slots=True)
class _Indexed:
    """One source sequence and, per n-gram length, where each n-gram last ends in it."""

    tokens: list[int]
    aligned: bool  # whether the sequence starts where the generation starts
    ends: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)


class Drafter:
    """Proposes draft tokens from `answers` (cached answers to this prompt or its neighbours,
    aligned with the generation's start when `aligned_answers`) and `prompt` (the prompt's own
    tokens, matched by n-gram only). The draft length adapts to how much of the last draft the
    model accepted (`accepted`)."""

    def __init__(
        self,
        answers: Sequence[Sequence[int]] = (),
        prompt: Sequence[int] = (),
        *,
        aligned_answers: bool = True,
        min_ngram: int = 2,
        max_ngram: int = 4,
        length: int = DEFAULT_DRAFT_TOKENS,
    ) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self._min_ngram, self._max_ngram = min_ngram, max_ngram
        self._sources = [_Indexed(list(a), aligned_answers) for a in answers if a]
        if prompt:
            self._sources.append(_Indexed(list(prompt), False))
        for source in self._sources:
            self._index(source)
        self.length = max(MIN_DRAFT_TOKENS, min(length, MAX_DRAFT_TOKENS))
        self.proposed = self.accepted_total = self.steps = 0

    @property
    def empty(self) -> bool:
        return not self._sources

    def _index(self, source: _Indexed) -> None:
        tokens = source.tokens
        for n in range(self._min_ngram, self._max_ngram + 1):
            ends: dict[tuple[int, ...], int] = {}
            for end in range(n, len(tokens)):  # an n-gram with at least one token after it
                ends[tuple(tokens[end - n : end])] = end
            source.ends[n] = ends

    def propose(self, context: Sequence[int], generated: Sequence[int], limit: int) -> list[int]:
        """At most `min(limit, self.length)` draft tokens to follow `context` (the prompt's
        tokens and then `generated`, which ends with the token just picked): the longest
        continuation any source offers, aligned sources first on ties; [] when none does."""
        want = min(limit, self.length)
        if want <= 0 or not self._sources:
            return []
        best: list[int] = []
        g = len(generated)
        for source in self._sources:
            tokens = source.tokens
            if source.aligned and g < len(tokens) and tokens[:g] == list(generated):
                draft = tokens[g : g + want]
            else:
                draft = self._ngram(source, context, want)
            if len(draft) > len(best):
                best = draft
                if len(best) == want:
                    break
        return best

    def _ngram(self, source: _Indexed, context: Sequence[int], want: int) -> list[int]:
        for n in range(min(self._max_ngram, len(context)), self._min_ngram - 1, -1):
            end = source.ends[n].get(tuple(context[-n:]))
            if end is not None:
                return source.tokens[end : end + want]
        return []

    def accepted(self, proposed: int, accepted: int) -> None:
        """The model kept `accepted` of `proposed` draft tokens: a fully accepted draft doubles
        the next one's length (up to MAX_DRAFT_TOKENS), a partly accepted one sets it to what
        was kept plus one (at least MIN_DRAFT_TOKENS)."""
        if proposed <= 0:
            return
        self.steps += 1
        self.proposed += proposed
        self.accepted_total += accepted
        if accepted == proposed:
            self.length = min(self.length * 2, MAX_DRAFT_TOKENS)
        else:
            self.length = max(accepted + 1, MIN_DRAFT_TOKENS)
