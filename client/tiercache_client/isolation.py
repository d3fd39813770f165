"""A tenant-isolation oracle: judges, from what clients saw, whether any answer crossed tenants.

It lives in the client package because it sees only what a client sees (the request it sent, the
status, text, similarity and KV counts that came back, and when), and so it can audit any
deployment from outside; it imports nothing from the server.
`tiercache_dev.diagnostics.check_isolation` drives a server and feeds it;
tests/unit/test_isolation_oracle.py proves it flags leaks.

The rules, for an outcome `o` of tenant `t` (the tenant the driver meant, which is what the oracle
is told; a server that mixed tenants up is exactly what it must catch):

- A request `p` of `t` *could have produced* what `o` saw if it started before `o` finished
  (earlier, or concurrent: `o` may have been coalesced onto it, or found its answer as it landed).
- **exact** hit: legit if such a `p` had the same exact key (normalized prompt, max_tokens,
  adapter) and was answered the same text.
- **semantic** hit: legit if such a `p` in the same semantic scope (max_tokens, adapter) was
  *generated* (miss or bypass) with exactly the hit's text. Strict on purpose: the similarity
  alone cannot say whose answer it was, the text can.
- **KV** reuse (`kv_reused_tokens` > 0 on a generated answer): legit if such a `p` with the same
  adapter ran the engine (miss, bypass or error) and its prompt shares at least that many leading
  tokens with `o`'s (after the chat template; the caller supplies the tokenizer).

Everything else is a leak. Ordering by start and finish times (not by send order) is what makes
the oracle safe under concurrency.
"""

from __future__ import annotations

import unicodedata
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

HIT_STATUSES = frozenset({"exact", "semantic"})
# answers the engine generated (`verified`: a semantic hit's answer the engine re-generated)
GENERATED_STATUSES = frozenset({"miss", "bypass", "verified"})
KINDS = ("exact", "semantic", "kv")

Tokenize = Callable[[str], Sequence[Hashable]]
"""A normalized prompt -> the token ids the engine prefills (chat template included)."""


def normalize_prompt(text: str) -> str:
    """As prompt_cache canonicalizes text_input (tiercache.exact.request.normalize_text): NFKC,
    runs of whitespace to one space, trimmed."""
    return " ".join(unicodedata.normalize("NFKC", text).split())


@dataclass(frozen=True, slots=True)
class Sent:
    """One request as the driver meant it."""

    tenant: str
    prompt: str
    max_tokens: int
    lora_name: str = ""
    group: str = ""  # the rewording group it belongs to ("" for none); reported, not judged

    @property
    def exact_key(self) -> tuple[str, int, str]:
        return (normalize_prompt(self.prompt), self.max_tokens, self.lora_name)

    @property
    def semantic_key(self) -> tuple[int, str]:
        return (self.max_tokens, self.lora_name)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What came back for one `Sent`, with the client's start and finish times (one clock)."""

    sent: Sent
    started_s: float
    finished_s: float
    cache_status: str  # "" with an error
    text: str = ""
    similarity: float | None = None
    kv_reused_tokens: int | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Verdict:
    outcome: Outcome
    kind: str  # exact | semantic | kv
    leak: bool
    reason: str


@dataclass(slots=True)
class Tally:
    hits: int = 0
    legit: int = 0
    leaks: int = 0


@dataclass(slots=True)
class Report:
    verdicts: list[Verdict] = field(default_factory=list)
    statuses: dict[str, dict[str, int]] = field(default_factory=dict)  # tenant -> status -> n
    # kind -> requests that would have been a cross-tenant hit had the scopes been shared: what
    # the run gave a leak the chance to show (see IsolationOracle.chances)
    chances: dict[str, int] = field(default_factory=dict)

    @property
    def leaks(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.leak]

    def tally(self) -> dict[str, dict[str, Tally]]:
        """tenant -> kind -> hits / legit / leaks."""
        table: dict[str, dict[str, Tally]] = {}
        for tenant in self.statuses:
            table[tenant] = {kind: Tally() for kind in KINDS}
        for v in self.verdicts:
            t = table.setdefault(v.outcome.sent.tenant, {kind: Tally() for kind in KINDS})[v.kind]
            t.hits += 1
            t.leaks += v.leak
            t.legit += not v.leak
        return table

    def table(self) -> str:
        """A plain-text table: one row per tenant, exact/semantic/kv hits, legit and leaks."""
        head = f"{'tenant':<16}{'requests':>9}{'errors':>7}"
        for kind in KINDS:
            head += f"{kind + ' hit':>13}{'legit':>7}{'leak':>6}"
        lines = [head]
        total = {kind: Tally() for kind in KINDS}
        requests = errors = 0
        for tenant, kinds in sorted(self.tally().items()):
            n = sum(self.statuses.get(tenant, {}).values())
            e = self.statuses.get(tenant, {}).get("error", 0)
            requests, errors = requests + n, errors + e
            row = f"{tenant or '(none)':<16}{n:>9}{e:>7}"
            for kind in KINDS:
                t = kinds[kind]
                row += f"{t.hits:>13}{t.legit:>7}{t.leaks:>6}"
                total[kind].hits += t.hits
                total[kind].legit += t.legit
                total[kind].leaks += t.leaks
            lines.append(row)
        row = f"{'all':<16}{requests:>9}{errors:>7}"
        for kind in KINDS:
            row += f"{total[kind].hits:>13}{total[kind].legit:>7}{total[kind].leaks:>6}"
        lines.append(row)
        if self.chances:
            lines.append(
                "cross-tenant chances (a leak would have shown here): "
                + ", ".join(f"{kind} {self.chances.get(kind, 0)}" for kind in KINDS)
            )
        return "\n".join(lines)


class IsolationOracle:
    def __init__(self, tokenize: Tokenize | None = None, tokens_per_block: int = 32) -> None:
        """`tokenize` maps a normalized prompt to what the engine prefills; None judges any KV
        reuse a leak unless the same tenant sent the very same prompt (with that adapter)."""
        self._tokenize = tokenize
        self._tokens_per_block = tokens_per_block
        self._ids: dict[str, tuple[Hashable, ...]] = {}

    def _tokens(self, prompt: str) -> tuple[Hashable, ...]:
        ids = self._ids.get(prompt)
        if ids is None:
            ids = tuple(self._tokenize(prompt)) if self._tokenize is not None else (prompt,)
            self._ids[prompt] = ids
        return ids

    def shared_tokens(self, a: str, b: str) -> int:
        """Leading tokens two (normalized) prompts share once templated; without a tokenizer, a
        prompt is one token (equal prompts share everything)."""
        ta, tb = self._tokens(a), self._tokens(b)
        if self._tokenize is None:
            return 1 << 30 if ta == tb else 0
        n = 0
        for x, y in zip(ta, tb, strict=False):
            if x != y:
                break
            n += 1
        return n

    def check(self, outcomes: Iterable[Outcome]) -> Report:
        report = Report()
        by_tenant: dict[str, list[Outcome]] = defaultdict(list)
        for o in outcomes:
            by_tenant[o.sent.tenant].append(o)
            counts = report.statuses.setdefault(o.sent.tenant, {})
            status = "error" if o.error is not None else (o.cache_status or "none")
            counts[status] = counts.get(status, 0) + 1
        for own in by_tenant.values():
            report.verdicts.extend(self._check_tenant(own))
        report.chances = self.chances([o for own in by_tenant.values() for o in own])
        return report

    def chances(self, outcomes: Sequence[Outcome]) -> dict[str, int]:
        """How many requests a shared scope would have turned into a cross-tenant hit: a
        tenant's first request for a key another tenant had answered before it started (exact);
        its first of a rewording group another tenant had generated an answer for (semantic); a
        generated one whose prompt shares more full KV blocks with another tenant's earlier
        engine run than with any of its own (kv)."""
        ok = [o for o in outcomes if o.error is None]
        block = self._tokens_per_block
        first_done: dict[tuple[object, str], float] = {}  # (key, tenant) -> earliest finish
        group_done: dict[tuple[object, str], float] = {}
        runs: list[tuple[Outcome, str]] = []
        for o in ok:
            k = (o.sent.exact_key, o.sent.tenant)
            first_done[k] = min(first_done.get(k, o.finished_s), o.finished_s)
            if o.sent.group and o.cache_status in GENERATED_STATUSES:
                g = ((o.sent.group, o.sent.semantic_key), o.sent.tenant)
                group_done[g] = min(group_done.get(g, o.finished_s), o.finished_s)
            if o.cache_status in GENERATED_STATUSES:
                runs.append((o, normalize_prompt(o.sent.prompt)))
        tenants = {o.sent.tenant for o in ok}
        first_start: dict[tuple[object, str], float] = {}
        group_start: dict[tuple[object, str], float] = {}
        for o in ok:
            k = (o.sent.exact_key, o.sent.tenant)
            first_start[k] = min(first_start.get(k, o.started_s), o.started_s)
            if o.sent.group:
                g = ((o.sent.group, o.sent.semantic_key), o.sent.tenant)
                group_start[g] = min(group_start.get(g, o.started_s), o.started_s)
        counts = dict.fromkeys(KINDS, 0)
        for o in ok:
            t = o.sent.tenant
            key = o.sent.exact_key
            if first_start[(key, t)] == o.started_s and any(
                first_done.get((key, u), float("inf")) < o.started_s for u in tenants - {t}
            ):
                counts["exact"] += 1
            if o.sent.group:
                group = (o.sent.group, o.sent.semantic_key)
                if group_start[(group, t)] == o.started_s and any(
                    group_done.get((group, u), float("inf")) < o.started_s for u in tenants - {t}
                ):
                    counts["semantic"] += 1
        by_head: dict[object, list[tuple[Outcome, str]]] = defaultdict(list)
        for o, prompt in runs:  # only prompts with the same first block can share a block
            by_head[(o.sent.lora_name, self._tokens(prompt)[:block])].append((o, prompt))
        for o, prompt in runs:
            own = other = 0
            for p, other_prompt in by_head[(o.sent.lora_name, self._tokens(prompt)[:block])]:
                if p is o or p.sent.lora_name != o.sent.lora_name or p.finished_s >= o.started_s:
                    continue
                shared = self.shared_tokens(prompt, other_prompt) // block
                if p.sent.tenant == o.sent.tenant:
                    own = max(own, shared)
                else:
                    other = max(other, shared)
            counts["kv"] += other > own
        return counts

    def _check_tenant(self, own: list[Outcome]) -> list[Verdict]:
        # Indexes over the tenant's own requests: key -> [(start, position in `own`)], so a
        # candidate is any other request that started before the judged one finished.
        exact: dict[object, list[tuple[float, int]]] = defaultdict(list)
        semantic: dict[object, list[tuple[float, int]]] = defaultdict(list)
        engine_runs: dict[object, list[tuple[float, int]]] = defaultdict(list)
        prefix_len = max(self._tokens_per_block - 1, 1)  # any reuse covers at least this much
        for i, p in enumerate(own):
            if p.error is None:
                exact[(p.sent.exact_key, p.text)].append((p.started_s, i))
            if p.error is None and p.cache_status in GENERATED_STATUSES:
                semantic[(p.sent.semantic_key, p.text)].append((p.started_s, i))
            if p.error is not None or p.cache_status in GENERATED_STATUSES:
                head = self._tokens(normalize_prompt(p.sent.prompt))[:prefix_len]
                engine_runs[(p.sent.lora_name, head)].append((p.started_s, i))
        verdicts: list[Verdict] = []
        for i, o in enumerate(own):
            if o.error is not None:
                continue
            if o.cache_status == "exact":
                found = _earlier(exact.get((o.sent.exact_key, o.text), ()), o, i)
                reason = "" if found else "no own request with this key and text"
                verdicts.append(Verdict(o, "exact", not found, reason))
            elif o.cache_status == "semantic":
                found = _earlier(semantic.get((o.sent.semantic_key, o.text), ()), o, i)
                reason = "" if found else "no own generated answer with this text in this scope"
                verdicts.append(Verdict(o, "semantic", not found, reason))
            reused = o.kv_reused_tokens or 0
            if reused > 0 and o.cache_status in GENERATED_STATUSES:
                prompt = normalize_prompt(o.sent.prompt)
                head = self._tokens(prompt)[:prefix_len]
                best = 0
                for started_s, j in engine_runs.get((o.sent.lora_name, head), ()):
                    if j != i and started_s < o.finished_s:
                        best = max(
                            best, self.shared_tokens(prompt, normalize_prompt(own[j].sent.prompt))
                        )
                legit = reused <= best
                reason = "" if legit else f"reused {reused} tokens, own prompts share {best}"
                verdicts.append(Verdict(o, "kv", not legit, reason))
        return verdicts


def _earlier(candidates: Iterable[tuple[float, int]], o: Outcome, position: int) -> bool:
    """Whether another request among `candidates` started before `o` finished."""
    return any(j != position and started_s < o.finished_s for started_s, j in candidates)
