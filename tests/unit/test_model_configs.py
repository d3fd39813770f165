"""Every Triton model config in the repository against Triton's schema, the GPU repository that
deploy/tensorrt_llm/assemble_repository.py writes, and the engine build command.

Nothing here runs Triton or TensorRT-LLM: configs are parsed with tritonclient's
`model_config_pb2.ModelConfig` (the schema tritonserver loads), tensor names and types are checked
between the ensemble's steps and between llm's requests and the `tensorrt_llm` model, and the
build script's commands are checked, not run.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from tiercache.adapter_types import AdapterRef, TrtllmLora, TrtllmRequestLora, engine_task_id
from tiercache.engine.trtllm_client import REQUESTED_OUTPUTS, TrtllmClient
from tiercache.exact.request import GenerationRequest
from tiercache.exact.tenant_keys import add_key

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "tensorrt_llm"
CONFIGS = sorted(
    [
        *(ROOT / "model_repository").glob("*/config.pbtxt"),
        *(ROOT / "deploy").rglob("config.pbtxt"),
        *(ROOT / "scripts" / "bench_fixtures").rglob("config.pbtxt"),
    ]
)
NUMPY_TYPES = {
    np.dtype(np.int32): mc.TYPE_INT32,
    np.dtype(np.int64): mc.TYPE_INT64,
    np.dtype(np.uint64): mc.TYPE_UINT64,
    np.dtype(np.float16): mc.TYPE_FP16,
    np.dtype(np.float32): mc.TYPE_FP32,
    np.dtype(np.bool_): mc.TYPE_BOOL,
}


def load_script(name: str) -> ModuleType:
    module_name = f"tiercache_deploy_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, DEPLOY / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def assemble() -> ModuleType:
    return load_script("assemble_repository")


@pytest.fixture(scope="module")
def build() -> ModuleType:
    return load_script("build_engine")


@pytest.fixture(scope="module")
def gpu_repo(tmp_path_factory: pytest.TempPathFactory, assemble: ModuleType) -> Path:
    out = tmp_path_factory.mktemp("gpu") / "repository"
    assemble.assemble(out)
    return Path(out)


def parse(path: Path) -> Any:
    return text_format.Parse(path.read_text(), mc.ModelConfig())


def configs_of(repository: Path) -> dict[str, Any]:
    return {p.parent.name: parse(p) for p in sorted(repository.glob("*/config.pbtxt"))}


def params(config: Any) -> dict[str, str]:
    return {k: v.string_value for k, v in config.parameters.items()}


def by_name(tensors: Any) -> dict[str, Any]:
    return {t.name: t for t in tensors}


# -- every committed config -------------------------------------------------------------------


def test_the_configs_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in CONFIGS}
    assert "model_repository/ensemble/config.pbtxt" in names
    assert "deploy/tensorrt_llm/tensorrt_llm/config.pbtxt" in names
    assert "scripts/bench_fixtures/response_cache/echo/config.pbtxt" in names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_config_parses_against_tritons_schema(path: Path) -> None:
    text = path.read_text()
    assert "${" not in text, "an unfilled placeholder would reach the served config"
    config = parse(path)
    assert config.name == path.parent.name
    assert config.backend or config.platform
    for tensor in [*config.input, *config.output]:
        assert tensor.data_type != mc.TYPE_INVALID, tensor.name
        assert list(tensor.dims), f"{tensor.name} has no dims"
    if config.model_transaction_policy.decoupled:
        assert config.backend in ("python", "tensorrtllm")


def test_cpu_repository_lines_up(assemble: ModuleType) -> None:
    assemble.check_repository(ROOT / "model_repository")


@pytest.mark.parametrize("which", ["cpu", "gpu"])
def test_an_exact_hits_text_goes_from_prompt_cache_to_llm(which: str, gpu_repo: Path) -> None:
    """llm's EXACT_TEXT and EXACT_TOKENS are optional (a stage may be called without them), so
    the checker would not miss them: a dropped mapping would refuse every exact hit. Each is
    prompt_cache's output of the same type and shape, in both ensembles."""
    repository = ROOT / "model_repository" if which == "cpu" else gpu_repo
    configs = configs_of(repository)
    steps = {step.model_name: step for step in configs["ensemble"].ensemble_scheduling.step}
    sent = {v: k for k, v in steps["prompt_cache"].output_map.items()}
    produced = by_name(configs["prompt_cache"].output)
    consumed = by_name(configs["llm"].input)
    for ours, theirs in (("EXACT_TEXT", "CACHED_TEXT"), ("EXACT_TOKENS", "CACHED_TOKENS")):
        assert sent[steps["llm"].input_map[ours]] == theirs
        assert consumed[ours].data_type == produced[theirs].data_type
        assert list(consumed[ours].dims) == list(produced[theirs].dims)


def test_committed_stage_parameters_are_ones_the_stages_accept() -> None:
    from tiercache.config import STAGE_CONFIGS, parse_config

    for name, config in configs_of(ROOT / "model_repository").items():
        if name in STAGE_CONFIGS:
            parse_config(STAGE_CONFIGS[name], params(config))


def test_a_copied_repository_overrides_a_committed_parameter_once(tmp_path: Path) -> None:
    """copy_repository (benchmarks, tests) replaces a parameter the committed config sets, so
    the key appears once, and appends one it does not."""
    from tiercache.server import copy_repository

    values = {"torch_threads": "2", "kv_reuse": "false"}
    out = copy_repository(ROOT / "model_repository", tmp_path / "r", {"torch_llm": values})
    text = (out / "torch_llm" / "config.pbtxt").read_text()
    assert text.count('key: "torch_threads"') == 1
    assert params(configs_of(out)["torch_llm"]) == values


# -- the GPU repository -----------------------------------------------------------------------


def test_gpu_repository_models(gpu_repo: Path) -> None:
    names = sorted(p.name for p in gpu_repo.iterdir())
    assert names == [
        "cache_admin",
        "embedder",
        "embedding_cache",
        "ensemble",
        "feedback",
        "llm",
        "lora_cache",
        "prompt_cache",
        "tensorrt_llm",
    ]
    assert (gpu_repo / "tensorrt_llm" / "1").is_dir()
    assert not list(gpu_repo.rglob("__pycache__"))


def test_no_placeholder_in_the_gpu_repository(gpu_repo: Path) -> None:
    for path in gpu_repo.rglob("*"):
        if path.is_file() and path.suffix in (".pbtxt", ".py", ".json"):
            assert "${" not in path.read_text(), path


def test_gpu_configs_parse_and_point_inside_the_repository(gpu_repo: Path) -> None:
    configs = configs_of(gpu_repo)
    trt = params(configs["tensorrt_llm"])
    assert trt["gpt_model_path"] == str(gpu_repo / "tensorrt_llm" / "1")
    llm = params(configs["llm"])
    assert llm["engine_kind"] == llm["engine_model"] == "tensorrt_llm"
    assert llm["tokenizer_dir"] == str(gpu_repo / "tensorrt_llm" / "tokenizer")
    assert int(llm["trtllm_max_input_len"]) == 4096 and int(llm["trtllm_max_seq_len"]) == 5120
    lora = params(configs["lora_cache"])
    assert lora["engine_kind"] == lora["engine_model"] == "tensorrt_llm"
    assert lora["trtllm_dtype"] == "float16" and "prefetch" not in lora


def test_stage_parameters_are_ones_the_stages_accept(gpu_repo: Path) -> None:
    from tiercache.config import LlmConfig, LoraCacheConfig, parse_config

    configs = configs_of(gpu_repo)
    llm = parse_config(LlmConfig, params(configs["llm"]))
    assert llm.engine_kind == "tensorrt_llm" and llm.trtllm_max_seq_len == 5120
    lora = parse_config(LoraCacheConfig, params(configs["lora_cache"]))
    assert lora.engine_kind == "tensorrt_llm"


def test_gpu_ensemble_lines_up(gpu_repo: Path, assemble: ModuleType) -> None:
    configs = configs_of(gpu_repo)
    assert assemble.ensemble_problems(configs["ensemble"], configs) == []
    steps = {s.model_name: s for s in configs["ensemble"].ensemble_scheduling.step}
    assert [s.model_name for s in configs["ensemble"].ensemble_scheduling.step] == [
        "prompt_cache",
        "embedding_cache",
        "lora_cache",
        "llm",
    ]
    for name in ("LORA_TASK_ID", "LORA_TRT_WEIGHTS", "LORA_TRT_CONFIG"):
        assert steps["lora_cache"].output_map[name] == steps["llm"].input_map[name]
    for name in ("LORA_CONFIG", "LORA_WEIGHTS", "LORA_EVICT"):
        assert name not in steps["llm"].input_map


def test_lora_tensors_keep_their_type_from_lora_cache_to_llm_and_the_task_id_to_the_engine(
    gpu_repo: Path,
) -> None:
    configs = configs_of(gpu_repo)
    produced = by_name(configs["lora_cache"].output)
    consumed = by_name(configs["llm"].input)
    engine = by_name(configs["tensorrt_llm"].input)
    for ours in ("LORA_TASK_ID", "LORA_TRT_WEIGHTS", "LORA_TRT_CONFIG"):
        assert consumed[ours].optional  # absent for base-model requests and hits
        assert produced[ours].data_type == consumed[ours].data_type
        assert list(produced[ours].dims) == list(consumed[ours].dims)
    task_id = engine["lora_task_id"]
    assert produced["LORA_TASK_ID"].data_type == task_id.data_type
    assert list(produced["LORA_TASK_ID"].dims) == list(task_id.dims)
    # the arrays travel encrypted (bytes); llm opens them into the engine's types
    for ours in ("LORA_TRT_WEIGHTS", "LORA_TRT_CONFIG"):
        assert produced[ours].data_type == mc.TYPE_STRING
        assert list(produced[ours].dims) == [1]
    assert engine["lora_weights"].data_type == mc.TYPE_FP16
    assert engine["lora_config"].data_type == mc.TYPE_INT32


class CountingTokenizer:
    """Enough of a tokenizer for request building: one id per character."""

    eos_token_id = 2
    unk_token_id = 0
    pad_token_id = 2

    def convert_tokens_to_ids(self, token: str) -> int:
        return 2 if token == "<|im_end|>" else 0

    def apply_chat_template(self, messages: Any, **kwargs: Any) -> dict[str, list[int]]:
        return {"input_ids": [1] + [10 + ord(c) % 50 for c in messages[0]["content"]] + [2]}

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return [10 + ord(c) % 50 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids if i >= 10)


def engine_shape_fits(array: np.ndarray, tensor: Any, max_batch_size: int) -> bool:
    """A request tensor against a config tensor: batch dimension, then dims (-1 matches any)."""
    dims = list(tensor.dims)
    if array.shape[0] != 1 or array.shape[0] > max_batch_size or len(array.shape) != len(dims) + 1:
        return False
    return all(d == -1 or d == n for d, n in zip(dims, array.shape[1:], strict=True))


@pytest.mark.parametrize(
    "request_",
    [
        GenerationRequest("Hi", max_tokens=8),
        GenerationRequest("Hi", temperature=0.7, top_k=4, top_p=0.9, seed=3, stop_words=("x",)),
        GenerationRequest("Hi", lora_name="french", lora_task_id=3, lora_digest="ab" * 32),
    ],
    ids=["greedy", "sampled", "adapter"],
)
def test_llm_requests_match_the_tensorrt_llm_inputs(request_: GenerationRequest) -> None:
    config = parse(DEPLOY / "tensorrt_llm" / "config.pbtxt")
    inputs = by_name(config.input)
    lora = None
    if request_.lora_digest:
        ref = AdapterRef(request_.lora_name, request_.lora_task_id, request_.lora_digest)
        weights = np.zeros((2, 8), dtype=np.float16)
        lora = TrtllmRequestLora(
            engine_task_id(ref), TrtllmLora(weights, np.zeros((2, 3), np.int32))
        )
    tensors = TrtllmClient(CountingTokenizer()).request(request_, lora).tensors
    for name, array in tensors.items():
        assert name in inputs, f"{name} is not an input of tensorrt_llm"
        assert NUMPY_TYPES[array.dtype] == inputs[name].data_type, name
        assert engine_shape_fits(array, inputs[name], config.max_batch_size), (name, array.shape)
    required = {n for n, t in inputs.items() if not t.optional}
    assert required <= set(tensors)
    assert set(REQUESTED_OUTPUTS) <= set(by_name(config.output))


def test_speculative_steps_match_the_tensorrt_llm_inputs() -> None:
    """Every tensor of a speculative step (draft_input_ids, streaming off, the resent ids) is an
    input of tensorrt_llm, of its type and shape."""
    config = parse(DEPLOY / "tensorrt_llm" / "config.pbtxt")
    inputs = by_name(config.input)
    client = TrtllmClient(CountingTokenizer(), max_draft_len=8)
    request = GenerationRequest("Hi", max_tokens=8, drafts=(("answer", "Hello there"),))
    sent: list[dict[str, np.ndarray]] = []

    def engine(tensors: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        sent.append(tensors)
        draft = tensors["draft_input_ids"].reshape(-1).tolist()
        ids = np.array([[draft + [2]]], dtype=np.int32)  # the whole draft, then the end id
        return [{"output_ids": ids, "sequence_length": np.array([[ids.shape[-1]]], np.int32)}]

    list(client.speculative_events(request, client.request(request), engine))
    assert sent and "draft_input_ids" in sent[0]
    for name, array in sent[0].items():
        assert name in inputs, f"{name} is not an input of tensorrt_llm"
        assert NUMPY_TYPES[array.dtype] == inputs[name].data_type, name
        assert engine_shape_fits(array, inputs[name], config.max_batch_size), (name, array.shape)


def test_tensorrt_llm_config_can_reuse_and_has_lora(build: ModuleType) -> None:
    config = parse(DEPLOY / "tensorrt_llm" / "config.pbtxt")
    p = params(config)
    assert config.backend == "tensorrtllm" and config.model_transaction_policy.decoupled
    assert p["gpt_model_type"] == "inflight_fused_batching"
    assert p["enable_kv_cache_reuse"] == "true"
    assert 0.0 < float(p["kv_cache_free_gpu_mem_fraction"]) <= 1.0
    assert int(p["kv_cache_host_memory_bytes"]) > 0
    assert int(p["lora_cache_optimal_adapter_size"]) <= int(p["lora_cache_max_adapter_size"])
    assert 0.0 < float(p["lora_cache_gpu_memory_fraction"]) < 1.0
    assert int(p["lora_cache_host_memory_bytes"]) > 0
    defaults = build.BuildOptions()
    # the engine takes every rank the LoRA cache pages are sized for, and as many requests
    assert int(p["lora_cache_max_adapter_size"]) == defaults.max_lora_rank
    assert config.max_batch_size == defaults.max_batch_size
    # every perf output the backend writes with return_perf_metrics is declared
    outputs = set(by_name(config.output))
    assert {"kv_cache_reused_blocks", "kv_cache_alloc_new_blocks", "first_token_time_ns"} <= outputs


# -- the checker catches what Triton would refuse ---------------------------------------------


def broken(gpu_repo: Path, edit: str) -> tuple[Any, dict[str, Any]]:
    configs = configs_of(gpu_repo)
    ensemble = configs["ensemble"]
    steps = {s.model_name: s for s in ensemble.ensemble_scheduling.step}
    if edit == "unknown output":
        steps["lora_cache"].output_map["LORA_NOPE"] = "_nope"
    elif edit == "read before written":
        steps["embedding_cache"].input_map["CACHED_TEXT"] = "_lora_task_id"
    elif edit == "unmapped required input":
        del steps["llm"].input_map["ENVELOPE"]
    elif edit == "missing model":
        del configs["lora_cache"]
    elif edit == "unused ensemble input":
        del steps["prompt_cache"].input_map["tenant"]
    return ensemble, configs


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("unknown output", "LORA_NOPE is not an output of lora_cache"),
        ("read before written", "reads _lora_task_id before any step writes it"),
        ("unmapped required input", "required input ENVELOPE is not mapped"),
        ("missing model", "no such model"),
        ("unused ensemble input", "ensemble input tenant is not used"),
    ],
)
def test_ensemble_checker_finds(
    gpu_repo: Path, assemble: ModuleType, edit: str, message: str
) -> None:
    ensemble, configs = broken(gpu_repo, edit)
    problems = assemble.ensemble_problems(ensemble, configs)
    assert any(message in p for p in problems), problems


def test_checker_refuses_placeholders_and_wrong_names(tmp_path: Path, assemble: ModuleType) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.pbtxt").write_text('name: "m"\nbackend: "${triton_backend}"\n')
    with pytest.raises(ValueError, match="placeholder"):
        assemble.check_repository(tmp_path)
    (model / "config.pbtxt").write_text('name: "other"\nbackend: "python"\n')
    with pytest.raises(ValueError, match="not the folder's"):
        assemble.check_repository(tmp_path)


# -- assembling with an engine ----------------------------------------------------------------


def fake_engine(folder: Path, **options: Any) -> Path:
    (folder / "engine").mkdir(parents=True)
    (folder / "engine" / "config.json").write_text("{}")
    (folder / "engine" / "rank0.engine").write_bytes(b"\0" * 16)
    (folder / "tokenizer").mkdir()
    (folder / "tokenizer" / "tokenizer.json").write_text("{}")
    build = load_script("build_engine")
    (folder / build.BUILD_FILE).write_text(build.BuildOptions(**options).to_json())
    (folder / build.COMPLETE_FILE).write_text("")
    return folder


def test_assemble_with_an_engine_uses_its_files_and_limits(
    tmp_path: Path, assemble: ModuleType
) -> None:
    engine = fake_engine(tmp_path / "built", max_input_len=1024, max_seq_len=2048, max_lora_rank=16)
    out = assemble.assemble(tmp_path / "repo", engine)
    assert (out / "tensorrt_llm" / "1" / "rank0.engine").is_file()
    assert (out / "tensorrt_llm" / "1" / "config.json").is_file()
    assert (out / "tensorrt_llm" / "tokenizer" / "tokenizer.json").is_file()
    configs = configs_of(out)
    assert params(configs["llm"])["trtllm_max_input_len"] == "1024"
    assert params(configs["llm"])["trtllm_max_seq_len"] == "2048"
    assert params(configs["tensorrt_llm"])["lora_cache_max_adapter_size"] == "16"
    assert params(configs["llm"])["trtllm_max_draft_len"] == "0"  # not built for drafts
    drafting = fake_engine(tmp_path / "drafting", max_draft_len=8)
    out = assemble.assemble(tmp_path / "repo-drafting", drafting, kv_reuse=True)
    assert params(configs_of(out)["llm"])["trtllm_max_draft_len"] == "8"
    # without prefix KV reuse every step would compute the prompt again: off
    out = assemble.assemble(tmp_path / "repo-no-reuse", drafting)
    assert params(configs_of(out)["llm"])["trtllm_max_draft_len"] == "0"
    # ...but the engine still takes its draft room off every request: llm must know it
    assert params(configs_of(out)["llm"])["trtllm_build_draft_len"] == "8"


def test_assembled_kv_reuse_is_off_unless_one_tenant_or_the_operator_says_so(
    tmp_path: Path, assemble: ModuleType, gpu_repo: Path
) -> None:
    """TensorRT-LLM's Triton backend has no per-tenant cache salt: shared prefix blocks would
    cross tenants, so the assembled repository reuses KV blocks only where that cannot happen."""
    assert params(configs_of(gpu_repo)["tensorrt_llm"])["enable_kv_cache_reuse"] == "false"
    assert assemble.kv_reuse_decision("auto", None)[0] is False
    keys = tmp_path / "keys.json"
    add_key(keys, "acme")
    add_key(keys, "acme")  # two keys, one tenant
    assert assemble.kv_reuse_decision("auto", keys)[0] is True
    # llm is told the one tenant: a tenant added later, without a restart, is refused there
    assert assemble.kv_reuse_tenant("auto", keys) == "acme"
    assert assemble.kv_reuse_tenant("on", keys) == ""  # every tenant, by the operator's choice
    one = assemble.assemble(tmp_path / "one", kv_reuse=True, kv_reuse_tenant="acme")
    assert params(configs_of(one)["llm"])["trtllm_kv_reuse_tenant"] == "acme"
    add_key(keys, "globex")
    assert assemble.kv_reuse_tenant("auto", keys) == ""
    reuse, why = assemble.kv_reuse_decision("auto", keys)
    assert reuse is False and "2 tenants" in why
    assert assemble.kv_reuse_decision("on", keys)[0] is True
    assert assemble.kv_reuse_decision("off", None)[0] is False
    with pytest.raises(ValueError, match="--kv-reuse"):
        assemble.kv_reuse_decision("maybe", None)
    out = assemble.assemble(tmp_path / "shared", kv_reuse=True)
    assert params(configs_of(out)["tensorrt_llm"])["enable_kv_cache_reuse"] == "true"


def test_assemble_refuses_an_incomplete_engine_and_a_full_output(
    tmp_path: Path, assemble: ModuleType
) -> None:
    with pytest.raises(FileNotFoundError, match="no complete engine"):
        assemble.assemble(tmp_path / "repo", tmp_path / "nothing")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(FileExistsError):
        assemble.assemble(tmp_path / "full")
    assert assemble.assemble(tmp_path / "full", force=True).is_dir()


def test_assemble_main_reports_errors_without_a_traceback(
    tmp_path: Path, assemble: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert assemble.main(["--output", str(tmp_path / "full")]) == 2
    assert "not empty" in capsys.readouterr().err


# -- the engine build command -----------------------------------------------------------------


def flag_values(argv: list[str], flag: str) -> list[str]:
    """The values after `flag`, up to the next flag."""
    start = argv.index(flag) + 1
    values = []
    for item in argv[start:]:
        if item.startswith("--"):
            break
        values.append(item)
    return values


def test_build_command_has_what_kv_reuse_and_lora_need(build: ModuleType) -> None:
    options = build.BuildOptions()
    argv = build.build_argv(Path("/c"), Path("/e"), options)
    assert argv[0] == "trtllm-build"
    expected = {
        "--checkpoint_dir": ["/c"],
        "--output_dir": ["/e"],
        "--kv_cache_type": ["paged"],
        "--use_paged_context_fmha": ["enable"],
        "--context_fmha": ["enable"],
        "--tokens_per_block": ["32"],
        "--gpt_attention_plugin": ["auto"],
        "--gemm_plugin": ["auto"],
        "--remove_input_padding": ["enable"],
        "--lora_plugin": ["float16"],
        "--max_lora_rank": ["32"],
        "--max_input_len": ["4096"],
        "--max_seq_len": ["5120"],
        "--max_batch_size": ["16"],
    }
    for flag, values in expected.items():
        assert flag_values(argv, flag) == values, flag
    modules = flag_values(argv, "--lora_target_modules")
    assert {"attn_q", "attn_v"} <= set(modules)
    assert set(modules) == set(build.LORA_MODULES)
    assert len([a for a in argv if a.startswith("--")]) == len(
        {a for a in argv if a.startswith("--")}
    ), "a flag given twice"
    assert "--speculative_decoding_mode" not in argv
    drafting = build.build_argv(Path("/c"), Path("/e"), build.BuildOptions(max_draft_len=8))
    assert flag_values(drafting, "--speculative_decoding_mode") == ["draft_tokens_external"]
    assert flag_values(drafting, "--max_draft_len") == ["8"]


def test_lora_modules_are_the_ones_the_adapter_converter_maps(build: ModuleType) -> None:
    from tiercache.lora.trtllm import HF_TO_TRTLLM

    assert set(build.LORA_MODULES) == set(HF_TO_TRTLLM.values())


def test_convert_command(build: ModuleType) -> None:
    argv = build.convert_argv(
        Path("/src/convert_checkpoint.py"), Path("/hf"), Path("/ckpt"), build.BuildOptions(), "py"
    )
    assert argv[:2] == ["py", "/src/convert_checkpoint.py"]
    for flag, value in [
        ("--model_dir", "/hf"),
        ("--output_dir", "/ckpt"),
        ("--dtype", "float16"),
        ("--tp_size", "1"),
    ]:
        assert flag_values(argv, flag) == [value]


def test_build_options_are_checked(build: ModuleType) -> None:
    for bad in (
        {"tokens_per_block": 48},
        {"max_seq_len": 4096},
        {"max_num_tokens": 1024},
        {"dtype": "bfloat16"},
        {"lora_target_modules": ("attn_qkv",)},
        {"max_draft_len": 33},
        {"max_draft_len": -1},
    ):
        with pytest.raises(ValueError):
            build.BuildOptions(**bad).check()
    build.BuildOptions().check()


def test_dry_run_prints_both_commands_and_writes_nothing(
    tmp_path: Path, build: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    code = build.main(
        [
            "--output-dir",
            str(out),
            "--hf-dir",
            str(tmp_path / "hf"),
            "--dry-run",
            "--max-lora-rank",
            "8",
        ]
    )
    assert code == 0 and not out.exists()
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    assert len(lines) == 2
    assert "convert_checkpoint.py" in lines[0] and f"--model_dir {tmp_path / 'hf'}" in lines[0]
    assert lines[1].startswith("trtllm-build ") and "--max_lora_rank 8" in lines[1]
    assert re.search(r"--use_paged_context_fmha enable\b", lines[1])


def test_build_refuses_bad_options_in_main(build: ModuleType, tmp_path: Path) -> None:
    assert build.main(["--output-dir", str(tmp_path), "--tokens-per-block", "3", "--dry-run"]) == 2


def test_convert_script_is_found_in_either_layout(build: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        build.find_convert_script(tmp_path)
    old = tmp_path / "examples" / "llama" / "convert_checkpoint.py"
    old.parent.mkdir(parents=True)
    old.write_text("")
    assert build.find_convert_script(tmp_path) == old
    new = tmp_path / "examples" / "models" / "core" / "llama" / "convert_checkpoint.py"
    new.parent.mkdir(parents=True)
    new.write_text("")
    assert build.find_convert_script(tmp_path) == new


def test_transformers_5_config_gets_the_legacy_rope_keys(build: ModuleType) -> None:
    new_style = {
        "architectures": ["LlamaForCausalLM"],
        "dtype": "float32",
        "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    }
    patched = build.legacy_hf_config(new_style)
    assert patched["rope_theta"] == 100000.0 and patched["torch_dtype"] == "float32"
    assert patched["rope_parameters"] == new_style["rope_parameters"]  # nothing removed
    assert "rope_scaling" not in patched
    assert build.legacy_hf_config(patched) is None
    legacy = {"rope_theta": 10000.0, "torch_dtype": "float16"}
    assert build.legacy_hf_config(legacy) is None


def test_copy_tokenizer_takes_the_chat_template(build: ModuleType, tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "model.bin"):
        (hf / name).write_text("x")
    copied = build.copy_tokenizer(hf, tmp_path / "tok")
    assert copied == ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
    with pytest.raises(FileNotFoundError):
        build.copy_tokenizer(tmp_path / "tok2", tmp_path / "tok3")


def test_build_options_round_trip_through_build_json(build: ModuleType) -> None:
    options = build.BuildOptions(max_lora_rank=8)
    data = json.loads(options.to_json())
    data["lora_target_modules"] = tuple(data["lora_target_modules"])
    assert build.BuildOptions(**data) == options


# -- the Dockerfile ---------------------------------------------------------------------------


def test_dockerfile_builds_on_the_trtllm_image_and_copies_what_exists() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(
        r"^FROM nvcr\.io/nvidia/tritonserver:\$\{TRITON_VERSION\}-trtllm-python-py3", text, re.M
    )
    for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.M):
        *sources, _ = line.split()
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
    assert "deploy/tensorrt_llm/entrypoint.sh" in text
