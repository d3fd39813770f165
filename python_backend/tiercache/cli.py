"""`tiercache`: the server-side command line (`serve`, `keys`, `gateway`, `invalidate`,
`eval-semantic`, `simulate-kv`).

`tiercache serve` is safe by default (docs/security.md): tritonserver on 127.0.0.1 only, no HTTP,
the APIs clients do not need restricted, and cache_admin behind the admin token, whose file it
names at start."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
import unicodedata
from collections.abc import Callable, Sequence
from pathlib import Path

from tiercache.config import ADAPTERS_DIR_ENV, API_KEYS_FILE_ENV, adapters_path, default_state_dir
from tiercache.server import (
    HOST_ENV,
    LOOPBACK,
    RESTRICTABLE_APIS,
    Exposure,
    Ports,
    ServerError,
    StageWatch,
    TritonServer,
    connect_host,
    is_loopback,
    tied_to_this_thread,
)


def exposure_from(args: argparse.Namespace) -> Exposure:
    """What `serve` opens: --host (default loopback), --metrics-host, --http, and every
    restrictable API restricted except those named by --open-api."""
    return Exposure(
        host=args.host,
        metrics_host=args.metrics_host or None,
        http=args.http,
        restricted_apis=tuple(api for api in RESTRICTABLE_APIS if api not in args.open_api),
    )


# tritonserver's own flags that choose where a front end listens, or open one (`serve` sets
# them from --host, --http and --metrics-host, after the flags passed through `--`)
FRONT_END_FLAGS = (
    "--grpc-address",
    "--http-address",
    "--metrics-address",
    "--allow-http",
    "--allow-sagemaker",
    "--allow-vertex-ai",
)


# tritonserver's flags `serve` sets and relies on: a port it probes and points the gateway at,
# the repository and backends it prepared, the exit timeout its stop waits for (passed after
# `--`, Triton took them, and serve waited for a server on another port until it killed it)
SERVE_SET_FLAGS = (
    "--model-repository",
    "--model-store",
    "--backend-directory",
    "--cache-directory",
    "--http-port",
    "--grpc-port",
    "--metrics-port",
    "--exit-timeout-secs",
)


def front_end_flags(
    tritonserver_args: list[str], flags: Sequence[str] = FRONT_END_FLAGS
) -> list[str]:
    """The flags passed after `--` among `flags` (by default those that name a front end's
    address or open one), abbreviated too (Triton's parser takes any unambiguous prefix of an
    option, as getopt_long does)."""
    found = []
    for arg in tritonserver_args:
        name = arg.partition("=")[0]
        if len(name) > len("--") and name.startswith("--"):
            if any(flag.startswith(name) for flag in flags):
                found.append(name)
    return found


def gateway_packages_missing() -> list[str]:
    """The gateway's packages (the `gateway` extra) this install lacks."""
    import importlib.util

    return [name for name in ("starlette", "uvicorn") if importlib.util.find_spec(name) is None]


def _serve(args: argparse.Namespace) -> int:
    from tiercache.admin import ADMIN_TOKEN_FILE_ENV, admin_token_path, load_or_create_admin_token
    from tiercache.errors import ConfigError

    missing = gateway_packages_missing()
    if args.gateway and missing:
        print(
            f"error: the gateway (on by default) needs {', '.join(missing)}, which this "
            "install lacks: install the gateway extra (`pip install 'tiercache[gateway]'`; "
            "`make serve` installs it), or pass --no-gateway to serve Triton's gRPC alone",
            file=sys.stderr,
        )
        return 2
    passed = front_end_flags(args.tritonserver_args)
    if passed:
        print(
            f"error: {', '.join(passed)} after `--`: serve decides where Triton listens and "
            "what it opens (--host, --http, --metrics-host, --open-api; docs/security.md), "
            "and its own flags would override these anyway",
            file=sys.stderr,
        )
        return 2
    owned = front_end_flags(args.tritonserver_args, SERVE_SET_FLAGS)
    if owned:
        print(
            f"error: {', '.join(owned)} after `--`: serve sets these itself and relies on "
            "them (it probes and points the gateway at its ports, stops the server within its "
            "exit timeout); use serve's own --grpc-port, --http-port, --metrics-port, "
            "--exit-timeout-secs and --model-repository",
            file=sys.stderr,
        )
        return 2
    if not is_loopback(args.host) and not args.api_keys and not args.trust_tenants:
        print(
            f"error: --host {args.host} is not loopback and no API key file is configured: "
            "anyone who reaches the port could name any tenant and be served its cached "
            "answers (docs/security.md). Give one (`tiercache keys add`, then --api-keys "
            f"FILE or ${API_KEYS_FILE_ENV}), or pass --trust-tenants if every caller that can "
            "reach it may act as any tenant",
            file=sys.stderr,
        )
        return 2

    state_dir = Path(args.state_dir).resolve()
    from tiercache.exact.stores import make_private_dir

    try:  # 0700 before anything is written in it: it holds every tenant's answers
        make_private_dir(state_dir)
        owner = state_dir.stat().st_uid
    except OSError as exc:
        print(f"tiercache: state dir {state_dir}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    if owner != os.geteuid():
        # Its owner could plant the secret, the admin token or the Python backend's stub
        # binary there (a /tmp path created first by another local user, or a link to theirs)
        print(
            f"tiercache: state dir {state_dir} belongs to uid {owner}, not to this user "
            f"(uid {os.geteuid()}): whoever owns it could plant the server secret, the admin "
            "token or the backend's binaries in it. Use a folder of your own (--state-dir, "
            "$TIERCACHE_STATE_DIR), or chown this one",
            file=sys.stderr,
        )
        return 1
    token_file = (
        Path(args.admin_token_file).absolute()  # not resolved: its links are checked
        if args.admin_token_file
        else admin_token_path(state_dir).absolute()
    )
    try:
        load_or_create_admin_token(token_file)  # there before cache_admin starts: printable now
    except (ConfigError, OSError) as exc:
        print(f"tiercache: admin token: {exc}", file=sys.stderr)
        return 1
    overrides = {ADMIN_TOKEN_FILE_ENV: str(token_file)}  # the stage uses the file printed here
    keys_note = "no API key file: the tenant input is trusted as sent (docs/security.md)"
    if args.api_keys:
        from tiercache.exact.tenant_keys import KeyFile

        keys_file = Path(args.api_keys).absolute()
        try:  # refused too when another user could have chosen it (keys.check_trusted_file)
            tenants = len({g.tenant for g in KeyFile(keys_file).grants()})
        except OSError as exc:
            print(f"tiercache: API key file {keys_file}: {exc.strerror or exc}", file=sys.stderr)
            return 1
        except ConfigError as exc:
            print(f"tiercache: {exc.message}", file=sys.stderr)
            return 1
        overrides[API_KEYS_FILE_ENV] = str(keys_file)
        keys_note = f"API keys from {keys_file} ({tenants} tenants): the key decides the tenant"
    if args.adapters_dir:
        overrides[ADAPTERS_DIR_ENV] = str(Path(args.adapters_dir).resolve())
    exposure = exposure_from(args)
    server = TritonServer(
        model_repository=Path(args.model_repository).resolve(),
        state_dir=state_dir,
        ports=Ports(args.http_port, args.grpc_port, args.metrics_port),
        extra_args=args.tritonserver_args,
        exit_timeout_s=args.exit_timeout_secs,
        env_overrides=overrides,
        exposure=exposure,
        tied=True,  # a supervisor killed leaves no server behind holding the ports
    )
    print(
        f"tiercache: starting tritonserver on {args.model_repository} (state in {args.state_dir})\n"
        f"tiercache: admin token file {token_file} (cache_admin refuses every call without "
        f"it: tiercache-client stats --admin-token-file {token_file})\n"
        f"tiercache: {keys_note}"
    )
    if not is_loopback(exposure.host) or not is_loopback(exposure.metrics_address):
        print(
            f"tiercache: listening on {exposure.host} (metrics on "
            f"{exposure.metrics_address}), not only loopback: reachable from the "
            "network, unencrypted (docs/security.md)",
            file=sys.stderr,
        )
    # Triton binds its ports only once every model has loaded: a busy one showed as an exit
    # minutes later, and one held by another server answered our readiness poll instead
    wanted = [("gRPC", exposure.host, args.grpc_port, "--grpc-port")]
    wanted.append(("metrics", exposure.metrics_address, args.metrics_port, "--metrics-port"))
    if exposure.http:
        wanted.append(("HTTP", exposure.host, args.http_port, "--http-port"))
    # one port named twice passed the probe, then failed only once every model had loaded
    gateway_port = (
        [("OpenAI endpoint", args.gateway_port, "--gateway-port")] if args.gateway else []
    )
    by_port: dict[int, str] = {}
    for name, port, flag in [(n, p, f) for n, _, p, f in wanted] + gateway_port:
        if port in by_port:
            print(
                f"tiercache: {flag} {port} is also {by_port[port]}: give each its own port",
                file=sys.stderr,
            )
            return 1
        by_port[port] = f"the {name} port"
    for name, host, port, flag in wanted:
        busy = _port_in_use(host, port)
        if busy:
            print(
                f"tiercache: the {name} port {port} is in use ({busy}): another tritonserver "
                f"(an earlier `tiercache serve`?), or pick another with {flag}",
                file=sys.stderr,
            )
            return 1
    gateway_host = exposure.host if args.api_keys else LOOPBACK
    if args.gateway:
        from tiercache.gateway.app import metrics_networks

        try:
            metrics_networks(args.gateway_metrics_from)
        except ValueError as exc:
            print(f"tiercache: --gateway-metrics-from: {exc}", file=sys.stderr)
            return 2
        if not is_loopback(exposure.host) and not args.api_keys:
            print(
                "tiercache: the OpenAI endpoint stays on loopback: without an API key file "
                "every caller would be the default tenant (docs/gateway.md)",
                file=sys.stderr,
            )
        busy = _port_in_use(gateway_host, args.gateway_port)
        if busy:
            print(
                f"tiercache: the OpenAI endpoint's port {args.gateway_port} is in use ({busy}); "
                "pick another with --gateway-port, or --no-gateway",
                file=sys.stderr,
            )
            return 1
    gateways: list[subprocess.Popen] = []  # the OpenAI gateway running now (restarted: new)
    # tritonserver runs in its own session, so a terminal's Ctrl-C reaches only us; we forward it
    # as Triton's clean shutdown. SIGTERM and SIGHUP (the terminal or SSH session closed) are
    # treated the same way, from before the start: no server is left holding its ports.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # kept ignored under nohup
        signal.signal(signal.SIGHUP, signal.default_int_handler)
    try:
        server.start()
        server.wait_ready(args.ready_timeout)
        watch = StageWatch(server)
        watch.reset()  # now: a stage that dies while the gateway starts is a death seen
        if args.gateway:
            gateways.append(_start_gateway(args, server, gateway_host))
        grpc = server.grpc_url
        metrics = f"{connect_host(exposure.metrics_address)}:{args.metrics_port}"
        http = (
            f"HTTP {connect_host(exposure.host)}:{args.http_port}" if exposure.http else "no HTTP"
        )
        openai = (
            f"OpenAI endpoint http://{connect_host(gateway_host)}:{args.gateway_port}/v1\n"
            f"  try: curl -s http://{connect_host(gateway_host)}:{args.gateway_port}"
            "/v1/chat/completions -H 'content-type: application/json' -d "
            '\'{"model": "tiercache", "messages": [{"role": "user", "content": '
            '"What is the capital of France?"}]}\'\n'
            if gateways
            else ""
        )
        print(
            f"tiercache: ready. gRPC {grpc}, {http}, metrics http://{metrics}/metrics\n"
            f"{openai}"
            f'  try: tiercache-client generate "What is the capital of France?" --url {grpc}\n'
            "  Ctrl-C stops the server.",
            flush=True,
        )

        def restart_gateway() -> subprocess.Popen:
            if gateways and gateways[0].poll() is None:
                _stop_gateway(gateways[0])
            gateways[:] = [_start_gateway(args, server, gateway_host)]
            return gateways[0]

        code = _supervise(server, args, watch, gateways, restart_gateway)
        if code is not None:
            print(f"tiercache: tritonserver exited with code {code}", file=sys.stderr)
        server.stop()  # stage processes it left behind, in its process group
        return _exit_status(code) if code is not None else 1
    except (ServerError, OSError) as exc:
        print(f"tiercache: {exc}", file=sys.stderr)
        server.stop()
        return 1
    except KeyboardInterrupt:
        print("tiercache: stopping tritonserver", file=sys.stderr)
        return _exit_status(server.stop() or 0)
    finally:
        try:
            for running in gateways:
                _stop_gateway(running)
        finally:
            server.stop()  # whatever ended serve (any exception): no tritonserver left behind


def _exit_status(code: int) -> int:
    """A process's return code as a shell reports it: 128 + the signal that killed it."""
    return 128 - code if code < 0 else code


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 1 to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 1 to 65535, got {value}")
    return value


def positive_seconds(text: str) -> float:
    """An argparse type: seconds, more than 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < math.inf:  # also NaN
        raise argparse.ArgumentTypeError(f"must be more than 0 and finite, got {text}")
    return value


def non_negative_int(text: str) -> int:
    """An argparse type: a whole number, 0 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _port_in_use(host: str, port: int) -> str:
    """Why `port` cannot be listened on at `host` ("" when it can)."""
    import socket

    host = host.strip("[]")  # "[::1]", as --host may write an IPv6 address
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # as uvicorn binds: connections it closed (TIME_WAIT) do not make the port busy
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return ""


GATEWAY_READY_S = 60.0


def _start_gateway(args: argparse.Namespace, server: TritonServer, host: str) -> subprocess.Popen:
    """`tiercache gateway` in front of the started server, in a process of its own (stopped
    with the server), its edge layer on the server's repository and state, in the stages'
    environment (key file, adapters folder); ServerError when it does not listen within
    GATEWAY_READY_S."""
    import urllib.request

    command = [
        sys.executable,
        "-m",
        "tiercache.cli",
        "gateway",
        "--triton-url",
        server.grpc_url,
        "--host",
        host,
        "--port",
        str(args.gateway_port),
        "--model-repository",
        str(server.model_repository),
        "--state-dir",
        str(server.state_dir),
    ]
    # the folder the stages serve (the parameter, else $TIERCACHE_ADAPTERS_DIR, else the state's)
    adapters = adapters_path(args.adapters_dir, Path(args.state_dir).resolve())
    if adapters.is_dir():
        command += ["--adapters-dir", str(adapters.resolve())]
    for network in args.gateway_metrics_from:
        command += ["--metrics-from", network]
    env = {**os.environ, **server.env_overrides}
    process = subprocess.Popen(
        command,
        start_new_session=True,
        env=env,
        preexec_fn=tied_to_this_thread(),  # noqa: PLW1509 - killed with the supervisor
    )
    url = f"http://{connect_host(host)}:{args.gateway_port}/health"
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never a proxy
    deadline = time.monotonic() + GATEWAY_READY_S
    try:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise ServerError(f"the OpenAI endpoint exited with code {process.returncode}")
            try:
                with direct.open(url, timeout=2):
                    return process
            except OSError:  # not listening yet, or 503 while the ensemble loads
                time.sleep(0.2)
        raise ServerError(f"the OpenAI endpoint did not answer {url} within {GATEWAY_READY_S:g} s")
    except BaseException:  # Ctrl-C or SIGTERM while waiting too: no orphan left on the port
        _stop_gateway(process)
        raise


def _stop_gateway(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _restart_allowed(restarts: list[float], most: int, why: str) -> bool:
    """Whether one more restart fits --max-restarts within the last hour (then counted in
    `restarts`, which keeps only that hour); else says why serve stops."""
    now = time.monotonic()
    restarts[:] = [t for t in restarts if now - t < 3600.0]
    if len(restarts) >= most:
        print(
            f"tiercache: {why}; {len(restarts)} restarts in the last hour already "
            "(--max-restarts): stopping",
            file=sys.stderr,
            flush=True,
        )
        return False
    restarts.append(now)
    return True


def _supervise(
    server: TritonServer,
    args: argparse.Namespace,
    watch: StageWatch,
    gateways: list[subprocess.Popen] | None = None,
    restart_gateway: Callable[[], subprocess.Popen] | None = None,
) -> int | None:
    """Wait for tritonserver; meanwhile, unless --no-restart, restart it when one of its stage
    processes dies or stays stopped by a signal (Triton does not restart a dead Python stub,
    and every request through that stage fails until the server restarts), when tritonserver
    itself fails (a stub that died holding its IPC mutex aborts it: docs/faults.md), and when
    a restart fails to come up (the next try counts as a restart too, after a pause of 1, 2,
    4 ... 60 s); and the OpenAI gateway (`gateways[0]`, by `restart_gateway`) when it exits.
    Gives up after --max-restarts restarts within an hour. Returns the exit code of a
    tritonserver that exited cleanly (0) or failed with restarts off; None when it gave up,
    the gateway exited with restarts off (or there was no server). `watch` saw the server's
    stages when it was ready."""
    restarts: list[float] = []
    while True:
        process = server.process
        if process is None:
            return None
        try:
            code: int | None = process.wait(timeout=args.watch_interval_s)
        except subprocess.TimeoutExpired:
            code = None
        if code is None and gateways and gateways[0].poll() is not None:
            gone = f"the OpenAI gateway exited with code {gateways[0].returncode}"
            if not args.restart or restart_gateway is None:
                print(f"tiercache: {gone}: stopping", file=sys.stderr, flush=True)
                server.stop()
                return None
            if not _restart_allowed(restarts, args.max_restarts, gone):
                server.stop()
                return None
            print(f"tiercache: {gone}: starting it again", file=sys.stderr, flush=True)
            try:
                restart_gateway()
            except (ServerError, OSError) as exc:  # tried again at the next look
                print(f"tiercache: the gateway did not start ({exc})", file=sys.stderr)
            continue
        if code is not None:
            if code == 0 or not args.restart:
                return code
            why = f"tritonserver exited with code {code}"
        else:
            dead = watch.dead() if args.restart else {}
            if not dead or process.poll() is not None:
                continue
            names = ", ".join(f"{model} (pid {pid})" for pid, model in sorted(dead.items()))
            why = (
                f"stage process {names} died (or stayed stopped by a signal); Triton does not "
                "restart it, so every request through it would fail"
            )
        started = time.monotonic()
        failures = 0
        while True:  # a restart that does not come up is tried again, counted like the first
            if not _restart_allowed(restarts, args.max_restarts, why):
                server.stop()
                return None  # gave up: serve exits 1, without claiming an exit code of Triton's
            print(
                f"tiercache: {why}: restarting tritonserver (cached answers are on disk)",
                file=sys.stderr,
                flush=True,
            )
            server.stop()  # its --exit-timeout-secs, and 20 s more
            if failures:  # 1, 2, 4 ... 60 s: a cause that lasts minutes (memory, disk) is
                time.sleep(min(60.0, 2.0 ** (failures - 1)))  # not tried through at once
            try:
                server.start()
                server.wait_ready(args.ready_timeout)
                break
            except (ServerError, OSError) as exc:  # a fork that failed (ENOMEM, EAGAIN) too
                failures += 1
                why = f"the restart failed ({exc})"
        watch.reset()
        print(
            f"tiercache: ready again after {time.monotonic() - started:.1f} s "
            f"(restart {len(restarts)})",
            file=sys.stderr,
            flush=True,
        )


def _invalidate(args: argparse.Namespace) -> int:
    """Delete from L3 and tell every replica (they drop their L1/L2 copies): an admin tool, not
    a replica, so it holds no local tier itself. It signs what it publishes with the fleet's
    secret, read from a file ($TIERCACHE_SECRET_FILE, else `<state-dir>/secret`), never Redis."""
    from tiercache.errors import TierCacheError
    from tiercache.exact.invalidation import Invalidator, checked_digest
    from tiercache.exact.keys import tenant_scope
    from tiercache.exact.redis_tier import RedisLink, RedisStore, check_fleet_secret
    from tiercache.exact.request import canonical_tenant, checked_tag
    from tiercache.exact.tiered import TieredCache
    from tiercache.stages.parts import read_host_secret, secret_source
    from tiercache.vocabulary import InvalidationKind, Tier

    try:
        secret = read_host_secret(Path(args.state_dir))
        link = RedisLink.from_url(
            args.redis_url, args.redis_prefix, timeout_s=args.timeout_s, secret=secret
        )
    except TierCacheError as exc:
        print(f"tiercache: {exc.client_message()}", file=sys.stderr)
        return 1
    except ValueError as exc:  # redis-py's for a URL it cannot read (no redis:// scheme)
        print(f"tiercache: --redis-url: {exc}", file=sys.stderr)
        return 2
    cache = TieredCache([(Tier.L3, RedisStore(link))])
    try:
        # Redis away: not checked here, and the Invalidator reports it below.
        check_fleet_secret(link, secret, secret_source(Path(args.state_dir)), register=False)
        if args.key:
            kind, value = InvalidationKind.KEY, checked_digest(args.key, "--key")
        elif args.tag:
            kind, value = InvalidationKind.TAG, checked_tag(args.tag.strip(), "--tag")
        elif args.adapter:
            kind, value = InvalidationKind.ADAPTER, checked_digest(args.adapter, "--adapter")
        else:
            kind = InvalidationKind.TENANT
            # checked and normalized as prompt_cache takes the tenant input
            value = tenant_scope(secret, canonical_tenant(args.tenant))
        report = Invalidator(cache, link).invalidate(kind, value, sweep_shared=not args.no_sweep)
    except TierCacheError as exc:
        print(f"tiercache: {exc.client_message()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            "tiercache: interrupted; the invalidation is published before the L3 sweep starts "
            "(the sweep only frees memory): run the same command again to be sure, which is "
            "safe (a later invalidation of the same value covers all the first one did)",
            file=sys.stderr,
        )
        return 130
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
        help="where the fleet's secret is (<state-dir>/secret; $TIERCACHE_SECRET_FILE wins)",
    )
    inv.add_argument(
        "--no-sweep",
        action="store_true",
        help="do not scan L3 for a tag/tenant/adapter (its entries are never served again and "
        "expire with their TTL)",
    )
    inv.add_argument("--timeout-s", type=positive_seconds, default=2.0)


def _add_gateway(sub: argparse._SubParsersAction) -> None:
    gw = sub.add_parser(
        "gateway", help="an OpenAI-compatible HTTP endpoint over a running tiercache (issue 16)"
    )
    gw.add_argument("--triton-url", default="127.0.0.1:8001", help="Triton's gRPC host:port")
    gw.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface to listen on (default loopback; another only with an API key file: "
        "$TIERCACHE_API_KEYS_FILE set, as `tiercache serve --api-keys` sets it, or "
        "--server-has-api-keys; docs/security.md)",
    )
    gw.add_argument(
        "--server-has-api-keys",
        action="store_true",
        help="the Triton behind this gateway has an API key file (on its host): allow a "
        "non-loopback --host without $TIERCACHE_API_KEYS_FILE here",
    )
    gw.add_argument("--port", type=port_number, default=8080)
    gw.add_argument(
        "--max-connections",
        type=int,
        default=512,
        help="open connections (or running requests) past which a request is a 503 (default 512)",
    )
    gw.add_argument(
        "--max-requests-per-key",
        type=int,
        default=128,
        help="generations and feedback calls one API key may have in flight at once, past "
        "which its next is a 429 (default 128; 0: no limit; requests without a key are not "
        "counted)",
    )
    gw.add_argument(
        "--requests-per-minute-per-key",
        type=int,
        default=0,
        help="generation and feedback requests one API key may send a minute (a burst of that "
        "many, then evenly), past which its next is a 429 with retry-after (default 0: no "
        "limit)",
    )
    gw.add_argument(
        "--metrics-from",
        action="append",
        default=[],
        metavar="NETWORK",
        help="peers GET /metrics answers, anyone else gets a 403 (its counts are every "
        "tenant's volume and hit ratio): addresses or networks (CIDR), comma-separated or "
        "repeated; `any` for everyone (default: loopback, this host only)",
    )
    gw.add_argument("--model-name", default="tiercache", help="the base model's `model` id")
    gw.add_argument(
        "--adapters-dir",
        default=None,
        help="the server's adapters folder: each adapter becomes a `model` id (default: "
        "$TIERCACHE_ADAPTERS_DIR, else none)",
    )
    gw.add_argument("--timeout-s", type=positive_seconds, default=300.0, help="a whole generation")
    gw.add_argument(
        "--model-repository",
        default=None,
        help="the model repository Triton serves, on this host: the edge layer then answers "
        "exact hits from the host's tiers without crossing Triton (default: none, every request "
        "goes to Triton; docs/gateway.md)",
    )
    gw.add_argument(
        "--state-dir",
        default=None,
        help="with --model-repository: the stages' state folder when their parameters name "
        "none (default: $TIERCACHE_STATE_DIR, else ~/.cache/tiercache, as the stages resolve it)",
    )


def _gateway(args: argparse.Namespace) -> int:
    missing = gateway_packages_missing()
    if missing:
        print(
            f"error: the gateway needs {', '.join(missing)}, which this install lacks: install "
            "the gateway extra (`pip install 'tiercache[gateway]'`)",
            file=sys.stderr,
        )
        return 2
    import uvicorn  # the gateway's server: imported only for this command

    from tiercache.gateway.app import GatewaySettings, metrics_networks, server_config

    keys_file = os.environ.get(API_KEYS_FILE_ENV, "")
    if not is_loopback(args.host) and not (keys_file or args.server_has_api_keys):
        print(
            f"error: --host {args.host} is not loopback and no API key file is configured: every "
            "caller would be the default tenant (docs/security.md); give the server one "
            f"(`tiercache serve --api-keys FILE`, ${API_KEYS_FILE_ENV} here), or pass "
            "--server-has-api-keys when the Triton behind this gateway has one",
            file=sys.stderr,
        )
        return 2
    if args.max_connections < 1:
        print("error: --max-connections must be at least 1", file=sys.stderr)
        return 2
    if args.max_requests_per_key < 0:
        print("error: --max-requests-per-key must be 0 (no limit) or more", file=sys.stderr)
        return 2
    if args.requests_per_minute_per_key < 0:
        print("error: --requests-per-minute-per-key must be 0 (no limit) or more", file=sys.stderr)
        return 2
    try:
        metrics_from = metrics_networks(args.metrics_from)
    except ValueError as exc:
        print(f"error: --metrics-from: {exc}", file=sys.stderr)
        return 2
    adapters_dir = args.adapters_dir or os.environ.get(ADAPTERS_DIR_ENV) or ""
    names: frozenset[str] = frozenset()
    if adapters_dir:
        folder = Path(adapters_dir)
        if not folder.is_dir():
            print(f"error: --adapters-dir {adapters_dir} is not a folder", file=sys.stderr)
            return 2
        names = frozenset(p.name for p in folder.iterdir() if (p / "adapter_config.json").is_file())
    if args.model_name in names:
        print(f"error: --model-name {args.model_name!r} is also an adapter's name", file=sys.stderr)
        return 2
    repository = Path(args.model_repository).resolve() if args.model_repository else None
    if repository is not None and not (repository / "prompt_cache" / "config.pbtxt").is_file():
        print(
            f"error: --model-repository {args.model_repository} has no prompt_cache stage",
            file=sys.stderr,
        )
        return 2
    settings = GatewaySettings(
        triton_url=args.triton_url,
        base_model=args.model_name,
        adapters=names,
        timeout_s=args.timeout_s,
        max_connections=args.max_connections,
        max_requests_per_key=args.max_requests_per_key,
        requests_per_minute_per_key=args.requests_per_minute_per_key,
        model_repository=repository,
        state_dir=Path(args.state_dir).resolve() if args.state_dir else None,
        metrics_from=metrics_from,
    )
    edge = f"edge layer on {repository}" if repository else "no edge layer"
    print(
        f"tiercache gateway: http://{args.host}:{args.port}/v1 -> {args.triton_url} "
        f"(models: {', '.join([args.model_name, *sorted(names)])}; {edge})",
        flush=True,
    )
    uvicorn.Server(server_config(settings, args.host, args.port)).run()
    return 0


def _add_keys(sub: argparse._SubParsersAction) -> None:
    keys = sub.add_parser("keys", help="API keys -> tenants (docs/security.md)")
    keys.add_argument(
        "--file",
        default="",
        help="the key file (default: $TIERCACHE_API_KEYS_FILE, else <state dir>/api_keys.json)",
    )
    keys.add_argument("--state-dir", default=str(default_state_dir()))
    ops = keys.add_subparsers(dest="keys_command", required=True)
    add = ops.add_parser("add", help="make a key for a tenant; prints it once")
    add.add_argument("--tenant", required=True)
    add.add_argument(
        "--adapters",
        default=None,
        help="comma-separated adapter names the key may use (default: any; '' for none)",
    )
    add.add_argument(
        "--cache-control",
        default=None,
        help="comma-separated cache_control words the key may use (default: any; '' for none)",
    )
    ops.add_parser("list", help="key ids and their tenants (never the keys)")
    revoke = ops.add_parser("revoke", help="remove a key by its id")
    revoke.add_argument("key_id")


def _keys(args: argparse.Namespace) -> int:
    """`tiercache keys add|list|revoke`: the key file prompt_cache reads (re-read within a
    second of a change, so no restart)."""

    from tiercache.errors import ConfigError
    from tiercache.exact.tenant_keys import add_key, list_grants, revoke_key

    named = args.file or os.environ.get(API_KEYS_FILE_ENV, "")
    path = Path(named) if named else Path(args.state_dir) / "api_keys.json"

    def names(value: str | None) -> list[str] | None:
        return None if value is None else [n.strip() for n in value.split(",") if n.strip()]

    try:
        if args.keys_command == "add":
            tenant = unicodedata.normalize("NFKC", args.tenant).strip()  # as prompt_cache does
            key, grant = add_key(path, tenant, names(args.adapters), names(args.cache_control))
            print(key)  # alone on stdout: `tiercache keys add ... > tenant.key` is the key file
            print(f"(key id {grant.key_id}, tenant {grant.tenant!r}; stored hashed in {path}: "
                  "this is the only time the key is shown)", file=sys.stderr)  # fmt: skip
            return 0
        if args.keys_command == "list":
            for grant in list_grants(path):
                limits = [
                    f"{what}={'any' if allowed is None else ','.join(sorted(allowed)) or 'none'}"
                    for what, allowed in (
                        ("adapters", grant.adapters),
                        ("cache_control", grant.cache_control),
                    )
                ]
                print("\t".join([grant.key_id, grant.tenant, *limits]))
            return 0
        if revoke_key(path, args.key_id):
            print(f"revoked {args.key_id}")
            return 0
        print(f"tiercache: no key {args.key_id!r} in {path}", file=sys.stderr)
        return 1
    except ConfigError as exc:
        print(f"tiercache: {exc.message}", file=sys.stderr)
        return 1
    except OSError as exc:  # a folder that cannot be made, a path whose parent is a file
        print(f"tiercache: key file {path}: {exc.strerror or exc}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    """The `tiercache` command line (serve, invalidate, keys, gateway, eval-semantic,
    simulate-kv)."""
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
    serve.add_argument(
        "--host",
        default=os.environ.get(HOST_ENV) or LOOPBACK,
        help="address gRPC (and HTTP with --http) listen on (default: $TIERCACHE_HOST, else "
        "127.0.0.1: this host only); 0.0.0.0 is every interface (docs/security.md)",
    )
    serve.add_argument(
        "--trust-tenants",
        action="store_true",
        help="allow a non-loopback --host without an API key file: the tenant input is then "
        "trusted as sent by anyone who reaches the port (docs/security.md)",
    )
    serve.add_argument(
        "--metrics-host",
        default="",
        help="address the metrics port listens on (default: --host if it is loopback, else "
        "127.0.0.1: the metrics tell hits from misses; docs/security.md)",
    )
    serve.add_argument(
        "--http",
        action="store_true",
        help="also serve Triton's HTTP/REST front end (off by default: tiercache's clients use "
        "gRPC, and Triton 2.51's HTTP front end has known CVEs)",
    )
    serve.add_argument(
        "--open-api",
        action="append",
        default=[],
        choices=RESTRICTABLE_APIS,
        help="open this Triton API group to every client (restricted by default; repeatable), "
        "e.g. model-config for perf_analyzer",
    )
    serve.add_argument(
        "--admin-token-file",
        default="",
        help="the admin token file cache_admin checks (default: $TIERCACHE_ADMIN_TOKEN_FILE, "
        "else <state dir>/admin_token; created 0600 if missing)",
    )
    serve.add_argument(
        "--api-keys",
        default=os.environ.get(API_KEYS_FILE_ENV, ""),
        metavar="FILE",
        help="API key file (`tiercache keys add`): each request's tenant comes from its "
        "`authorization: Bearer <key>` header (default: $TIERCACHE_API_KEYS_FILE; none: the "
        "tenant input is trusted as sent)",
    )
    serve.add_argument("--http-port", type=port_number, default=8000)
    serve.add_argument("--grpc-port", type=port_number, default=8001)
    serve.add_argument("--metrics-port", type=port_number, default=8002)
    serve.add_argument(
        "--gateway-port",
        type=port_number,
        default=8080,
        help="the OpenAI-compatible endpoint's port (`tiercache gateway`, docs/gateway.md)",
    )
    serve.add_argument(
        "--gateway-metrics-from",
        action="append",
        default=[],
        metavar="NETWORK",
        help="peers the OpenAI endpoint's GET /metrics answers (`tiercache gateway "
        "--metrics-from`; default loopback)",
    )
    serve.add_argument(
        "--no-gateway",
        dest="gateway",
        action="store_false",
        help="do not start the OpenAI-compatible endpoint",
    )
    serve.add_argument("--exit-timeout-secs", type=non_negative_int, default=10)
    serve.add_argument("--ready-timeout", type=positive_seconds, default=600.0)
    serve.add_argument(
        "--no-restart",
        dest="restart",
        action="store_false",
        help="do not restart tritonserver when one of its stage processes dies",
    )
    serve.add_argument(
        "--max-restarts",
        type=non_negative_int,
        default=5,
        help="restarts allowed within an hour before giving up (default 5)",
    )
    serve.add_argument(
        "--watch-interval-s",
        type=positive_seconds,
        default=2.0,
        help="how often stage processes are checked (default 2 s)",
    )
    serve.add_argument(
        "tritonserver_args", nargs=argparse.REMAINDER, help="after --: passed to tritonserver"
    )
    _add_invalidate(sub)
    _add_keys(sub)
    _add_gateway(sub)
    sub.add_parser(
        "eval-semantic",
        help="evaluate the semantic cache's guard on a pairs file (see --help)",
        add_help=False,
    )
    sim = sub.add_parser(
        "simulate-kv",
        help="replay a KV-block trace (Mooncake's format) against eviction policies",
    )
    sim.add_argument("--trace", type=Path, required=True, help="JSON lines with hash_ids")
    sim.add_argument(
        "--capacity-blocks", type=int, nargs="+", required=True, help="pool sizes, in blocks"
    )
    sim.add_argument(
        "--policy",
        action="append",
        help="another policy to replay, told the capacity: gdsf or shadow (lru, belady and "
        "default, the pool's own, always are)",
    )
    sim.add_argument(
        "--block-tokens",
        type=int,
        default=512,
        help="tokens per block, for the prefill saved (Mooncake's traces: 512)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "eval-semantic":
        from tiercache.semantic.evaluate import main_eval_semantic  # loads the embedder: lazy

        return main_eval_semantic(argv[1:])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.command == "invalidate":
        return _invalidate(args)
    if args.command == "keys":
        return _keys(args)
    if args.command == "gateway":
        return _gateway(args)
    if args.command == "simulate-kv":
        from tiercache.kv_simulation import main_simulate_kv

        return main_simulate_kv(args)
    if args.tritonserver_args and args.tritonserver_args[0] == "--":
        args.tritonserver_args = args.tritonserver_args[1:]
    if args.command == "serve":
        return _serve(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
