"""tiercache_dev.train.qqp_pairs: GPTCache's QQP file read and split by row index (issue 18:
train only on index mod 20 in 1..9; 0 is the dev file; 10..19 are held out)."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from tiercache_dev.train import qqp_pairs as qqp


def archive(rows: list[dict[str, object]]) -> bytes:
    data = json.dumps(rows).encode()
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        info = tarfile.TarInfo("examples/benchmark/similiar_qqp_full.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


ROWS = [{"text_a": f"q{i}", "text_b": f"r{i}", "label": i % 2} for i in range(45)]


def test_rows_split_by_index_mod_20() -> None:
    rows = qqp.read_rows(archive(ROWS))
    assert [r.index for r in qqp.rows_of(rows, "dev")] == [0, 20, 40]
    train = [r.index for r in qqp.rows_of(rows, "train")]
    held = [r.index for r in qqp.rows_of(rows, "held-out")]
    assert train == [*range(1, 10), *range(21, 30), *range(41, 45)]
    assert held == [*range(10, 20), *range(30, 40)]
    assert not set(train) & set(held) and len(train) + len(held) + 3 == 45
    first = next(qqp.rows_of(rows, "train"))
    assert (first.a, first.b, first.label) == ("q1", "r1", 1)


def test_plain_json_is_read_too_and_bad_files_are_refused() -> None:
    assert len(qqp.read_rows(json.dumps(ROWS).encode())) == 45
    with pytest.raises(qqp.QqpFileError, match="row 1"):
        qqp.read_rows(json.dumps([ROWS[0], {"text_a": "x", "label": 1}]).encode())
    with pytest.raises(qqp.QqpFileError, match="not JSON"):
        qqp.read_rows(b"not json")
    with pytest.raises(ValueError, match="split must be"):
        list(qqp.rows_of([], "test"))


def test_the_command_writes_the_split_as_pairs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "qqp.json.gz"
    source.write_bytes(archive(ROWS))
    out = tmp_path / "out" / "train.jsonl"
    assert qqp.main(["--source", str(source), "--split", "train", "--out", str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 22 and lines[0] == {
        "a": "q1",
        "b": "r1",
        "label": 1,
        "source": "qqp",
        "index": 1,
    }
    assert "not the pinned file" in capsys.readouterr().out
    missing = tmp_path / "none.gz"
    assert qqp.main(["--source", str(missing), "--split", "dev", "--out", str(out)]) == 2


def test_the_verifier_trains_only_on_rows_of_the_train_split(tmp_path: Path) -> None:
    from tiercache_dev.train.verifier import read_pairs

    rows = [{"a": "q", "b": "r", "label": 1, "source": "qqp", "index": i} for i in (1, 9, 21)]
    good = tmp_path / "train.jsonl"
    good.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # (a, b, label, the guard's score: None where hard_pairs wrote none)
    assert read_pairs(good, train_only=True) == [("q", "r", 1, None)] * 3
    good.write_text("".join(json.dumps({**r, "guard": 0.25}) + "\n" for r in rows))
    assert read_pairs(good, train_only=True) == [("q", "r", 1, 0.25)] * 3
    for index in (0, 10, 39, None):  # dev, held out, held out, no index
        bad = tmp_path / f"bad{index}.jsonl"
        bad.write_text(json.dumps({**rows[0], "index": index}) + "\n")
        with pytest.raises(SystemExit, match="not a row of QQP's train split"):
            read_pairs(bad, train_only=True)
    assert len(read_pairs(good, limit=2)) == 2


def test_clusters_follow_chains_of_duplicates_over_the_whole_file(tmp_path: Path) -> None:
    rows = [
        {"text_a": "dev row", "text_b": "index 0", "label": 0},
        {"text_a": "A?", "text_b": "B?", "label": 1},
        {"text_a": "B? ", "text_b": "C?", "label": 1},  # whitespace folded: B? again
        {"text_a": "C?", "text_b": "D?", "label": 0},
        {"text_a": "E?", "text_b": "A?", "label": 0},
    ] + [{"text_a": f"x{i}", "text_b": f"y{i}", "label": 0} for i in range(6)]
    source = tmp_path / "q.gz"
    source.write_bytes(archive(rows))
    out = tmp_path / "held.jsonl"
    code = qqp.main(["--source", str(source), "--split", "train", "--out", str(out), "--clusters"])
    assert code == 0
    got = {
        (r["a"], r["b"]): (r["cluster_a"], r["cluster_b"])
        for r in map(json.loads, out.read_text().splitlines())
    }
    assert got[("A?", "B?")][0] == got[("A?", "B?")][1] == got[("B? ", "C?")][1]
    c, d = got[("C?", "D?")]
    assert c == got[("A?", "B?")][0] and d != c  # label 0 does not join
    e, a = got[("E?", "A?")]
    assert a == c and e != a
    sampled = tmp_path / "s.jsonl"
    qqp.main(["--source", str(source), "--split", "train", "--out", str(sampled), "--sample", "3"])
    assert len(sampled.read_text().splitlines()) == 3


def test_train_clusters_are_linked_by_train_rows_alone(tmp_path: Path) -> None:
    rows = [{"text_a": f"x{i}", "text_b": f"y{i}", "label": 0} for i in range(20)]
    rows[1] = {"text_a": "A?", "text_b": "B?", "label": 0}  # train
    rows[12] = {"text_a": "A?", "text_b": "B?", "label": 1}  # held out: links A? and B?
    source = tmp_path / "q.gz"
    source.write_bytes(archive(rows))

    def clusters_of(split: str) -> tuple[int, int]:
        out = tmp_path / f"{split}.jsonl"
        args = ["--source", str(source), "--split", split, "--out", str(out), "--clusters"]
        assert qqp.main(args) == 0
        found = [json.loads(line) for line in out.read_text().splitlines()]
        row = next(r for r in found if r["a"] == "A?")
        return row["cluster_a"], row["cluster_b"]

    a, b = clusters_of("train")
    assert a != b  # the held-out label does not reach a training target
    a, b = clusters_of("held-out")
    assert a == b


def test_the_verifier_point_keeps_every_sources_precision() -> None:
    from tiercache_dev.train.verifier_point import choose

    def row(t: float, overall: tuple[float, float], mock: float | None) -> dict[str, object]:
        return {
            "threshold": t,
            "by_source": {
                "overall": {"precision": overall[0], "recall": overall[1]},
                "mock": {"precision": mock, "recall": 0.0},
            },
        }

    rows = [
        row(0.5, (0.90, 0.60), 0.99),  # overall precision too low
        row(0.7, (0.95, 0.50), 0.96),  # mock under its own 0.97
        row(0.8, (0.96, 0.45), 0.98),  # the one
        row(0.9, (0.99, 0.30), None),  # qualifies (mock has no hit), less recall
    ]
    assert choose(rows, 0.95, {"mock": 0.97})["threshold"] == 0.8  # type: ignore[index]
    assert choose(rows, 0.95, {})["threshold"] == 0.7  # type: ignore[index]
    assert choose(rows, 0.999, {}) is None
    # --overall-only: the target holds overall; a source only where it is named
    rows.insert(0, row(0.4, (0.95, 0.70), 0.90))
    assert choose(rows, 0.95, {}, each_source=False)["threshold"] == 0.4  # type: ignore[index]
    assert choose(rows, 0.95, {"mock": 0.97}, each_source=False)["threshold"] == 0.8  # type: ignore[index]
    assert choose(rows, 0.95, {}, each_source=True)["threshold"] == 0.7  # type: ignore[index]
