"""`tiercache-client`: command line for a tiercache server.

Exit codes: 0 success; 1 server/transport error or server not ready; 2 invalid request, not
found, refused (no or a wrong admin token), bad command-line arguments, or a warmed prompt or
adapter the server could not warm; 130 interrupted.

What the server sends (model names, answer ids, reports, error texts) is shown with its
control characters escaped: a server must not move the terminal's cursor or rewrite its lines.
The generated text itself goes to stdout as it is.

The admin commands (stats, invalidate, flush, warm) send the operator's admin token, read from
--admin-token-file (default: $TIERCACHE_ADMIN_TOKEN_FILE, else <state dir>/admin_token with the
state dir $TIERCACHE_STATE_DIR or ~/.cache/tiercache, as on the server's host). The token is only
ever read from a file: a command-line value would show in `ps`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from .client import WARM_CALL_PROMPTS, GenerationResult, TierCacheClient, read_admin_token
from .errors import InvalidRequestError, NotFoundError, TierCacheClientError, UnavailableError

DEFAULT_URL = "localhost:8001"
ADMIN_TOKEN_FILE_ENV = "TIERCACHE_ADMIN_TOKEN_FILE"
STATE_DIR_ENV = "TIERCACHE_STATE_DIR"
ADMIN_COMMANDS = ("stats", "invalidate", "flush", "warm", "adapters")


def default_admin_token_file() -> str:
    """$TIERCACHE_ADMIN_TOKEN_FILE, else the server's default: <state dir>/admin_token, the state
    dir being $TIERCACHE_STATE_DIR or ~/.cache/tiercache (tiercache.config.default_state_dir)."""
    named = os.environ.get(ADMIN_TOKEN_FILE_ENV)
    if named:
        return named
    state = os.environ.get(STATE_DIR_ENV) or os.path.join("~", ".cache", "tiercache")
    return os.path.join(os.path.expanduser(state), "admin_token")


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
    common.add_argument(
        "--idle-timeout",
        type=float,
        default=None,
        help="seconds a generation may go without a response before giving up (default: off; "
        "--timeout still bounds the whole call)",
    )
    common.add_argument("--model", default="ensemble", help=argparse.SUPPRESS)
    admin = argparse.ArgumentParser(add_help=False, parents=[common])
    admin.add_argument(
        "--admin-token-file",
        default=default_admin_token_file(),
        metavar="FILE",
        help="the server's admin token file, printed by `tiercache serve` at start (default: "
        "$TIERCACHE_ADMIN_TOKEN_FILE, else <$TIERCACHE_STATE_DIR or ~/.cache/tiercache>/"
        "admin_token)",
    )

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
    _api_key_option(gen)

    feedback = sub.add_parser(
        "feedback",
        parents=[common],
        help="say whether an answer was good or bad, by its answer id (bad: it is invalidated "
        "and generated again when next asked)",
    )
    feedback.add_argument("answer_id", help="the answer id `generate` printed")
    feedback.add_argument("verdict", choices=("good", "bad"))
    feedback.add_argument("--tenant", help="the tenant the answer was served to")
    feedback.add_argument("--json", action="store_true", help="print the server's JSON answer")
    _api_key_option(feedback)

    sub.add_parser("health", parents=[common], help="show server and model readiness")

    adapters = sub.add_parser(
        "adapters", parents=[admin], help="list LoRA adapters and the tier each is resident in"
    )
    adapters.add_argument(
        "--warm",
        action="append",
        metavar="NAME",
        default=[],
        help="load this adapter into the engine first (repeatable)",
    )
    adapters.add_argument("--json", action="store_true", help="print the server's JSON answer")

    stats = sub.add_parser("stats", parents=[admin], help="show the cache tiers' counters")
    stats.add_argument("--json", action="store_true", help="print the server's JSON answer")

    inv = sub.add_parser(
        "invalidate", parents=[admin], help="drop cached answers by key, tag, tenant or adapter"
    )
    what = inv.add_mutually_exclusive_group(required=True)
    what.add_argument("--key", metavar="DIGEST", help="an exact-cache digest")
    what.add_argument("--tag", help="a cache_control tag (tag=NAME)")
    what.add_argument("--tenant", metavar="NAME", help="a tenant name")
    what.add_argument(
        "--adapter",
        metavar="NAME|DIGEST",
        help="a LoRA adapter: its name (the current version) or a version's content digest",
    )

    flush = sub.add_parser("flush", parents=[admin], help="delete every entry of L2 and L3")
    flush.add_argument("--yes", action="store_true", help="required: confirm the flush")

    warm = sub.add_parser(
        "warm", parents=[admin], help="pre-load answers and/or load adapters into the engine"
    )
    warm.add_argument(
        "--prompts",
        metavar="FILE.jsonl",
        help='one {"text_input", "answer", ...ensemble inputs} object per line',
    )
    warm.add_argument(
        "--adapter",
        dest="adapters",
        action="append",
        metavar="NAME",
        default=[],
        help="load this adapter into the engine (repeatable)",
    )
    return parser


def _api_key_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--api-key-file",
        default=os.environ.get("TIERCACHE_API_KEY_FILE", ""),
        metavar="FILE",
        help="a file holding your API key (from `tiercache keys add`), for a server with an API "
        "key file (default: $TIERCACHE_API_KEY_FILE; none: no key sent)",
    )


def _reported(
    command: Callable[[TierCacheClient, argparse.Namespace], int],
    client: TierCacheClient,
    args: argparse.Namespace,
) -> int:
    """`command`, which prints a report the server sent: one of another shape than this client
    reads (another release's server, or not a tiercache server) is the client's error (exit
    1), not a traceback. Only the report's reading: an encoding error writing to the terminal,
    or one of the client's own, still says what it is."""
    try:
        return command(client, args)
    except UnicodeError:
        raise
    except (AttributeError, TypeError, ValueError, KeyError) as exc:
        raise UnavailableError(
            f"the server's answer is not what this client reads ({type(exc).__name__}: "
            f"{shown(exc)}); is the server the same tiercache release?"
        ) from None


def shown(value: object) -> str:
    """`value` as text for the terminal: every character `str.isprintable` refuses (escapes,
    line breaks, bidi overrides) written as its escape, e.g. \\x1b."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _feedback(client: TierCacheClient, args: argparse.Namespace) -> int:
    report = client.feedback(args.answer_id, args.verdict, tenant=args.tenant)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return 0
    verdict = shown(report.get("verdict"))
    if "served" in report:
        print(f"{verdict} ({shown(report['served'])}): {shown(report.get('reaches', '?'))}")
    else:  # a deployment that pads some tenant says no more (docs/security.md)
        print(f"{verdict}: accepted")
    return 0


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def summary_line(result: GenerationResult) -> str:
    """The stderr summary, e.g. "[cache: semantic (sim 0.953) | 1.23 ms | first chunk 0.90 ms]"."""
    cache = f"cache: {shown(result.cache_status or 'unknown')}"
    if result.similarity is not None:
        cache += f" (sim {result.similarity:.3f})"
    parts = [cache, f"{result.latency_s * 1000.0:.2f} ms"]
    if result.kv_reused_tokens:
        parts.append(f"prefix KV reused {result.kv_reused_tokens} tokens")
    if result.first_chunk_s is not None:
        parts.append(f"first chunk {result.first_chunk_s * 1000.0:.2f} ms")
    if result.finish_reason and result.finish_reason != "stop":
        parts.append(f"finished: {shown(result.finish_reason)}")
    if result.answer_id:
        parts.append(f"answer {shown(result.answer_id)}")
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
                    "speculated_tokens": item.speculated_tokens,
                    "finish_reason": item.finish_reason,
                    "prompt_tokens": item.prompt_tokens,
                    "completion_tokens": item.completion_tokens,
                    "answer_id": item.answer_id,
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
        print(f"model {shown(name)}: {'ready' if ready else 'not ready'}")
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
                shown(entry.get("name", "")),
                shown(entry.get("task_id", "")),
                shown(digest[:12]),
                shown(entry.get("tier", "")),
                "yes" if digest in engine else "no",
                "yes" if entry.get("pinned") else "no",
            )
        )
    return rows


def _adapters(client: TierCacheClient, args: argparse.Namespace) -> int:
    report = client.adapters(warm=args.warm)
    warmed = report.get("warmed") or {}
    failed = _warm_failures(warmed)  # read before anything is printed
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return 2 if failed else 0
    for name, outcome in sorted(warmed.items()):
        print(f"warm {shown(name)}: {shown(outcome)}")
    header = ("adapter", "task", "digest", "tier", "in engine", "pinned")
    print_table([header, *adapter_rows(report)])
    return 2 if failed else 0


def _warm_failures(warmed: dict) -> int:
    """How many of lora_cache's warm outcomes (`{name: "loaded" | ... | "error: ..."}`) failed."""
    return sum(1 for outcome in warmed.values() if str(outcome).startswith("error"))


def print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


STAT_COLUMNS = ("entries", "bytes", "max_bytes", "hits", "misses", "evictions", "corrupt")


def _stats(client: TierCacheClient, args: argparse.Namespace) -> int:
    report = client.stats()
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return 0
    rows: list[tuple[str, ...]] = [("tier", *STAT_COLUMNS)]
    notes = []
    for tier, values in sorted(report.get("tiers", {}).items()):
        tier = shown(tier)
        if not values.get("reachable", True):
            rows.append((tier, *("-" for _ in STAT_COLUMNS)))
            notes.append(f"{tier}: {shown(values.get('note', 'not reachable'))}")
            continue
        rows.append((tier, *(shown(values.get(c, "")) for c in STAT_COLUMNS)))
    print_table(rows)
    for note in notes:
        print(note)
    return 0


def _invalidate(client: TierCacheClient, args: argparse.Namespace) -> int:
    report = client.invalidate(key=args.key, tag=args.tag, tenant=args.tenant, adapter=args.adapter)
    print(
        f"invalidated {shown(report.get('kind'))}: dropped {shown(report.get('dropped_l2', 0))} "
        f"from L2, {shown(report.get('dropped_l3', 0))} from L3; reaches "
        f"{shown(report.get('reaches', '?'))}"
    )
    return 0


def _flush(client: TierCacheClient, args: argparse.Namespace) -> int:
    if not args.yes:
        print("error: flush deletes every cached answer in L2 and L3: pass --yes", file=sys.stderr)
        return 2
    report = client.flush()
    for tier, count in sorted((report.get("flushed") or {}).items()):
        print(f"flushed {shown(tier)}: {shown(count)} entries")
    return 0


def read_prompts(path: str) -> list[dict]:
    """The JSONL file's objects; InvalidRequestError naming the first bad line."""
    prompts = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except (ValueError, RecursionError) as exc:  # integers past the limit, nesting
                raise InvalidRequestError(f"{path}:{number}: not JSON: {exc}") from None
            if not isinstance(item, dict):
                raise InvalidRequestError(f"{path}:{number}: not a JSON object")
            prompts.append(item)
    return prompts


def _warm(client: TierCacheClient, args: argparse.Namespace) -> int:
    if not args.prompts and not args.adapters:
        print("error: warm needs --prompts FILE.jsonl and/or --adapter NAME", file=sys.stderr)
        return 2
    try:
        prompts = read_prompts(args.prompts) if args.prompts else []
    except (OSError, UnicodeDecodeError) as exc:
        print(f"error: cannot read {args.prompts}: {exc}", file=sys.stderr)
        return 2
    if args.prompts and not prompts:
        print(f"error: {args.prompts} holds no prompts", file=sys.stderr)
        return 2

    def progress(done: int, total: int) -> None:
        if total > WARM_CALL_PROMPTS:  # a file sent in parts: say how far it is
            print(f"warm: {done} of {total} prompts sent", file=sys.stderr)

    report = client.warm(prompts, args.adapters, on_progress=progress)
    warmed = (report.get("adapters") or {}).get("warmed") or {}
    for name, outcome in sorted(warmed.items()):
        print(f"adapter {shown(name)}: {shown(outcome)}")
    failed = _warm_failures(warmed)
    for number, item in enumerate(report.get("prompts") or [], 1):
        if item.get("status") == "stored":
            print(f"prompt {number}: stored {shown(str(item.get('digest', ''))[:16])}")
        else:
            failed += 1
            print(f"prompt {number}: {shown(item.get('error', item.get('status')))}")
    return 2 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI and return its exit code (argparse exits 2 itself on bad arguments)."""
    args = build_parser().parse_args(argv)
    if not 0 < args.timeout < math.inf:  # NaN too
        print("error: --timeout must be > 0 and finite", file=sys.stderr)
        return 2
    if args.idle_timeout is not None and not 0 < args.idle_timeout < math.inf:
        print("error: --idle-timeout must be > 0 and finite", file=sys.stderr)
        return 2
    token = None
    if args.command in ADMIN_COMMANDS:
        try:
            token = read_admin_token(args.admin_token_file)
        except (OSError, ValueError) as exc:
            print(
                f"error: cannot read the admin token: {exc} (`tiercache serve` prints its file "
                "at start; pass it with --admin-token-file)",
                file=sys.stderr,
            )
            return 2
    api_key = None
    if getattr(args, "api_key_file", ""):
        try:
            api_key = Path(args.api_key_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            print(f"error: cannot read the API key: {exc}", file=sys.stderr)
            return 2
        if not api_key.isprintable() or not api_key.isascii():
            print(
                f"error: the API key in {args.api_key_file} holds a line break or a character "
                "an Authorization header cannot carry",
                file=sys.stderr,
            )
            return 2
    try:
        with TierCacheClient(
            args.url,
            model=args.model,
            timeout_s=args.timeout,
            admin_token=token,
            api_key=api_key,
            idle_timeout_s=args.idle_timeout,
        ) as client:
            if args.command == "generate":
                return _generate(client, args)
            reports = {
                "adapters": _adapters,
                "feedback": _feedback,
                "stats": _stats,
                "invalidate": _invalidate,
                "flush": _flush,
                "warm": _warm,
                "health": lambda c, _args: _health(c),
            }
            return _reported(reports[args.command], client, args)
    except (InvalidRequestError, NotFoundError) as exc:
        print(f"error: {shown(exc)}", file=sys.stderr)
        return 2
    except TierCacheClientError as exc:
        print(f"error: {shown(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # `... | head -1`: the reader left; nothing more to say
        with contextlib.suppress(OSError):  # stdout's flush at exit would raise again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
