"""torch's threads in a torch stage process (tiercache.engine.threads, issue 15): the
`torch_threads` parameter, what `auto` resolves to, that it reaches torch.set_num_threads, and
that each torch model.py sets its OpenMP/tokenizers defaults before anything loads torch."""

from __future__ import annotations

import ast
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tiercache.config import EmbedderConfig, EngineConfig, parse_config
from tiercache.engine import threads
from tiercache.engine.threads import (
    ThreadRole,
    pass_thread_count,
    set_torch_threads,
    torch_thread_count,
    usable_cpus,
)
from tiercache.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TORCH_STAGES = {"torch_llm": EngineConfig, "embedder": EmbedderConfig}
ENV_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture
def torch_threads_kept() -> Iterator[None]:
    """This process's torch thread count, as it was before the test."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# ---- the parameter ----------------------------------------------------------------------------


@pytest.mark.parametrize("cls", TORCH_STAGES.values())
def test_default_is_auto_and_a_count_is_kept(cls: type) -> None:
    assert parse_config(cls, {}).torch_threads == "auto"
    assert parse_config(cls, {"torch_threads": " auto "}).torch_threads == "auto"
    assert parse_config(cls, {"torch_threads": "3"}).torch_threads == "3"


@pytest.mark.parametrize("cls", TORCH_STAGES.values())
@pytest.mark.parametrize("text", ["0", "-1", "two", "1.5", "", "Auto", "03"])
def test_a_bad_value_is_refused_naming_the_parameter(cls: type, text: str) -> None:
    with pytest.raises(ConfigError, match=r"parameter 'torch_threads' must match auto\|"):
        parse_config(cls, {"torch_threads": text})


def test_direct_construction_is_checked_too() -> None:
    with pytest.raises(ConfigError, match="torch_threads"):
        EngineConfig(torch_threads="0")


@pytest.mark.parametrize("model", sorted(TORCH_STAGES))
def test_the_committed_config_sets_auto(model: str) -> None:
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    text = (ROOT / "model_repository" / model / "config.pbtxt").read_text()
    config = text_format.Parse(text, mc.ModelConfig())
    values = {k: v.string_value for k, v in config.parameters.items()}
    assert values["torch_threads"] == "auto"
    parse_config(TORCH_STAGES[model], values)


# ---- what a setting means ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cpus", "engine", "embedder"),
    [(1, 1, 1), (2, 1, 1), (3, 2, 1), (4, 3, 1), (8, 7, 1), (16, 14, 2), (64, 56, 8)],
)
def test_auto_gives_the_embedder_an_eighth_and_the_engine_the_rest(
    cpus: int, engine: int, embedder: int
) -> None:
    assert torch_thread_count("auto", cpus, ThreadRole.ENGINE) == engine
    assert torch_thread_count("auto", cpus, ThreadRole.EMBEDDER) == embedder


@pytest.mark.parametrize("cpus", [1, 2, 64])
def test_a_count_is_taken_as_it_is(cpus: int) -> None:
    assert torch_thread_count("3", cpus, ThreadRole.EMBEDDER) == 3


@pytest.mark.parametrize("setting", ["0", "x", ""])
def test_a_bad_setting_is_a_config_error(setting: str) -> None:
    with pytest.raises(ConfigError, match="torch_threads must be auto or an integer >= 1"):
        torch_thread_count(setting, 4, ThreadRole.ENGINE)


# ---- pass_threads (torch_llm: threads for passes over several tokens) -------------------------


def test_pass_threads_parameter_takes_auto_zero_or_a_count() -> None:
    assert parse_config(EngineConfig, {"pass_threads": "auto"}).pass_threads == "auto"
    assert parse_config(EngineConfig, {"pass_threads": "0"}).pass_threads == "0"
    assert parse_config(EngineConfig, {"pass_threads": "12"}).pass_threads == "12"


@pytest.mark.parametrize("text", ["-1", "two", "1.5", "", "Auto", "03", "257", "1000"])
def test_a_bad_pass_threads_is_refused_naming_the_parameter(text: str) -> None:
    with pytest.raises(ConfigError, match=r"parameter 'pass_threads' must match auto\|"):
        parse_config(EngineConfig, {"pass_threads": text})


@pytest.mark.parametrize(("setting", "cpus", "count"), [("auto", 2, 2), ("auto", 16, 16),
    ("auto", 0, 1), ("0", 2, 0), ("3", 2, 3), ("256", 2, 256)])  # fmt: skip
def test_pass_threads_auto_is_every_usable_cpu(setting: str, cpus: int, count: int) -> None:
    assert pass_thread_count(setting, cpus) == count


@pytest.mark.parametrize("setting", ["-1", "x", "", "257"])
def test_a_bad_pass_threads_setting_is_a_config_error(setting: str) -> None:
    with pytest.raises(ConfigError, match="pass_threads must be auto or an integer 0-256"):
        pass_thread_count(setting, 4)


def test_usable_cpus_are_the_affinity_mask_else_the_cpu_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    assert usable_cpus() == 3
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert usable_cpus() == 6
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert usable_cpus() == 1


# ---- applying it --------------------------------------------------------------------------------


@pytest.mark.usefixtures("torch_threads_kept")
def test_set_torch_threads_sets_torchs_count_and_logs_it(caplog: pytest.LogCaptureFixture) -> None:
    import torch

    torch.set_num_threads(1)
    with caplog.at_level(logging.INFO, logger="tiercache"):
        assert set_torch_threads("auto", ThreadRole.EMBEDDER, cpus=16) == 2
    assert torch.get_num_threads() == 2
    assert caplog.messages == ["torch threads: 2 (auto from 16 CPUs)"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tiercache"):
        assert set_torch_threads("1", ThreadRole.ENGINE, cpus=8) == 1
    assert torch.get_num_threads() == 1
    assert caplog.messages == ["torch threads: 1 (torch_threads; 8 CPUs usable)"]


@pytest.mark.usefixtures("torch_threads_kept")
def test_set_torch_threads_counts_this_process_cpus_by_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    calls: list[int] = []
    monkeypatch.setattr(threads, "usable_cpus", lambda: 12)
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    assert set_torch_threads("auto", ThreadRole.EMBEDDER) == 1
    assert set_torch_threads("auto", ThreadRole.ENGINE) == 11
    assert calls == [1, 11]


@pytest.mark.usefixtures("torch_threads_kept")
def test_a_bad_setting_sets_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    with pytest.raises(ConfigError):
        set_torch_threads("none", ThreadRole.ENGINE, cpus=2)
    assert calls == []


# ---- the environment libgomp reads when torch loads ------------------------------------------


def _loads_torch(node: ast.stmt) -> bool:
    """An import that may load torch: anything but `os` and `__future__`."""
    if isinstance(node, ast.Import):
        return any(alias.name != "os" for alias in node.names)
    return isinstance(node, ast.ImportFrom) and node.module != "__future__"


@pytest.mark.parametrize("model", sorted(TORCH_STAGES))
def test_model_sets_the_env_defaults_before_any_import_that_may_load_torch(model: str) -> None:
    """setdefault (the operator's environment wins), before every import but os: the stub
    imports model.py fresh, and libgomp reads OMP_WAIT_POLICY once, when torch loads it."""
    tree = ast.parse((ROOT / "model_repository" / model / "1" / "model.py").read_text())
    defaults: dict[str, str] = {}
    for node in tree.body:
        if _loads_torch(node):
            break
        call = node.value if isinstance(node, ast.Expr) else None
        if isinstance(call, ast.Call) and ast.unparse(call.func) == "os.environ.setdefault":
            name, value = (a.value for a in call.args if isinstance(a, ast.Constant))
            defaults[name] = value
    assert defaults == ENV_DEFAULTS
