#!/bin/sh
# The GPU image's command: build the engine if the state volume has none, assemble the model
# repository around it, then serve it. Arguments go to tritonserver.
set -eu
here="$(cd "$(dirname "$0")" && pwd)"
# Triton listens on every interface of the container; who reaches it is decided where its ports
# are published. Without an API key file the `tenant` input is trusted as sent, so anyone who
# reaches the port could act as any tenant: as `tiercache serve` does off loopback, that takes
# the operator's word (TIERCACHE_TRUST_TENANTS=1, e.g. with the ports published on loopback).
if [ -z "${TIERCACHE_API_KEYS_FILE:-}" ] && [ "${TIERCACHE_TRUST_TENANTS:-0}" != 1 ]; then
    echo "tiercache: no API key file (TIERCACHE_API_KEYS_FILE): anyone who reaches the gRPC" \
        "port could name any tenant and be served its cached answers (docs/security.md)." \
        "Mount a key file made with \`tiercache keys add\` and set TIERCACHE_API_KEYS_FILE," \
        "or set TIERCACHE_TRUST_TENANTS=1 if every caller that can reach the published" \
        "ports may act as any tenant (ports published on 127.0.0.1 only, say)" >&2
    exit 2
fi
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
