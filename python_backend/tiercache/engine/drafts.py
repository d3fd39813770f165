"""Draft tokens for speculative decoding: guesses of what the model generates next, taken from
token sequences the request already has at hand, all in its own scope (tenant, adapter, model).

The engine verifies a draft in one forward pass and keeps only the prefix the model itself would
have produced (tiercache.engine.torch_engine), so a draft never changes the output, only how
many forward passes it takes. Pure Python, no torch: the sources are lists of token ids.

The sources (tiercache.vocabulary.DraftSource):
- `answer`: the answer cached for the same prompt under other `max_tokens` or stop words (llm
  reads it under the prompt's draft digest);
- `neighbour`: the answers of the prompt's nearest semantic neighbours, including those the
  guard refused to serve (embedding_cache names them, llm reads them);
- `index`: the engine's recent answers in the request's scope (`AnswerIndex`);
- `context`: the prompt and the tokens generated so far (prompt lookup; a loop in the output).

Three ways a sequence proposes a continuation of the tokens generated so far:
- aligned (answer, neighbour, verify): while the generated tokens are the cached answer's
  prefix, its next tokens are the draft;
- text-aligned (the same, given the answer's text and the tokenizer, `Codec`): while the
  generated text is a prefix of the answer's text, the rest of that text, tokenized, is the
  draft. A text does not always tokenize back to the ids it was generated as (SmolLM2 generates
  a paragraph break as one token, "\n\n", and its tokenizer encodes it as two), so the model
  leaves the token-aligned draft there while still writing the same text;
- n-gram (every source): the longest suffix of the context (`min_ngram` to `max_ngram` tokens)
  that occurs in a sequence proposes what followed its latest occurrence there.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from tiercache.vocabulary import DraftSource

DEFAULT_DRAFT_TOKENS = 8
MAX_DRAFT_TOKENS = 32
MIN_DRAFT_TOKENS = 4
MIN_NGRAM, MAX_NGRAM = 2, 4
# A cached answer's n-grams draft once the generation has left its alignment: from 3 tokens
# (2-token matches there were mostly rejected: 0 to +3.5 % on `again`, held-out prompts
# included, in tiercache_dev.bench.draft_replay, docs/speculation.md "Replayed").
MIN_ANSWER_NGRAM = 3
# Other prompts' answers share short n-grams by chance: the index matches 3 tokens or more.
MIN_INDEX_NGRAM = 3
# After a draft the model rejected whole, n-gram drafting pauses for 1, 2, 4 ... steps (up to
# this many): on text nothing predicts, a verification costs more than the step it replaces.
MAX_BACKOFF_STEPS = 16
# The engine's answer index over all scopes, in tokens (about 0.5 KB of memory each).
DEFAULT_INDEX_TOKENS = 16_384
# The most tokens of a cached answer verified in the prefill pass: the pass keeps a row of
# logits per token (0.2 MB each with SmolLM2's vocabulary), and a draft the model leaves early
# costs the pass its length; past these, aligned drafts go on in steps.
MAX_PREFILL_DRAFT_TOKENS = 256


def _ngram_ends(tokens: Sequence[int], start: int, stop: int, ends: dict) -> None:
    """Record, per n-gram length, that the n-gram ending at each position in [start, stop) ends
    there (a later occurrence replaces an earlier one)."""
    for n in range(MIN_NGRAM, MAX_NGRAM + 1):
        table = ends.setdefault(n, {})
        for end in range(max(start, n), stop):
            table[tuple(tokens[end - n : end])] = end


@dataclass(frozen=True, slots=True)
class Codec:
    """The engine's tokenizer, for text-aligned drafts: `decode` token ids to text, `encode` a
    text to token ids (no special tokens)."""

    decode: Callable[[Sequence[int]], str]
    encode: Callable[[str], list[int]]


@dataclass(slots=True)
class _Answer:
    """A cached answer as a draft source: aligned with the generation's start, and indexed."""

    source: str
    tokens: list[int]
    text: str = ""  # its text, for text-aligned drafts ("" without)
    ends: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _ngram_ends(self.tokens, 0, len(self.tokens), self.ends)  # each with a token after it


def prefill_draft(
    answers: Iterable[tuple[str, Sequence[int]]], greedy: bool
) -> tuple[str, list[int]]:
    """The draft to verify in the prompt's prefill pass, as (source, token ids): one forward
    pass over the prompt and the draft instead of drafts of at most MAX_DRAFT_TOKENS after it.
    A semantic hit's answer to verify (`verify`), else, for a greedy request, the same prompt's
    answer cached under other `max_tokens` or stop words (`answer`: llm keeps only greedy answers
    there, so the model generates it again as far as its text tokenizes back to the ids it was
    generated as); ("", []) when there is neither. Its first MAX_PREFILL_DRAFT_TOKENS only (the
    Drafter's aligned drafts go on past them). A sampled request's draws would leave a greedy
    answer early, and a draft rejected early in the prefill pass costs the pass its length."""
    sources = [DraftSource.VERIFY.value] + ([DraftSource.ANSWER.value] if greedy else [])
    for wanted in sources:
        for source, tokens in answers:
            if source == wanted and tokens:
                return source, list(tokens[:MAX_PREFILL_DRAFT_TOKENS])
    return "", []


def cut_at_stop(text: str, stop_words: Sequence[str]) -> str:
    """A cached answer as a draft for a request with `stop_words`: up to the end of the first
    stop word in it (the answer ends there; tokens past it would be verified for nothing)."""
    ends = [i + len(w) for w in stop_words if w and (i := text.find(w)) >= 0]
    return text[: min(ends)] if ends else text


@dataclass(slots=True)
class SourceStats:
    """One draft source's counts in a request, and its own adaptive draft length and pause."""

    drafts: int = 0  # verification steps that checked this source's draft
    proposed: int = 0
    accepted: int = 0
    length: int = DEFAULT_DRAFT_TOKENS
    backoff: int = 0  # steps this source still sits out
    rejections: int = 0  # its drafts in a row the model rejected whole


class Drafter:
    """Proposes one request's draft tokens from its cached `answers` ((source, token ids)), its
    context (the prompt's tokens, then what is generated) and an `index` of recent answers in
    its scope.

    Each source has its own draft length and pause: on this engine a forward pass over 2 to 12
    tokens costs about 1.8 single-token passes (docs/speculation.md), so a draft pays only when
    about one of its tokens is kept; a source whose draft the model rejected whole sits out 1,
    2, 4 ... steps (MAX_BACKOFF_STEPS at most), and a draft is never shorter than
    MIN_DRAFT_TOKENS (longer ones cost next to nothing more)."""

    def __init__(
        self,
        answers: Iterable[tuple[str, Sequence[int]]] = (),
        prompt: Sequence[int] = (),
        *,
        index: ScopeIndex | None = None,
        length: int = DEFAULT_DRAFT_TOKENS,
        texts: Sequence[str] = (),
        codec: Codec | None = None,
    ) -> None:
        """`texts`: the answers' texts, in their order (with `codec`: text-aligned drafts)."""
        listed = list(answers)
        named = list(texts) if codec is not None else []
        named += [""] * (len(listed) - len(named))
        self._answers = [
            _Answer(source, list(tokens), text)
            for (source, tokens), text in zip(listed, named, strict=False)
            if tokens
        ]
        self._codec = codec
        self._text: tuple[int, str] | None = None  # (generated tokens, their decoded text)
        self._index = index
        self._context: list[int] = list(prompt)  # the prompt, then the generated tokens
        self._prompt_len = len(self._context)
        self._context_ends: dict[int, dict[tuple[int, ...], int]] = {}
        self._indexed = 0  # context positions whose n-grams ending there are recorded
        self._length = max(MIN_DRAFT_TOKENS, min(length, MAX_DRAFT_TOKENS))
        self.source: str | None = None  # the last proposed draft's
        self.by_source: dict[str, SourceStats] = {}
        self.steps: list[tuple[str, int, int]] = []  # (source, proposed, accepted) per step

    @property
    def proposed(self) -> int:
        return sum(s.proposed for s in self.by_source.values())

    @property
    def accepted_total(self) -> int:
        return sum(s.accepted for s in self.by_source.values())

    def _state(self, source: str) -> SourceStats:
        state = self.by_source.get(source)
        if state is None:
            state = self.by_source[source] = SourceStats(length=self._length)
        return state

    def propose(self, generated: Sequence[int], limit: int) -> list[int]:
        """Draft tokens to follow the prompt and `generated` (which ends with the token just
        picked, and only grows), at most `limit`: the longest continuation a source not sitting
        out offers, each source capped at its own length (on ties: answer, neighbour, index,
        context); [] when none does."""
        self._context.extend(generated[len(self._context) - self._prompt_len :])
        self.source = None
        for state in self.by_source.values():
            state.backoff = max(0, state.backoff - 1)
        if limit <= 0:
            return []
        best: list[int] = []
        g = len(generated)
        for answer in self._answers:  # aligned first: a long match is strong evidence
            state = self._state(answer.source)
            if state.backoff:
                continue
            want = min(limit, state.length)
            if g < len(answer.tokens) and answer.tokens[:g] == list(generated):
                draft = answer.tokens[g : g + want]
            else:
                draft = self._text_aligned(answer, generated)[:want]
            if not draft:
                draft = _ngram(answer.ends, answer.tokens, self._context, want, MIN_ANSWER_NGRAM)
            if len(draft) > len(best):
                best, self.source = draft, answer.source
        index = self._state(DraftSource.INDEX.value) if self._index is not None else None
        if self._index is not None and index is not None and not index.backoff:
            draft = self._index.continuation(self._context, min(limit, index.length))
            if len(draft) > len(best):
                best, self.source = draft, DraftSource.INDEX.value
        context = self._state(DraftSource.CONTEXT.value)
        if not context.backoff:
            draft = self._from_context(min(limit, context.length))
            if len(draft) > len(best):
                best, self.source = draft, DraftSource.CONTEXT.value
        return best

    def _text_aligned(self, answer: _Answer, generated: Sequence[int]) -> list[int]:
        """The rest of `answer`'s text after the generated text, tokenized, while the generated
        text is a proper prefix of it; [] otherwise (then for good: the text only grows)."""
        if self._codec is None or not answer.text:
            return []
        g = len(generated)
        if self._text is None or self._text[0] != g:
            self._text = (g, self._codec.decode(generated))
        done = self._text[1]
        if len(done) >= len(answer.text) or not answer.text.startswith(done):
            # a decoded text can end inside a character (U+FFFD) and match again later
            if not done.endswith("\ufffd"):
                answer.text = ""
            return []
        return self._codec.encode(answer.text[len(done) :])

    def _from_context(self, want: int) -> list[int]:
        """Prompt lookup over the context itself: what followed the latest earlier occurrence
        of its suffix, continued periodically past the end (a repeating run keeps repeating)."""
        context = self._context
        end = len(context)
        _ngram_ends(context, self._indexed, end, self._context_ends)  # ends before `end` only
        self._indexed = end
        for n in range(min(MAX_NGRAM, end - 1), MIN_NGRAM - 1, -1):
            found = self._context_ends.get(n, {}).get(tuple(context[end - n :]))
            if found is None or found >= end:
                continue
            period = end - found
            return [context[found + i % period] for i in range(want)]
        return []

    def accepted(self, proposed: int, accepted: int) -> None:
        """The model kept `accepted` of the `proposed` tokens of the last draft. For its source:
        a fully accepted draft doubles the next one's length (up to MAX_DRAFT_TOKENS), a partly
        accepted one sets it to what was kept plus one (at least MIN_DRAFT_TOKENS); one
        rejected whole sets the source out for 1, 2, 4 ... steps."""
        if proposed <= 0:
            return
        source = self.source or DraftSource.CONTEXT.value
        state = self._state(source)
        state.drafts += 1
        state.proposed += proposed
        state.accepted += accepted
        self.steps.append((source, proposed, accepted))
        if accepted == proposed:
            state.length = min(state.length * 2, MAX_DRAFT_TOKENS)
        else:  # (a verify draft is longer than any other: never past the cap after it)
            state.length = min(max(accepted + 1, MIN_DRAFT_TOKENS), MAX_DRAFT_TOKENS)
        if accepted == 0:
            state.rejections += 1
            # the steps counted from the next proposal on (propose counts one down first)
            state.backoff = min(2 ** (state.rejections - 1), MAX_BACKOFF_STEPS) + 1
        else:
            state.rejections = 0

    def unused(self, count: int) -> None:
        """Of the last draft's accepted tokens, `count` were not taken into the answer (it
        ended first: an end token, a stop word, max_tokens): they are not counted as kept (the
        length and back-off stay as the model's agreement set them)."""
        if count <= 0 or not self.steps:
            return
        source, proposed, accepted = self.steps[-1]
        count = min(count, accepted)
        self.steps[-1] = (source, proposed, accepted - count)
        self.by_source[source].accepted -= count


def _ngram(
    ends: dict[int, dict[tuple[int, ...], int]],
    tokens: Sequence[int],
    context: Sequence[int],
    want: int,
    min_ngram: int,
) -> list[int]:
    """What followed the latest occurrence in `tokens` of the longest suffix of `context`
    (`min_ngram` to MAX_NGRAM tokens) that occurs there, at most `want` tokens."""
    for n in range(min(MAX_NGRAM, len(context)), min_ngram - 1, -1):
        end = ends.get(n, {}).get(tuple(context[-n:]))
        if end is not None:
            return list(tokens[end : end + want])
    return []


class ScopeIndex:
    """One scope's recent answers, n-gram indexed (a part of `AnswerIndex`)."""

    def __init__(self) -> None:
        self.answers: list[tuple[int, ...]] = []
        self.tokens = 0
        self._ends: dict[int, dict[tuple[int, ...], tuple[int, int]]] = {}

    def add(self, tokens: tuple[int, ...]) -> None:
        self.answers.append(tokens)
        self.tokens += len(tokens)
        self._record(len(self.answers) - 1)

    def drop_oldest(self, count: int) -> int:
        """Forget the `count` oldest answers (one re-index); the tokens dropped."""
        gone, self.answers = self.answers[:count], self.answers[count:]
        dropped = sum(len(a) for a in gone)
        self.tokens -= dropped
        self._ends = {}
        for i in range(len(self.answers)):
            self._record(i)
        return dropped

    def _record(self, i: int) -> None:
        tokens = self.answers[i]
        for n in range(MIN_INDEX_NGRAM, MAX_NGRAM + 1):
            table = self._ends.setdefault(n, {})
            for end in range(n, len(tokens)):
                table[tokens[end - n : end]] = (i, end)

    def continuation(self, context: Sequence[int], want: int) -> list[int]:
        """What followed the latest occurrence of the context's longest suffix (MIN_INDEX_NGRAM
        to MAX_NGRAM tokens) in the scope's answers."""
        for n in range(min(MAX_NGRAM, len(context)), MIN_INDEX_NGRAM - 1, -1):
            found = self._ends.get(n, {}).get(tuple(context[-n:]))
            if found is not None:
                i, end = found
                return list(self.answers[i][end : end + want])
        return []


class AnswerIndex:
    """The engine's recent answers per scope (model revision, tenant scope, adapter: the KV
    pool's salt), as a draft source for later requests in the same scope only. Bounded by
    `max_tokens` over all scopes: the least recently used scope's oldest answer goes first. It
    lives with the engine's process, like the KV pool (an invalidation does not reach it: a
    stale draft costs a rejected verification, never a wrong token)."""

    def __init__(self, max_tokens: int = DEFAULT_INDEX_TOKENS) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self._scopes: OrderedDict[bytes, ScopeIndex] = OrderedDict()
        self.tokens = 0

    def add(self, scope: bytes, tokens: Sequence[int]) -> None:
        """Keep one answer's tokens in `scope` (not when over the whole budget, nor again when
        the scope already holds it)."""
        answer = tuple(tokens)
        if not answer or len(answer) > self.max_tokens:
            return
        index = self._scopes.get(scope)
        if index is None:
            index = self._scopes[scope] = ScopeIndex()
        elif answer in index.answers:
            self._scopes.move_to_end(scope)
            return
        self._scopes.move_to_end(scope)
        index.add(answer)
        self.tokens += len(answer)
        if self.tokens <= self.max_tokens:
            return
        # Over budget: down to three quarters of it, least recently used scopes' oldest answers
        # first, each scope re-indexed once.
        target = self.max_tokens * 3 // 4
        while self.tokens > target:
            scope_key, oldest = next(iter(self._scopes.items()))
            excess, count = self.tokens - target, 0
            while count < len(oldest.answers) and excess > 0:
                excess -= len(oldest.answers[count])
                count += 1
            self.tokens -= oldest.drop_oldest(count)
            if not oldest.answers:
                del self._scopes[scope_key]

    def view(self, scope: bytes) -> ScopeIndex | None:
        index = self._scopes.get(scope)
        if index is not None:
            self._scopes.move_to_end(scope)
        return index

    def scopes(self) -> int:
        return len(self._scopes)
