#!/bin/sh
# The GPU image's command: build the engine if the state volume has none, assemble the model
# repository around it, then serve it. Arguments go to tritonserver.
set -eu
here="$(cd "$(dirname "$0")" && pwd)"
engine_dir="${TIERCACHE_ENGINE_DIR:-/var/lib/tiercache/trtllm-engine}"
repository="${TIERCACHE_GPU_REPOSITORY:-/opt/tiercache/gpu_repository}"

python3 "$here/build_engine.py" --output-dir "$engine_dir" \
    --trtllm-src "${TRTLLM_SRC:-/opt/TensorRT-LLM}"
python3 "$here/assemble_repository.py" --engine-dir "$engine_dir" --output "$repository" --force
# The OpenAI endpoint (docs/gateway.md), its edge layer on the same repository and state; it
# answers 503 on /health until Triton is ready. Loopback only unless an API key file decides
# tenants (every caller would be the default tenant otherwise).
gateway_host=127.0.0.1
if [ -n "${TIERCACHE_API_KEYS_FILE:-}" ]; then gateway_host=0.0.0.0; fi
if [ "${TIERCACHE_GATEWAY:-1}" != 0 ]; then
    python3 -m tiercache.cli gateway --model-repository "$repository" --host "$gateway_host" \
        --port "${TIERCACHE_GATEWAY_PORT:-8080}" &
fi
exec tritonserver --model-repository="$repository" "$@"
