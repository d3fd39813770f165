"""Two tritonserver replicas sharing one Redis: cross-replica hits and invalidation latency.

Usage::

    python -m tiercache_dev.bench.replicas [--prompts 20] [--rounds 50] [--max-tokens 8]

Starts one redis-server (free loopback port, no persistence) and two tritonservers, A and B
(tiercache_dev.servers),
each on a copy of model_repository whose prompt_cache, embedding_cache, llm and cache_admin share
`redis_url` and `redis_prefix`, each with its own state dir (own L1 and L2, as on two hosts).
Stops all three by pid at the end.

(a) Sharing: `--prompts` distinct prompts are generated on A (misses), then asked on B: how many
    are `exact` hits there, and B's latency for them.
(b) Invalidation across replicas, for each of key, tag and tenant, `--rounds` times: warm one
    fresh answer through A's cache_admin (tagged, under a fresh tenant), ask B until it serves it
    `exact` (an L3 hit, then in B's L1), then send `invalidate` to A's cache_admin on a thread
    while this thread asks B back to back. Latency = when the first request to B that is not
    `exact` was sent, minus when the invalidate was sent. Its resolution is one request round
    trip on B (the request before it was sent at most that much earlier and was still `exact`),
    reported as B's exact-hit round trip.
(c) Feedback (issue 19), the same rounds with `bad` feedback sent to A's feedback model on the
    answer id of B's last `exact` response instead of an invalidate (kind `feedback`).
"""

from __future__ import annotations

import argparse
import json
import platform
import secrets
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from tiercache.exact.keys import replace_secret
from tiercache.server import REDIS_STAGES, copy_repository
from tiercache_client import TierCacheClient
from tiercache_dev.console import exit_on_sigterm
from tiercache_dev.paths import MODEL_REPOSITORY
from tiercache_dev.servers import admin_token, redis_running, running_all, triton
from tiercache_dev.stats import summary

POLL_TIMEOUT_S = 10.0


def replica_repository(root: Path, redis_url: str, redis_prefix: str) -> Path:
    """A copy of model_repository under `root` whose Redis-aware stages share one Redis."""
    shared = {"redis_url": redis_url, "redis_prefix": redis_prefix}
    return copy_repository(
        MODEL_REPOSITORY, root / "model_repository", dict.fromkeys(REDIS_STAGES, shared)
    )


def summary_ms(values_s: list[float]) -> dict[str, float]:
    return summary(v * 1e3 for v in values_s)


def sharing(a: TierCacheClient, b: TierCacheClient, prompts: int, max_tokens: int) -> dict:
    run = uuid.uuid4().hex[:6]
    texts = [f"Give one fact about the number {i} ({run})." for i in range(prompts)]
    answers = [a.generate_text(p, max_tokens=max_tokens) for p in texts]
    misses_a = sum(r.cache_status == "miss" for r in answers)
    on_b = [b.generate_text(p, max_tokens=max_tokens) for p in texts]
    exact = sum(
        r.cache_status == "exact" and r.text == first.text
        for r, first in zip(on_b, answers, strict=True)
    )
    return {
        "prompts": prompts,
        "misses_on_a": misses_a,
        "exact_on_b_same_text": exact,
        "b_latency": summary_ms([r.latency_s for r in on_b]),
        "a_generation": summary_ms([r.latency_s for r in answers]),
    }


def invalidation_round(
    a: TierCacheClient, b: TierCacheClient, kind: str, max_tokens: int
) -> tuple[float, list[float], float]:
    """One round: (latency_s, B's exact-hit round trips, admin call duration_s)."""
    tag = f"bench-{uuid.uuid4().hex[:10]}"
    tenant = f"bench-{uuid.uuid4().hex[:10]}"
    prompt = f"What is a replica? ({uuid.uuid4().hex[:8]})"
    item = {
        "text_input": prompt,
        "answer": f"A copy ({tag}).",
        "tenant": tenant,
        "max_tokens": max_tokens,
        "cache_control": f"tag={tag}",
    }
    report = a.warm(prompts=[item])
    if report.get("stored") != 1:
        raise SystemExit(f"warm failed: {report}")
    digest = report["prompts"][0]["digest"]
    selector = {"key": digest, "tag": tag, "tenant": tenant, "feedback": ""}[kind]
    answer_id = ""

    def ask() -> tuple[float, str, float]:
        nonlocal answer_id
        sent = time.perf_counter()
        r = b.generate_text(prompt, tenant=tenant, max_tokens=max_tokens)
        answer_id = r.answer_id or answer_id
        return sent, r.cache_status, r.latency_s

    deadline = time.monotonic() + POLL_TIMEOUT_S
    hits: list[float] = []
    while len(hits) < 2:  # the first is B's L3 hit; the second comes from B's L1
        _, status, latency = ask()
        if status == "exact":
            hits.append(latency)
        elif time.monotonic() > deadline:
            raise SystemExit(f"B never served the warmed entry ({status})")

    admin: dict[str, Any] = {}
    served_id = answer_id  # B's exact answer: what the caller judges

    def invalidate() -> None:
        start = time.perf_counter()
        if kind == "feedback":
            admin["report"] = a.feedback(served_id, "bad", tenant=tenant)
        else:
            admin["report"] = a.invalidate(**{kind: selector})
        admin["duration_s"] = time.perf_counter() - start

    thread = threading.Thread(target=invalidate)
    sent_at = time.perf_counter()
    thread.start()
    while True:
        when, status, latency = ask()
        if status != "exact":
            break
        hits.append(latency)
        if time.monotonic() > deadline + POLL_TIMEOUT_S:
            raise SystemExit("B kept serving the invalidated entry")
    thread.join()
    if not admin["report"].get("published"):
        raise SystemExit(f"invalidation not published: {admin['report']}")
    return when - sent_at, hits, admin["duration_s"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument(
        "--rounds", type=int, default=50, help="per kind (key, tag, tenant, feedback)"
    )
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--kinds", default="key,tag,tenant,feedback")
    args = parser.parse_args(argv)
    exit_on_sigterm()  # SIGTERM unwinds, so the servers are stopped

    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp_name:
        tmp = Path(tmp_name)
        prefix = f"b{uuid.uuid4().hex[:10]}:"
        with redis_running(tmp) as redis_server:
            servers = []
            fleet_secret = secrets.token_bytes(32)  # one fleet: each replica is given it
            for name in ("a", "b"):
                state = tmp / f"replica-{name}"
                state.mkdir()
                replace_secret(state / "secret", fleet_secret)
                repository = replica_repository(state, redis_server.url, prefix)
                servers.append(triton(repository, state, log_path=state / "triton.log"))
            with running_all(servers, ready_timeout_s=600):
                a_addr, b_addr = (s.grpc_url for s in servers)
                with (
                    TierCacheClient(
                        a_addr, timeout_s=300, admin_token=admin_token(servers[0])
                    ) as a,
                    TierCacheClient(
                        b_addr, timeout_s=300, admin_token=admin_token(servers[1])
                    ) as b,
                ):
                    shared = sharing(a, b, args.prompts, args.max_tokens)
                    kinds: dict[str, dict] = {}
                    for kind in args.kinds.split(","):
                        latencies, hits, admin = [], [], []
                        for _ in range(args.rounds):
                            latency, round_hits, admin_s = invalidation_round(
                                a, b, kind, args.max_tokens
                            )
                            latencies.append(latency)
                            hits.extend(round_hits)
                            admin.append(admin_s)
                        kinds[kind] = {
                            "latency": summary_ms(latencies),
                            "resolution_b_exact_rtt": summary_ms(hits),
                            "admin_call": summary_ms(admin),
                        }

    result = {
        "machine": f"{platform.machine()} {platform.system()}, Python {platform.python_version()}",
        "sharing": shared,
        "invalidation": kinds,
    }
    print(json.dumps(result, indent=2))
    s = shared
    print("\n| what | figure |\n|---|---|")
    print(
        f"| {s['prompts']} prompts generated on A, asked on B | {s['exact_on_b_same_text']}"
        f"/{s['prompts']} exact with A's text; B p50 {s['b_latency']['p50_ms']:.1f} ms, p99 "
        f"{s['b_latency']['p99_ms']:.1f} ms (A's generations: p50 "
        f"{s['a_generation']['p50_ms']:.0f} ms) |"
    )
    for kind, k in kinds.items():
        lat, res, adm = k["latency"], k["resolution_b_exact_rtt"], k["admin_call"]
        what = "feedback bad" if kind == "feedback" else f"invalidate --{kind}"
        print(
            f"| {what} on A -> B not exact ({lat['n']:.0f} rounds) | p50 "
            f"{lat['p50_ms']:.1f} ms, p99 {lat['p99_ms']:.1f} ms, max {lat['max_ms']:.1f} ms "
            f"(resolution: B hit p50 {res['p50_ms']:.1f} ms, p99 {res['p99_ms']:.1f} ms; admin "
            f"call p50 {adm['p50_ms']:.1f} ms) |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
