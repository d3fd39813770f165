"""The serving benchmark's choice of neighbours (bench.verifier_serving --neighbours)."""

from __future__ import annotations

import json
from pathlib import Path

from tiercache_dev.bench.verifier_serving import nearest_texts


def test_nearest_texts_are_the_closest_other_texts(tmp_path: Path) -> None:
    rows = [
        {"a": "How do I bake bread at home?", "b": "How can I bake bread myself?", "label": 1},
        {"a": "What is the best way to make bread?", "b": "x", "label": 1},
        {"a": "How tall is Mount Everest?", "b": "y", "label": 0},
        {"a": "Which recipe makes good sourdough bread?", "b": "z", "label": 0},
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    pairs = [(rows[0]["a"], rows[0]["b"], 1)]
    (near,) = nearest_texts(path, pairs, 2)
    assert rows[0]["a"] not in near  # the pair's own text is stored anyway, not as a neighbour
    assert len(near) == 2
    assert "How tall is Mount Everest?" not in near  # the two bread questions are nearer
    assert set(near) == {rows[1]["a"], rows[3]["a"]}
    assert nearest_texts(path, pairs, 0) == [[]]
