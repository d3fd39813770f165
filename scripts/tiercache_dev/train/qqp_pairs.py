"""Quora Question Pairs as GPTCache publishes them, split the way this project may use them.

Usage::

    .venv/bin/python -m tiercache_dev.train.qqp_pairs --source FILE --split train \\
        --out .perf/qqp_train.jsonl

`FILE` is GPTCache's `examples/benchmark/similiar_qqp_full.json.gz` (a gzipped tar holding
`similiar_qqp_full.json`: 80,854 `{"text_a", "text_b", "label"}` rows; the origin of the dev
file's qqp rows), fetched once by hand or with `--download` (`QQP_URL`, pinned to a commit and
checked against `QQP_SHA256`). Nothing of it is committed.

Splits, by the row's index in that file (issue 18):
- `dev`: index mod 20 == 0, the dev file's qqp rows (for tuning; never trained on);
- `train`: index mod 20 in 1..9 (the only rows a model may be trained on);
- `held-out`: index mod 20 in 10..19 (evaluation only: never trained or tuned on).

Writes the project's pairs format (`{"a", "b", "label", "source": "qqp", "index"}`, texts as in
the file), one JSON line per row of the split; `--sample N` keeps a seeded sample of N rows
(in file order). `--clusters` adds `cluster_a` / `cluster_b`, the duplicate clusters the dev
file's README defines: texts (NFKC, whitespace folded) linked by a chain of label-1 rows of the
whole file share a cluster, so `tiercache eval-semantic` judges hits on the held-out rows the
way it judges the dev file; for `--split train` only train rows link texts, so no label outside
the train split reaches a training target. Terms: Quora's first dataset release (non-commercial
use), as the dev file's README states.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import random
import sys
import tarfile
import unicodedata
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

QQP_COMMIT = "c59fb3a6152a4458b2a070ca183b61c4b614095f"
QQP_URL = (
    f"https://github.com/zilliztech/GPTCache/raw/{QQP_COMMIT}/"
    "examples/benchmark/similiar_qqp_full.json.gz"
)
QQP_SHA256 = "1fcd814990dd8ebbc1cdacd41fca11e56739e2e4d72e4ac119334084ed7e2b58"
MEMBER = "similiar_qqp_full.json"
SPLITS = ("dev", "train", "held-out")


class QqpFileError(ValueError):
    """The source file is not GPTCache's QQP file (the message says what is wrong)."""


@dataclass(frozen=True, slots=True)
class Row:
    index: int
    a: str
    b: str
    label: int


def split_of(index: int) -> str:
    """Which split a row of the file belongs to, by its index."""
    rest = index % 20
    return "dev" if rest == 0 else "train" if rest < 10 else "held-out"


def read_rows(data: bytes) -> list[Row]:
    """The rows of the file's bytes: the gzipped tar GPTCache publishes, or the JSON inside it."""
    if data[:2] == b"\x1f\x8b":
        try:
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
                members = [m for m in archive.getmembers() if m.name.endswith(MEMBER)]
                if len(members) != 1:
                    raise QqpFileError(f"the archive holds no single {MEMBER}")
                handle = archive.extractfile(members[0])
                if handle is None:
                    raise QqpFileError(f"{MEMBER} in the archive is not a file")
                data = handle.read()
        except tarfile.TarError as exc:
            raise QqpFileError(f"not a gzipped tar: {exc}") from None
    try:
        document = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise QqpFileError(f"not JSON: {exc}") from None
    if not isinstance(document, list):
        raise QqpFileError("expected a JSON list of rows")
    rows = []
    for index, item in enumerate(document):
        ok = isinstance(item, dict) and item.get("label") in (0, 1)
        texts = [item.get(k) for k in ("text_a", "text_b")] if ok else []
        if not ok or not all(isinstance(t, str) and t.strip() for t in texts):
            raise QqpFileError(f"row {index} is not {{text_a, text_b, label 0|1}}")
        rows.append(Row(index, texts[0], texts[1], int(item["label"])))
    return rows


def rows_of(rows: list[Row], split: str) -> Iterator[Row]:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    return (r for r in rows if split_of(r.index) == split)


def clusters(rows: list[Row]) -> dict[str, int]:
    """Normalized text -> its duplicate cluster (union-find over every label-1 row)."""
    parent: dict[str, str] = {}

    def find(text: str) -> str:
        parent.setdefault(text, text)
        while parent[text] != text:
            parent[text] = parent[parent[text]]
            text = parent[text]
        return text

    for row in rows:
        a, b = find(fold(row.a)), find(fold(row.b))
        if row.label == 1 and a != b:
            parent[a] = b
    roots: dict[str, int] = {}
    return {text: roots.setdefault(find(text), len(roots)) for text in parent}


def fold(text: str) -> str:
    """NFKC with whitespace runs folded to one space, trimmed (the dev file's text identity)."""
    return " ".join(unicodedata.normalize("NFKC", text).split())


def download(path: Path) -> None:
    """Fetch QQP_URL into `path`, checked against QQP_SHA256."""
    with urllib.request.urlopen(QQP_URL, timeout=60) as response:
        data = response.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != QQP_SHA256:
        raise QqpFileError(f"{QQP_URL}: sha256 {digest}, expected {QQP_SHA256}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, required=True, help="similiar_qqp_full.json.gz")
    parser.add_argument("--download", action="store_true", help="fetch --source if it is absent")
    parser.add_argument("--split", choices=SPLITS, required=True)
    parser.add_argument("--out", type=Path, required=True, help="JSON lines to write")
    parser.add_argument("--sample", type=int, help="a seeded sample of this many rows")
    parser.add_argument("--clusters", action="store_true", help="add cluster_a / cluster_b")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        if not args.source.exists():
            if not args.download:
                print(f"{args.source} does not exist (fetch {QQP_URL}, or pass --download)")
                return 2
            print(f"downloading {QQP_URL}", flush=True)
            download(args.source)
        data = args.source.read_bytes()
        if hashlib.sha256(data).hexdigest() != QQP_SHA256:
            print(f"warning: {args.source} is not the pinned file (sha256 differs)")
        rows = read_rows(data)
    except (OSError, QqpFileError) as exc:
        print(f"qqp_pairs: {exc}", file=sys.stderr)
        return 2
    chosen = list(rows_of(rows, args.split))
    if args.sample is not None and args.sample < len(chosen):
        keep = set(random.Random(args.seed).sample(range(len(chosen)), args.sample))
        chosen = [row for i, row in enumerate(chosen) if i in keep]
    # The train split's clusters come from train rows alone: labels of rows outside it must not
    # reach a training target (issue 18); the other splits use the whole file, as the dev file.
    linked = list(rows_of(rows, "train")) if args.split == "train" else rows
    cluster_of = clusters(linked) if args.clusters else {}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with args.out.open("w", encoding="utf-8") as handle:
        for row in chosen:
            line: dict[str, object] = {
                "a": row.a, "b": row.b, "label": row.label, "source": "qqp", "index": row.index
            }  # fmt: skip
            if cluster_of:
                line["cluster_a"] = cluster_of[fold(row.a)]
                line["cluster_b"] = cluster_of[fold(row.b)]
            handle.write(json.dumps(line, ensure_ascii=False) + "\n")
            written += 1
    print(f"{written} rows of split {args.split} (of {len(rows)}) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
