"""`tiercache`: the server-side command line (`tiercache serve`, `tiercache invalidate`)."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import subprocess
import sys
import time
import unicodedata
from pathlib import Path
from typing import Any

from tiercache.config import ADAPTERS_DIR_ENV, default_state_dir
from tiercache.server import Ports, ServerError, StageWatch, TritonServer


def _serve(args: argparse.Namespace) -> int:
    server = TritonServer(
        model_repository=Path(args.model_repository).resolve(),
        state_dir=Path(args.state_dir).resolve(),
        ports=Ports(args.http_port, args.grpc_port, args.metrics_port),
        extra_args=args.tritonserver_args,
        exit_timeout_s=args.exit_timeout_secs,
        env_overrides=(
            {ADAPTERS_DIR_ENV: str(Path(args.adapters_dir).resolve())} if args.adapters_dir else {}
        ),
    )
    print(
        f"tiercache: starting tritonserver on {args.model_repository} (state in {args.state_dir})"
    )
    server.start()
    # tritonserver runs in its own session, so a terminal's Ctrl-C reaches only us; we forward it
    # as Triton's clean shutdown. SIGTERM is treated the same way.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        server.wait_ready(args.ready_timeout)
        print(
            f"tiercache: ready. gRPC localhost:{args.grpc_port}, HTTP localhost:{args.http_port}, "
            f"metrics http://localhost:{args.metrics_port}/metrics\n"
            f'  try: tiercache-client generate "What is the capital of France?" '
            f"--url localhost:{args.grpc_port}\n"
            "  Ctrl-C stops the server.",
            flush=True,
        )
        code = _supervise(server, args)
        print(f"tiercache: tritonserver exited with code {code}", file=sys.stderr)
        return code or 0
    except ServerError as exc:
        print(f"tiercache: {exc}", file=sys.stderr)
        server.stop()
        return 1
    except KeyboardInterrupt:
        print("tiercache: stopping tritonserver", file=sys.stderr)
        return server.stop() or 0


def _supervise(server: TritonServer, args: argparse.Namespace) -> int:
    """Wait for tritonserver to exit; meanwhile, unless --no-restart, restart it when one of its
    stage processes dies (Triton does not restart a dead Python stub, and every request through
    that stage fails until the server restarts). Gives up after --max-restarts restarts within
    an hour. Returns tritonserver's exit code."""
    watch = StageWatch(server)
    watch.reset()
    restarts: list[float] = []
    while True:
        process = server.process
        if process is None:
            return 1
        try:
            return process.wait(timeout=args.watch_interval_s)
        except subprocess.TimeoutExpired:
            pass
        dead = watch.dead() if args.restart else {}
        if not dead or process.poll() is not None:
            continue
        now = time.monotonic()
        restarts = [t for t in restarts if now - t < 3600.0]
        names = ", ".join(f"{model} (pid {pid})" for pid, model in sorted(dead.items()))
        if len(restarts) >= args.max_restarts:
            print(
                f"tiercache: stage process {names} died; {len(restarts)} restarts in the last "
                "hour already (--max-restarts): stopping",
                file=sys.stderr,
                flush=True,
            )
            server.stop()
            return 1
        restarts.append(now)
        print(
            f"tiercache: stage process {names} died; Triton does not restart it, so every "
            "request through it would fail: restarting tritonserver (cached answers are on disk)",
            file=sys.stderr,
            flush=True,
        )
        started = time.monotonic()
        server.stop(timeout_s=args.exit_timeout_secs + 20)
        server.start()
        server.wait_ready(args.ready_timeout)
        watch.reset()
        print(
            f"tiercache: ready again after {time.monotonic() - started:.1f} s "
            f"(restart {len(restarts)})",
            file=sys.stderr,
            flush=True,
        )


def _invalidate(args: argparse.Namespace) -> int:
    """Delete from L3 and tell every replica (they drop their L1/L2 copies): an admin tool, not
    a replica, so it holds no local tier itself."""
    from tiercache.errors import TierCacheError
    from tiercache.exact.invalidation import Invalidator, checked_digest
    from tiercache.exact.keys import load_or_create_secret, tenant_scope
    from tiercache.exact.redis_tier import RedisLink, RedisStore
    from tiercache.exact.tiered import TieredCache
    from tiercache.vocabulary import InvalidationKind, Tier

    link = RedisLink.from_url(args.redis_url, args.redis_prefix, timeout_s=args.timeout_s)
    cache = TieredCache([(Tier.L3, RedisStore(link))])
    try:
        if args.key:
            kind, value = InvalidationKind.KEY, checked_digest(args.key, "--key")
        elif args.tag:
            kind, value = InvalidationKind.TAG, args.tag
        elif args.adapter:
            kind, value = InvalidationKind.ADAPTER, checked_digest(args.adapter, "--adapter")
        else:
            kind = InvalidationKind.TENANT
            stored: Any = link.call_or_raise(lambda c: c.get(link.key("secret")))
            if stored:
                secret = bytes(stored)  # the replicas' shared secret
            else:
                secret = load_or_create_secret(Path(args.state_dir) / "secret")
            # normalized as prompt_cache normalizes the tenant input (tiercache.exact.request)
            value = tenant_scope(secret, unicodedata.normalize("NFKC", args.tenant).strip())
        report = Invalidator(cache, link).invalidate(kind, value, sweep_shared=not args.no_sweep)
    except TierCacheError as exc:
        print(f"tiercache: {exc.client_message()}", file=sys.stderr)
        return 1
    finally:
        cache.close()
    inv = report.invalidation
    print(
        json.dumps(
            {
                "kind": inv.kind.value,
                "value": inv.value,
                "at_s": inv.at_s,
                "dropped_l3": report.dropped_shared,
                "published": report.published,
            }
        )
    )
    return 0


def _add_invalidate(sub: argparse._SubParsersAction) -> None:
    inv = sub.add_parser(
        "invalidate",
        help="drop cached answers by key, tag, tenant or adapter on every replica (needs Redis)",
    )
    what = inv.add_mutually_exclusive_group(required=True)
    what.add_argument("--key", help="an exact-cache digest")
    what.add_argument("--tag", help="a cache_control tag (tag=NAME)")
    what.add_argument("--tenant", help="a tenant name (its scope uses the replicas' secret)")
    what.add_argument("--adapter", help="a LoRA adapter's content digest")
    inv.add_argument("--redis-url", required=True, help="the replicas' redis_url")
    inv.add_argument("--redis-prefix", default="tiercache:", help="the replicas' redis_prefix")
    inv.add_argument(
        "--state-dir",
        default=str(default_state_dir()),
        help="--tenant only: where the secret is when Redis holds none",
    )
    inv.add_argument(
        "--no-sweep",
        action="store_true",
        help="do not scan L3 for a tag/tenant/adapter (its entries are never served again and "
        "expire with their TTL)",
    )
    inv.add_argument("--timeout-s", type=float, default=2.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tiercache", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the model repository with tritonserver")
    serve.add_argument("--model-repository", default="model_repository")
    serve.add_argument("--state-dir", default=str(default_state_dir()))
    serve.add_argument(
        "--adapters-dir",
        default="",
        help="LoRA adapters folder, one PEFT folder per adapter (default: $TIERCACHE_ADAPTERS_DIR, "
        "else <state dir>/adapters)",
    )
    serve.add_argument("--http-port", type=int, default=8000)
    serve.add_argument("--grpc-port", type=int, default=8001)
    serve.add_argument("--metrics-port", type=int, default=8002)
    serve.add_argument("--exit-timeout-secs", type=int, default=10)
    serve.add_argument("--ready-timeout", type=float, default=600.0)
    serve.add_argument(
        "--no-restart",
        dest="restart",
        action="store_false",
        help="do not restart tritonserver when one of its stage processes dies",
    )
    serve.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="restarts allowed within an hour before giving up (default 5)",
    )
    serve.add_argument(
        "--watch-interval-s",
        type=float,
        default=2.0,
        help="how often stage processes are checked (default 2 s)",
    )
    serve.add_argument(
        "tritonserver_args", nargs=argparse.REMAINDER, help="after --: passed to tritonserver"
    )
    _add_invalidate(sub)
    sub.add_parser(
        "eval-semantic",
        help="evaluate the semantic cache's guard on a pairs file (see --help)",
        add_help=False,
    )
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "eval-semantic":
        from tiercache.semantic.evaluate import main_eval_semantic  # loads the embedder: lazy

        return main_eval_semantic(argv[1:])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.command == "invalidate":
        return _invalidate(args)
    if args.tritonserver_args and args.tritonserver_args[0] == "--":
        args.tritonserver_args = args.tritonserver_args[1:]
    if args.command == "serve":
        return _serve(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
