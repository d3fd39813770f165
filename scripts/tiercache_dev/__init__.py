"""Developer tools of the tiercache repository: benchmarks, perf runs, training and diagnostics
(not part of the served package).

Installed with the repository (`make setup`: `pip install -e .` finds this package under
`scripts/`), and run from the checkout, as modules::

    .venv/bin/python -m tiercache_dev.bench.prompt_cache --help

Subpackages: `bench` (one measurement each), `perf` (perf_analyzer runs: `make perf`, the soak),
`train` (the committed adapters and the semantic guard), `diagnostics` (checks and
reproductions). Shared by all of them: `stats` (the one percentile definition), `servers` (the
one way to start tritonserver and redis-server for a measurement), `metrics` (scraping a
server's Prometheus port), `console` (progress lines and report headers) and `paths` (where the
repository's files are).
"""

import os

# Every tool runs offline, as `make` does: the models are packaged, nothing comes from the hub.
# Set here, before any of the package's modules imports transformers or huggingface_hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
