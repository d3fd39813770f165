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
exec tritonserver --model-repository="$repository" "$@"
