"""Pairwise features for the semantic hit guard: general linguistic signals, no learned word lists.

A semantic cache finds a cached prompt whose embedding is close to the query's; cosine alone
cannot tell "Top 5 movies of 2020" from "Top 10 movies of 2020" (cosine 0.98 with MiniLM). These
features describe what differs between the two texts, so the guard (`tiercache.semantic.guard`)
can reject close-but-different candidates: a small logistic model over the vector, plus vetoes on
the clear-cut signals.

Contract:
- Pure and deterministic: a text is profiled once (`profile`, memoized) and a pair of profiles
  plus the cosine gives a fixed-length float vector in the order of `FEATURE_NAMES`.
- The memo is kept per scope (`memo_scope`, which the semantic stage opens around each
  search): a profile memoized in one tenant's lookups is never reused by another's, so the
  time a lookup takes (a memoized text saves about 20 us) tells nobody which texts another
  tenant looked up.
- Symmetric: swapping query and candidate gives the same vector.
- Only general English resources: a short function-word list, negation words, number words,
  auxiliaries and a few prepositions, a crude suffix stemmer. No word list was tuned on
  evaluation rows.
- Texts should already be normalized the way the cache keys them (`tiercache.exact.request
  .normalize_text`); `profile` lowercases and unifies apostrophes for its own use.
- Cost: about 20 us to profile a text (memoized) and 12 us per pair of profiles
  (`make bench-semantic`).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from decimal import Decimal
from functools import lru_cache

FEATURE_NAMES: tuple[str, ...] = (
    "cosine",
    "number_mismatch",
    "negation_mismatch",
    "entity_mismatch",
    "length_ratio",
    "role_swap",
)
"""The feature vector's layout; `guard_model.json` stores the same tuple and is checked against it.

- cosine: the embedding cosine, as given.
- number_mismatch: 0 when the multisets of numbers agree; 0.5 when one side has a number the
  other lacks ("top 10 movies" / "top movies"); 1 when both do, a substitution ("top 5" /
  "top 10"), and when the same numbers come in another order ("2^10" / "10^2", "1/4" /
  "4/1"). Numbers: digits (5, 2,000, 3.5, 2nd, 2GB), with a sign ("-40") or a leading point
  (".5"), compared exactly (17-digit account numbers, versions such as 1.2.3), and number words
  (two..ninety, hundred, dozen...); the word "one" counts only against a side that has a number
  too, since it is mostly a pronoun ("how can one ...").
- negation_mismatch: 1 when the sides hold different numbers of negations (not, n't, no,
  never, none, nothing, without, cannot, ...) or a word is the un-/in-/im-/il-/ir-/dis-/non-
  form of a word on the other side ("safe" / "unsafe"), and the texts are otherwise
  near-identical (at most a third of either side's content words missing from the other): in a
  free rewording, "without X" and "X removed" trade places all the time.
- entity_mismatch: 0, 0.5 or 1 as for numbers, over proper nouns, acronyms and alphanumeric
  names ("Moto E2", "GATE", "PyTorch") that the other side does not mention in any casing
  (words sharing their first 5 letters match: India / Indian).
- length_ratio: shorter over longer word count.
- role_swap: 1 when both sides carry the same content words and two of them trade sides around
  a shared pivot word ("black girls LIKE Mexican guys" / "Mexican girls LIKE black guys",
  "from Paris TO Rome" / "from Rome TO Paris"); never for a passive sentence.
"""

# A short, general English function-word list (determiners, pronouns, auxiliaries, prepositions,
# conjunctions, question words' helpers). Negations and numbers are handled separately.
STOPWORDS: frozenset[str] = frozenset(
    """
    a an the this that these those some any each every either all both such
    i me my mine myself we us our ours ourselves you your yours yourself yourselves
    he him his himself she her hers herself it its itself they them their theirs themselves
    one's someone somebody something anyone anybody anything everyone everything
    is am are was were be been being do does did doing done have has had having
    can could will would shall should may might must ought get gets got getting
    what which who whom whose when where why how whether
    and or but so if then than because as while until though although
    of in on at to for from by with about into onto over under between through during
    before after above below up down out off again further once here there
    very too also just only really quite more most much many less least few lot lots
    other another same own s t don
    """.split()
)

NEGATIONS: frozenset[str] = frozenset(
    """not no never none nobody nothing neither nor nowhere without cannot cant dont doesnt didnt
    isnt arent wasnt werent wont wouldnt shouldnt couldnt hasnt havent hadnt""".split()
)

NUMBER_WORDS: dict[str, float] = {
    "zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7,
    "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13,
    "fourteen": 14, "fifteen": 15, "sixteen": 16, "seventeen": 17, "eighteen": 18,
    "nineteen": 19, "twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60,
    "seventy": 70, "eighty": 80, "ninety": 90, "hundred": 100, "thousand": 1_000,
    "million": 1_000_000, "billion": 1_000_000_000, "dozen": 12, "half": 0.5,
}  # fmt: skip

NEGATING_PREFIXES: tuple[str, ...] = ("un", "in", "im", "il", "ir", "dis", "non")

# A negation difference counts only between otherwise near-identical texts (see FEATURE_NAMES).
NEGATION_MAX_MISSING = 0.34

# Prepositions that can stand between two swapped roles ("from A to B", "A better than B").
PIVOT_PREPOSITIONS: frozenset[str] = frozenset(
    "to from than into onto against versus vs over under before after above below".split()
)

_BE = frozenset("is are was were be been being am get gets got gotten".split())
_IRREGULAR = frozenset(
    """made done seen known given taken written built sold told found held kept left lost paid
    put read said sent set shown spent taught thought won bought brought caught chosen driven
    eaten fallen felt forgotten gone grown hidden hit hurt let meant met ridden rung risen shut
    spoken stolen struck sworn torn thrown understood woken worn""".split()
)

# A word: letters/digits, joined through an apostrophe (don't, France's), a decimal point or
# thousands comma between digits (3.5, 1,000); or a dotted acronym (U.S.).
_WORD = re.compile(r"(?:[^\W\d_]\.){2,}|[^\W_]+(?:(?:'|(?<=\d)[.,](?=\d))[^\W_]+)*")
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_SENTENCE_END = re.compile(r"[.?!:;]\s*$")


@dataclass(frozen=True, slots=True)
class TextProfile:
    """What the features need from one text, computed once."""

    n_words: int
    content: frozenset[str]  # stemmed content words
    order: tuple[str, ...]  # stemmed content words and pivot prepositions, in reading order
    vocabulary: frozenset[str]  # every lowercased word and its stem, function words included
    prefixes: frozenset[str]  # the first 5 letters of every vocabulary word of 5 or more
    numbers: tuple[str, ...]  # canonical texts (_parse_number), sorted; without "one"
    number_order: tuple[str, ...]  # the same, in reading order
    has_word_one: bool  # "one" as a word (a 1 only against a side that has a number)
    negations: int  # how many negation words
    entities: frozenset[str]  # stemmed proper nouns, acronyms and alphanumeric names
    passive: bool  # a form of "be" followed by a participle ("is mentioned", "was betrayed")


def stem(word: str) -> str:
    """A crude, deterministic English suffix stripper (plural, -ing, -ed, -ly, possessive)."""
    w = word
    if w.endswith("'s") or w.endswith("s'"):
        w = w[:-2] if w.endswith("'s") else w[:-1]
    w = w.replace("'", "")
    if len(w) > 4 and w.endswith("ies"):
        return w[:-3] + "y"
    if len(w) > 4 and w.endswith("ied"):
        return w[:-3] + "y"
    if len(w) > 5 and w.endswith("ing"):
        w = w[:-3]
        return w[:-1] if len(w) > 3 and w[-1] == w[-2] else w
    if len(w) > 4 and w.endswith("ed"):
        w = w[:-2]
        return w[:-1] if len(w) > 3 and w[-1] == w[-2] else w
    if len(w) > 4 and w.endswith("ly"):
        return w[:-2]
    if len(w) > 4 and (w.endswith("sses") or w.endswith("ches") or w.endswith("shes")):
        return w[:-2]
    if len(w) > 3 and w.endswith("s") and not w.endswith("ss") and not w.endswith("us"):
        return w[:-1]
    return w


def _is_content(low: str) -> bool:
    return not (low in STOPWORDS or low in NEGATIONS or low in NUMBER_WORDS or low[0].isdigit())


def _parse_number(token: str, prefix: str = "") -> str | None:
    """The token's number as an exact canonical text ("-40", "0.5", "12345678901234567",
    "1.2.3"), so that equal values compare equal and no two different ones do (floats merged
    integers past 2**53 and read 1.2.3 as 123). `prefix`: the text just before the token, for
    a sign ("-40") or a leading point (".5")."""
    match = _NUMBER.match(token)
    if match is None:
        return None
    digits = re.sub(r",(?=\d{3}(?!\d))", "", match.group(0)).replace(",", ".")
    if prefix.endswith(".") and not prefix[:-1][-1:].isalnum():  # ".5", not "no.1" or "3.5"
        digits = "0." + digits if "." not in digits else digits
        prefix = prefix[:-1]
    # "-40", not the dash of a range ("3-4") or of a word ("COVID-19")
    negative = prefix.endswith(("-", "\u2212")) and not prefix[:-1][-1:].isalnum()
    if digits.count(".") > 1:  # a version or a date: its text is its identity
        return ("-" if negative else "") + digits
    value = Decimal(digits).normalize()
    if negative and value:
        value = -value
    return _canonical(value)


def _canonical(value: Decimal) -> str:
    """A number's one text: 100 and 1E+2 and 100.0 are "100"."""
    text = format(value.normalize(), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def _is_entity_token(token: str, sentence_start: bool) -> bool:
    if any(c.isdigit() for c in token) and any(c.isalpha() for c in token):
        return True  # alphanumeric names: E2, 920m, GPT4, 2GB
    if not any(c.isupper() for c in token):
        return False
    if len(token) == 1 or token.lower() in STOPWORDS or token.lower() in NEGATIONS:
        return False
    if any(c.isupper() for c in token[1:]):
        return True  # acronyms and camel case: ISIS, PyTorch, iPhone
    return not sentence_start


def _is_participle(low: str) -> bool:
    return (len(low) > 3 and (low.endswith("ed") or low.endswith("en"))) or low in _IRREGULAR


_MEMO_SCOPE: ContextVar[str] = ContextVar("tiercache_profile_memo_scope", default="")


@contextmanager
def memo_scope(scope: str) -> Iterator[None]:
    """Inside the block, `profile` memoizes under `scope` only (one tenant's texts apart from
    every other's); outside any block, under the empty scope."""
    token = _MEMO_SCOPE.set(scope)
    try:
        yield
    finally:
        _MEMO_SCOPE.reset(token)


@lru_cache(maxsize=8192)
def _memoized(scope: str, text: str) -> TextProfile:
    del scope  # a key only: the same text gets its own entry in each scope
    return profile_text(text)


# Texts longer than this are profiled each time, never memoized: the memo is bounded by count,
# and a profile of a 16,000-character prompt holds about 650 KiB (a caller sending variants of
# one long cached prompt filled 8,192 entries: about 5 GiB a process)
PROFILE_MEMO_MAX_CHARS = 4096


def profile(text: str) -> TextProfile:
    """`profile_text`, memoized (a cached prompt recurs) within the current `memo_scope`, for
    texts of at most PROFILE_MEMO_MAX_CHARS."""
    if len(text) > PROFILE_MEMO_MAX_CHARS:
        return profile_text(text)
    return _memoized(_MEMO_SCOPE.get(), text)


def clear_profile_memo() -> None:
    """Forget every memoized profile, of every scope."""
    _memoized.cache_clear()


def profile_memo_misses() -> int:
    """How many profiles the memo has computed so far (its misses)."""
    return _memoized.cache_info().misses


def profile_text(text: str) -> TextProfile:
    """The features' view of one (normalized) text, computed (not memoized)."""
    text = text.replace("\u2019", "'").replace("\u2018", "'")
    words: list[str] = []
    entities: set[str] = set()
    numbers: list[str] = []
    has_word_one = False
    sentence_start = True
    last_end = 0
    for match in _WORD.finditer(text):
        if last_end and _SENTENCE_END.search(text[last_end : match.start()]):
            sentence_start = True
        last_end = match.end()
        token = match.group(0)
        if token.endswith(".") and not token[0].isdigit():
            token = token.replace(".", "")  # U.S. -> US
        low = token.lower()
        if low == "no":
            after = text[match.end() : match.end() + 1]
            if after == ".":
                low = "number"  # "No. 5" is an abbreviation, not a negation
            elif after == "," and sentence_start:
                continue  # "No, the parameter was ..." answers a question; it negates nothing
        if _is_entity_token(token, sentence_start):
            entities.add(stem(low))
        sentence_start = False
        if low[0].isdigit():
            value = _parse_number(low, text[max(0, match.start() - 2) : match.start()])
            if value is not None:
                numbers.append(value)
        elif low == "one":
            has_word_one = True
        elif low in NUMBER_WORDS:
            numbers.append(_canonical(Decimal(repr(NUMBER_WORDS[low]))))
        words.append(low)

    negations = 0
    passive = False
    order: list[str] = []
    vocabulary: set[str] = set()
    for i, low in enumerate(words):
        vocabulary.add(low)
        vocabulary.add(stem(low))
        if low in NEGATIONS or low.endswith("n't"):
            negations += 1
        elif low in _BE and any(_is_participle(w) for w in words[i + 1 : i + 3]):
            passive = True
        elif low in PIVOT_PREPOSITIONS:
            order.append(low)
        elif _is_content(low):
            order.append(stem(low))
    return TextProfile(
        n_words=len(words),
        content=frozenset(w for w in order if w not in PIVOT_PREPOSITIONS),
        order=tuple(order),
        vocabulary=frozenset(vocabulary),
        prefixes=frozenset(w[:5] for w in vocabulary if len(w) >= 5),
        numbers=tuple(sorted(numbers)),
        number_order=tuple(numbers),
        has_word_one=has_word_one,
        negations=negations,
        entities=frozenset(entities),
        passive=passive,
    )


def _side_count(p_has_extra: bool, q_has_extra: bool) -> float:
    """0: no side differs; 0.5: one side has something extra; 1: both (a substitution)."""
    return (int(p_has_extra) + int(q_has_extra)) / 2.0


def _number_mismatch(p: TextProfile, q: TextProfile) -> float:
    a = Counter(p.numbers)
    b = Counter(q.numbers)
    if p.numbers == q.numbers and p.number_order != q.number_order:
        return 1.0  # the same numbers in another order: "2^10" / "10^2", "1/4" / "4/1"
    if p.has_word_one and (q.has_word_one or q.numbers):
        a["1"] += 1
    if q.has_word_one and (p.has_word_one or p.numbers):
        b["1"] += 1
    return _side_count(bool(a - b), bool(b - a))


def _prefix_negations(p: TextProfile, q: TextProfile) -> dict[str, str]:
    """Words of p that are an un-/in-/dis-/... form of a word of q, mapped to that word."""
    found: dict[str, str] = {}
    for word in p.content:
        for prefix in NEGATING_PREFIXES:
            rest = word[len(prefix) :]
            if word.startswith(prefix) and len(rest) >= 4 and rest in q.content:
                found[word] = rest
    return found


def _mentions(p: TextProfile, entity: str) -> bool:
    """`entity` appears in p in any casing, or as a word sharing its first 5 letters (India,
    Indian; America, American)."""
    return entity in p.vocabulary or (len(entity) >= 5 and entity[:5] in p.prefixes)


def _entity_mismatch(p: TextProfile, q: TextProfile) -> float:
    return _side_count(
        any(not _mentions(q, e) for e in p.entities),
        any(not _mentions(p, e) for e in q.entities),
    )


def _missing_share(p: frozenset[str], q: frozenset[str]) -> float:
    return len(p - q) / len(p) if p else 0.0


def _positions(order: tuple[str, ...]) -> dict[str, int]:
    seen: dict[str, int] = {}
    repeated: set[str] = set()
    for i, w in enumerate(order):
        if w in seen:
            repeated.add(w)
        seen[w] = i
    return {w: i for w, i in seen.items() if w not in repeated}


def _role_swap(p: TextProfile, q: TextProfile) -> bool:
    """Two shared content words trade sides around a shared pivot word in active sentences.

    "black girls LIKE Mexican guys" / "Mexican girls LIKE black guys", "India afraid OF China" /
    "China afraid OF India", "from Paris TO Rome" / "from Rome TO Paris". Both texts must carry the
    same content words; words that occur more than once are ignored; a passive sentence never
    counts (it swaps roles legitimately).
    """
    if p.passive or q.passive or p.content != q.content:
        return False
    pp = _positions(p.order)
    qp = _positions(q.order)
    shared = [w for w in pp if w in qp]
    if len(shared) < 3:
        return False
    for pivot in shared:
        i, j = pp[pivot], qp[pivot]
        left_to_right = right_to_left = False
        for w in shared:
            if w == pivot or w in PIVOT_PREPOSITIONS:
                continue
            if pp[w] < i and qp[w] > j:
                left_to_right = True
            elif pp[w] > i and qp[w] < j:
                right_to_left = True
            if left_to_right and right_to_left:
                return True
    return False


def pair_features(p: TextProfile, q: TextProfile, cosine: float) -> tuple[float, ...]:
    """The feature vector of two profiles, laid out as `FEATURE_NAMES`; symmetric in p and q."""
    p_prefixed = _prefix_negations(p, q)
    q_prefixed = _prefix_negations(q, p)
    negated = p.negations != q.negations or bool(p_prefixed) or bool(q_prefixed)
    # "safe" / "unsafe" is the flip itself, not a difference in content
    p_content = frozenset(p_prefixed.get(w, w) for w in p.content)
    q_content = frozenset(q_prefixed.get(w, w) for w in q.content)
    near_identical = (
        max(_missing_share(p_content, q_content), _missing_share(q_content, p_content))
        <= NEGATION_MAX_MISSING
    )
    longer = max(p.n_words, q.n_words)
    return (
        float(cosine),
        _number_mismatch(p, q),
        float(negated and near_identical),
        _entity_mismatch(p, q),
        min(p.n_words, q.n_words) / longer if longer else 1.0,
        float(_role_swap(p, q)),
    )


def features(query: str, candidate: str, cosine: float) -> tuple[float, ...]:
    """`pair_features` of two normalized texts (profiles are memoized)."""
    return pair_features(profile(query), profile(candidate), cosine)
