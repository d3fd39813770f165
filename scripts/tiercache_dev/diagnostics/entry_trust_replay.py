"""Replay a synthetic stream through the per-entry trust policy (tiercache.semantic.entry_trust)
and a fixed threshold, side by side: does the stated error rate hold?

Usage::

    python -m tiercache_dev.diagnostics.entry_trust_replay [--events 4000] [--max-error 0.05]
        [--seed 7]

40 entries, 30 good (serving them is right 99 % of the time) and 10 bad (right 40 %), offered
at scores drawn uniformly in [0.9, 1.0] whatever the kind: scores that look calibrated and are
not, per entry. Prints what a fixed threshold at 0.96 serves, and what the policy does with
verification available (it explores and learns) and without (it cannot learn: no outcome
arrives). Synthetic on purpose, to show the mechanism; real outcomes come from the engine's
verifications once the stages record them.
"""

from __future__ import annotations

import argparse
import random
import sys

from tiercache.semantic.entry_trust import TrustPolicy, replay


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=4000)
    parser.add_argument("--max-error", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    events = []
    for _ in range(args.events):
        entry = rng.randrange(40)
        right = rng.random() < (0.99 if entry < 30 else 0.4)
        events.append((f"e{entry}", rng.uniform(0.9, 1.0), right))
    fixed = [right for _, score, right in events if score >= 0.96]
    print("| rule | served | wrong among served | verified (right / refuted) | missed |")
    print("|---|---:|---:|---:|---:|")
    wrong = len(fixed) - sum(fixed)
    print(f"| fixed threshold 0.96 | {len(fixed)} | {wrong / len(fixed):.3f} | - | "
          f"{len(events) - len(fixed)} |")  # fmt: skip
    policy = TrustPolicy(max_error=args.max_error)
    for label, can_verify in (("with verification", True), ("without verification", False)):
        c = replay(policy, events, can_verify)
        served = c["served_right"] + c["served_wrong"]
        rate = c["served_wrong"] / served if served else float("nan")
        print(f"| per-entry trust, max_error {args.max_error}, {label} | {served} | {rate:.3f} | "
              f"{c['verified']} / {c['refuted']} | {c['missed']} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
