"""`tiercache-client`: command line for a tiercache server.

Exit codes: 0 success; 1 server/transport error or server not ready; 2 invalid request, not
found, or bad command-line arguments; 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from .client import GenerationResult, TierCacheClient
from .errors import InvalidRequestError, NotFoundError, TierCacheClientError

DEFAULT_URL = "localhost:8001"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; the default --url is $TIERCACHE_URL, else localhost:8001."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--url",
        default=os.environ.get("TIERCACHE_URL") or DEFAULT_URL,
        help="Triton gRPC host:port (default: $TIERCACHE_URL or %(default)s)",
    )
    common.add_argument(
        "--timeout", type=float, default=300.0, help="seconds before giving up (default: 300)"
    )
    common.add_argument("--model", default="ensemble", help=argparse.SUPPRESS)

    parser = argparse.ArgumentParser(prog="tiercache-client", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", parents=[common], help="generate text for a prompt")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int)
    gen.add_argument("--temperature", type=float)
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--top-k", type=int)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", metavar="WORD", help="stop word (repeatable)")
    gen.add_argument("--tenant")
    gen.add_argument("--cache-control", help='e.g. "no-cache, no-store"')
    gen.add_argument("--adapter", dest="lora_name", metavar="NAME", help="LoRA adapter name")
    gen.add_argument("--no-stream", dest="stream", action="store_false", help="one response")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead")

    sub.add_parser("health", parents=[common], help="show server and model readiness")

    adapters = sub.add_parser(
        "adapters", parents=[common], help="list LoRA adapters and the tier each is resident in"
    )
    adapters.add_argument(
        "--warm",
        action="append",
        metavar="NAME",
        default=[],
        help="load this adapter into the engine first (repeatable)",
    )
    adapters.add_argument("--json", action="store_true", help="print the server's JSON answer")
    return parser


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def summary_line(result: GenerationResult) -> str:
    """The stderr summary, e.g. "[cache: semantic (sim 0.953) | 1.23 ms | first chunk 0.90 ms]"."""
    cache = f"cache: {result.cache_status or 'unknown'}"
    if result.similarity is not None:
        cache += f" (sim {result.similarity:.3f})"
    parts = [cache, f"{result.latency_s * 1000.0:.2f} ms"]
    if result.kv_reused_tokens:
        parts.append(f"prefix KV reused {result.kv_reused_tokens} tokens")
    if result.first_chunk_s is not None:
        parts.append(f"first chunk {result.first_chunk_s * 1000.0:.2f} ms")
    return "[" + " | ".join(parts) + "]"


def _generate(client: TierCacheClient, args: argparse.Namespace) -> int:
    items = client.generate(
        args.prompt,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop_words=args.stop,
        tenant=args.tenant,
        cache_control=args.cache_control,
        lora_name=args.lora_name,
        stream=args.stream,
    )
    for item in items:
        if isinstance(item, GenerationResult):
            if args.json:
                record = {
                    "text": item.text,
                    "cache_status": item.cache_status,
                    "similarity": item.similarity,
                    "latency_ms": _ms(item.latency_s),
                    "first_chunk_ms": _ms(item.first_chunk_s),
                    "kv_reused_tokens": item.kv_reused_tokens,
                    "kv_computed_tokens": item.kv_computed_tokens,
                }
                print(json.dumps(record, ensure_ascii=False))
            else:
                sys.stdout.write("\n")
                sys.stdout.flush()
                print(summary_line(item), file=sys.stderr)
            return 0
        if not args.json:
            sys.stdout.write(item)
            sys.stdout.flush()
    raise TierCacheClientError("stream ended without a final result")


def _health(client: TierCacheClient) -> int:
    state = client.health()
    print(f"live: {'yes' if state['live'] else 'no'}")
    print(f"ready: {'yes' if state['ready'] else 'no'}")
    for name, ready in sorted(state["models"].items()):
        print(f"model {name}: {'ready' if ready else 'not ready'}")
    return 0 if state["ready"] else 1


def adapter_rows(report: dict) -> list[tuple[str, ...]]:
    """One row per adapter version: name, task id, short digest, lora_cache's tier, whether the
    engine itself reports it loaded, pinned."""
    engine = {a.get("digest") for a in report.get("engine_reported") or []}
    rows: list[tuple[str, ...]] = []
    for entry in report.get("adapters", []):
        digest = str(entry.get("digest", ""))
        rows.append(
            (
                str(entry.get("name", "")),
                str(entry.get("task_id", "")),
                digest[:12],
                str(entry.get("tier", "")),
                "yes" if digest in engine else "no",
                "yes" if entry.get("pinned") else "no",
            )
        )
    return rows


def _adapters(client: TierCacheClient, args: argparse.Namespace) -> int:
    report = client.adapters(warm=args.warm)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return 0
    for name, outcome in sorted((report.get("warmed") or {}).items()):
        print(f"warm {name}: {outcome}")
    header = ("adapter", "task", "digest", "tier", "in engine", "pinned")
    rows = [header, *adapter_rows(report)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI and return its exit code (argparse exits 2 itself on bad arguments)."""
    args = build_parser().parse_args(argv)
    if args.timeout <= 0:
        print("error: --timeout must be > 0", file=sys.stderr)
        return 2
    try:
        with TierCacheClient(args.url, model=args.model, timeout_s=args.timeout) as client:
            if args.command == "generate":
                return _generate(client, args)
            if args.command == "adapters":
                return _adapters(client, args)
            return _health(client)
    except (InvalidRequestError, NotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except TierCacheClientError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
