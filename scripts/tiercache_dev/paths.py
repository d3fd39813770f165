"""Where the repository's files are. The package runs from the checkout (an editable install),
so these are found from this file's place in it: `<repo>/scripts/tiercache_dev/paths.py`."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_REPOSITORY = REPO_ROOT / "model_repository"
ADAPTERS = REPO_ROOT / "adapters"
DEFAULT_STATE_DIR = REPO_ROOT / ".tiercache"
PERF_DIR = REPO_ROOT / ".perf"
# Data and shell beside the package (not Python modules).
BENCH_FIXTURES = REPO_ROOT / "scripts" / "bench_fixtures"
INSTALL_PERF_ANALYZER = REPO_ROOT / "scripts" / "perf" / "install_perf_analyzer.sh"
# The evaluation pairs live beside the repository, not in it.
DEFAULT_PAIRS = REPO_ROOT.parent / "shared" / "eval" / "semantic_pairs_dev.jsonl"
