"""A generated KV-block trace in Mooncake's format, for `tiercache simulate-kv` (issue 19's
"other traces you did not tune on").

Usage::

    python -m tiercache_dev.perf.kv_trace --out generated_trace.jsonl [--requests 20000]
        [--seed 0]

One JSON object per request with its `hash_ids`: 512-token KV blocks, a block's id standing for
its whole prefix (the same content after another prefix is another block), as in Mooncake's
traces. The workload model was written down before any policy ran on it, from what public
descriptions of LLM serving say traffic holds, and its numbers were not changed after (the
default policy was tuned on Mooncake's conversation trace alone):

- 200 system prompts of 1 to 6 blocks, chosen with Zipf popularity (s = 1.1).
- Each request either starts a session (probability 0.3) or continues one of the sessions
  still open, chosen uniformly; a session ends after its last turn.
- chat sessions (70 % of sessions): a geometric number of turns, mean 4, at most 30; a turn's
  prompt is the previous prompt, the previous answer (1 block) and a new message (1 or 2 blocks).
- document sessions (20 %): one request, the system prompt, a document and a question block; the
  document (4 to 16 blocks) is one of 2,000 shared ones (Zipf, s = 0.8) half of the time and read
  once otherwise.
- agent sessions (10 %): a geometric number of turns, mean 10, at most 60; each turn appends a
  tool result of 1 to 3 blocks to the previous prompt.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

SYSTEM_PROMPTS = 200
SYSTEM_ZIPF = 1.1
NEW_SESSION = 0.3
DOCUMENTS = 2_000
DOCUMENT_ZIPF = 0.8
SHARED_DOCUMENT = 0.5
KINDS = (("chat", 0.7), ("document", 0.2), ("agent", 0.1))


class PrefixIds:
    """Block ids by (prefix, content): the same content after the same prefix is one block."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, object], int] = {}

    def block(self, parent: int, content: object) -> int:
        key = (parent, content)
        found = self._ids.get(key)
        if found is None:
            found = self._ids[key] = len(self._ids) + 1
        return found

    def extend(self, blocks: list[int], contents: list[object]) -> list[int]:
        out = list(blocks)
        parent = out[-1] if out else 0
        for content in contents:
            parent = self.block(parent, content)
            out.append(parent)
        return out


@dataclass
class Session:
    kind: str
    turns_left: int
    blocks: list[int] = field(default_factory=list)
    turns_taken: int = 0


def zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (rank**s) for rank in range(1, n + 1)]


def generate(requests: int, seed: int) -> list[list[int]]:
    """Each request's hash_ids, in arrival order."""
    rng = random.Random(seed)
    ids = PrefixIds()
    fresh = iter(range(1, 1 << 62))  # content never seen before: a message, an answer, a read
    system_len = [rng.randint(1, 6) for _ in range(SYSTEM_PROMPTS)]
    system_w = zipf_weights(SYSTEM_PROMPTS, SYSTEM_ZIPF)
    doc_len = [rng.randint(4, 16) for _ in range(DOCUMENTS)]
    doc_w = zipf_weights(DOCUMENTS, DOCUMENT_ZIPF)
    kinds, kind_w = zip(*KINDS, strict=True)
    open_sessions: list[Session] = []
    out: list[list[int]] = []

    def turns(mean: float, cap: int) -> int:
        n = 1
        while n < cap and rng.random() > 1.0 / mean:
            n += 1
        return n

    while len(out) < requests:
        if not open_sessions or rng.random() < NEW_SESSION:
            kind = rng.choices(kinds, kind_w)[0]
            system = rng.choices(range(SYSTEM_PROMPTS), system_w)[0]
            prefix = ids.extend([], [("system", system, i) for i in range(system_len[system])])
            if kind == "document":
                if rng.random() < SHARED_DOCUMENT:
                    doc = rng.choices(range(DOCUMENTS), doc_w)[0]
                    body: list[object] = [("doc", doc, i) for i in range(doc_len[doc])]
                else:
                    body = [next(fresh) for _ in range(rng.randint(4, 16))]
                out.append(ids.extend(prefix, [*body, next(fresh)]))
                continue
            n = turns(4, 30) if kind == "chat" else turns(10, 60)
            session = Session(kind, n, prefix)
            open_sessions.append(session)
        else:
            session = open_sessions[rng.randrange(len(open_sessions))]
        if session.kind == "chat":  # the previous answer (none before the first turn), a message
            answer = [next(fresh)] if session.turns_taken else []
            added = answer + [next(fresh) for _ in range(rng.randint(1, 2))]
        else:
            added = [next(fresh) for _ in range(rng.randint(1, 3))]
        session.blocks = ids.extend(session.blocks, added)
        out.append(session.blocks)
        session.turns_taken += 1
        session.turns_left -= 1
        if session.turns_left <= 0:
            open_sessions.remove(session)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    trace = generate(args.requests, args.seed)
    with args.out.open("w", encoding="utf-8") as f:
        for blocks in trace:
            f.write(json.dumps({"hash_ids": blocks}) + "\n")
    total = sum(len(b) for b in trace)
    distinct = len({b for blocks in trace for b in blocks})
    print(f"{args.out}: {len(trace)} requests, {total} blocks, {distinct} distinct")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
