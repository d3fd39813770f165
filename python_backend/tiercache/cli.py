"""`tiercache`: the server-side command line (`tiercache serve`)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from tiercache.config import ADAPTERS_DIR_ENV, default_state_dir
from tiercache.server import Ports, ServerError, TritonServer


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
        code = server.process.wait() if server.process is not None else 1
        print(f"tiercache: tritonserver exited with code {code}", file=sys.stderr)
        return code or 0
    except ServerError as exc:
        print(f"tiercache: {exc}", file=sys.stderr)
        server.stop()
        return 1
    except KeyboardInterrupt:
        print("tiercache: stopping tritonserver", file=sys.stderr)
        return server.stop() or 0


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
        "tritonserver_args", nargs=argparse.REMAINDER, help="after --: passed to tritonserver"
    )
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
    if args.tritonserver_args and args.tritonserver_args[0] == "--":
        args.tritonserver_args = args.tritonserver_args[1:]
    if args.command == "serve":
        return _serve(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
