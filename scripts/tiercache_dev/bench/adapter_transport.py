"""What sending an adapter's files to the engine costs lora_cache and llm, in process.

lora_cache runs on one serving thread: while it closes a large adapter's files for llm (and
seals them), every request queued behind it waits, hits included. Each send, with the
encrypted bodies kept (`transport_cache_bytes`, the default: a version is encrypted once, each
send wraps its data key for the request and copies the body) and without (0: every send
encrypted anew), timed in interleaved rounds: lora_cache's part (`AdapterCipher.close` of both
files, then LORA_SEAL over their seal views, as `LoraCacheStage.outputs` and `.seal` do) and
llm's (the seal checked, both files opened, as `LlmStage.received_lora` does).

    .venv/bin/python -m tiercache_dev.bench.adapter_transport --sizes-mib 2,16,64
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence

from tiercache.stages.seal import LORA_LABEL, PEFT_LORA_INPUTS, Sealer, check_tensors, seal_tensors
from tiercache.stages.transport import AdapterCipher, seal_views

SECRET = b"s" * 32
CONFIG = b'{"r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"]}'


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mib", default="2,16,64", help="adapter weights sizes, MiB")
    parser.add_argument("--sends", type=int, default=10, help="sends timed per round and mode")
    parser.add_argument("--rounds", type=int, default=3)
    return parser.parse_args(argv)


def send(cipher: AdapterCipher, sealer: Sealer, weights: bytes, n: int) -> tuple[float, float]:
    """One send of `weights` for request `n`: lora_cache's seconds, then llm's."""
    bound = f"{n:064x}"  # the envelope's seal this answer is bound to
    started = time.perf_counter()
    values = {
        "LORA_CONFIG": cipher.close("LORA_CONFIG", CONFIG, bound, "version"),
        "LORA_WEIGHTS": cipher.close("LORA_WEIGHTS", weights, bound, "version"),
        "LORA_EVICT": "[]",
    }
    seal = seal_tensors(sealer, LORA_LABEL, PEFT_LORA_INPUTS, seal_views(values), bound=bound)
    sent = time.perf_counter()
    check_tensors(
        sealer, seal, LORA_LABEL, PEFT_LORA_INPUTS, seal_views(values), bound=bound, what="bench"
    )
    opened = cipher.open("LORA_WEIGHTS", values["LORA_WEIGHTS"], bound)
    cipher.open("LORA_CONFIG", values["LORA_CONFIG"], bound)
    done = time.perf_counter()
    assert opened == weights
    return sent - started, done - sent


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    sealer = Sealer.from_secret(SECRET)
    print("| weights | mode | lora_cache ms per send (p50) | llm ms (p50) |")
    print("|---:|---|---:|---:|")
    ratios: dict[int, list[float]] = {}
    for mib in (int(x) for x in args.sizes_mib.split(",")):
        weights = os.urandom(mib << 20)
        modes: dict[str, Callable[[], AdapterCipher]] = {
            "kept (transport_cache_bytes)": lambda: AdapterCipher.from_secret(SECRET, 1 << 30),
            "encrypted per send (0)": lambda: AdapterCipher.from_secret(SECRET, 0),
        }
        times: dict[str, tuple[list[float], list[float]]] = {m: ([], []) for m in modes}
        for round_no in range(args.rounds):
            order = list(modes) if round_no % 2 == 0 else list(reversed(modes))
            for mode in order:
                cipher = modes[mode]()
                send(cipher, sealer, weights, -1)  # the first send encrypts in both modes
                for n in range(args.sends):
                    stage, llm = send(cipher, sealer, weights, n)
                    times[mode][0].append(stage)
                    times[mode][1].append(llm)
        kept, fresh = (statistics.median(times[m][0]) for m in modes)
        ratios[mib] = [kept / fresh]
        for mode, (stage, llm) in times.items():
            print(
                f"| {mib} MiB | {mode} | {statistics.median(stage) * 1e3:.1f} | "
                f"{statistics.median(llm) * 1e3:.1f} |"
            )
    for mib, (ratio,) in ratios.items():
        print(f"{mib} MiB: lora_cache's time per send, kept / encrypted per send: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
