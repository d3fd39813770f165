"""tiercache_dev.bench.hit_path: the ensemble's steps as its config maps them, and one short run
of the real stages (and the floor's) in process, every request an exact hit."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest

from tiercache.exact.answer_ids import ID_CHARS
from tiercache_dev.bench.hit_path import (
    PROMPT,
    Ensemble,
    cache_the_answer,
    ensemble_steps,
    main,
    public_inputs,
    stand_in,
)
from tiercache_dev.paths import MODEL_REPOSITORY


def test_the_steps_follow_the_ensemble_config() -> None:
    steps = ensemble_steps((MODEL_REPOSITORY / "ensemble" / "config.pbtxt").read_text())
    assert [s.model for s in steps] == ["prompt_cache", "embedding_cache", "lora_cache", "llm"]
    prompt_cache, embedding_cache, lora_cache, llm = steps
    assert prompt_cache.inputs["text_input"] == "text_input"
    assert prompt_cache.outputs["ENVELOPE"] == embedding_cache.inputs["ENVELOPE"]
    assert lora_cache.inputs["LOOKUP_STATUS"] == embedding_cache.outputs["ANSWER_STATUS"]
    assert llm.outputs["TEXT_OUTPUT"] == "text_output"


def test_a_short_run_times_every_step_of_an_exact_hit(capsys: pytest.CaptureFixture[str]) -> None:
    before = sys.modules.get("triton_python_backend_utils"), os.environ.get("TIERCACHE_SECRET_FILE")
    assert main(["--requests", "20", "--rounds", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    names = [row.split(" | ")[0][2:] for row in rows[1:]]
    assert names == ["prompt_cache", "embedding_cache", "lora_cache", "llm", "all steps"]
    for row in rows[1:]:
        ours, floor, added = row.split(" | ")[1:4]
        assert float(ours.split()[0]) > 0 and float(floor.split()[0]) > 0
        assert float(added.rstrip(" |")) == pytest.approx(
            float(ours.split()[0]) - float(floor.split()[0]), abs=0.11
        )
    # the stand-in and the shared secret file were this run's only
    after = sys.modules.get("triton_python_backend_utils"), os.environ.get("TIERCACHE_SECRET_FILE")
    assert after == before


def test_opcodes_counts_each_steps_instructions_per_hit(capsys: pytest.CaptureFixture[str]) -> None:
    """`--opcodes N`: bytecode instructions per hit, each step and all, ours against the
    floor's; a step that does its work runs more of them than a no-op step, and the counting
    leaves every model's `execute` as it was."""
    assert main(["--requests", "6", "--rounds", "1", "--opcodes", "4"]) == 0
    text = capsys.readouterr().out
    table = text[text.index("Bytecode instructions per hit") :]
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| ")][1:]
    counts = {row[0][2:]: [int(v.rstrip(" |")) for v in row[1:4]] for row in rows}
    assert list(counts) == ["prompt_cache", "embedding_cache", "lora_cache", "llm", "all steps"]
    for ours, floor, added in counts.values():
        assert ours > floor > 0 and abs(added - (ours - floor)) <= 1
    assert counts["all steps"][0] == pytest.approx(
        sum(v[0] for k, v in counts.items() if k != "all steps"), abs=2
    )


def test_the_floor_sends_what_the_real_stages_send_on_an_exact_hit(tmp_path: Path) -> None:
    """The floor is the same ensemble with no-op steps: each of its steps must send the tensors
    (names, dtypes, shapes) the real step sends on an exact hit (the floor's llm once lacked
    ANSWER_ID, which made it cheaper than the contract it stands for), its answer id as long as
    a real one."""
    steps = ensemble_steps((MODEL_REPOSITORY / "ensemble" / "config.pbtxt").read_text())
    with stand_in(), contextlib.ExitStack() as stack:
        real = Ensemble(steps, tmp_path / "tiercache")
        stack.callback(real.close)
        floor = Ensemble(steps, tmp_path / "floor", floor=True)
        stack.callback(floor.close)
        public = public_inputs(PROMPT)
        cache_the_answer(real, public)
        real_last = real.run(public, timed=False)
        floor_last = floor.run(public, timed=False)
    assert real_last["CACHE_STATUS"].reshape(-1)[0] == b"exact"
    assert set(real.sent) == {step.model for step in steps}
    for step in steps:
        assert floor.sent[step.model] == real.sent[step.model], step.model
        # as many bytes of values to serialize and read (the floor's envelope was 2 bytes
        # against the real one's 700)
        ours, theirs = sum(real.sizes[step.model].values()), sum(floor.sizes[step.model].values())
        assert 0.9 * ours <= theirs <= 1.25 * ours, (step.model, ours, theirs)
    for last in (real_last, floor_last):
        assert len(last["ANSWER_ID"].reshape(-1)[0]) == ID_CHARS


def test_evict_mib_reads_its_buffer_before_each_timed_step_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--evict-mib` reads its buffer once before every timed step (outside the step's timer),
    never on an untimed run; a size past 1 GiB is refused."""

    class Counted:
        reads = 0

        def sum(self) -> int:
            Counted.reads += 1
            return 0

    steps = ensemble_steps((MODEL_REPOSITORY / "ensemble" / "config.pbtxt").read_text())
    with stand_in(), contextlib.ExitStack() as stack:
        floor = Ensemble(steps, tmp_path / "floor", floor=True)
        stack.callback(floor.close)
        floor.evict = Counted()  # type: ignore[assignment]
        public = public_inputs(PROMPT)
        floor.run(public, timed=False)
        assert Counted.reads == 0
        floor.run(public)
        assert Counted.reads == len(steps)
    assert main(["--requests", "5", "--rounds", "2", "--evict-mib", "1"]) == 0
    assert "| all steps |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--evict-mib", "2048"])
