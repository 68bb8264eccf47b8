# CosyStream server image.
#   CUDA (default): docker build -t cosystream .
#   Ascend NPU:     docker build -t cosystream:npu --build-arg DEVICE=npu .
# Weights: mount a released model directory (-v /models:/models -e COSYSTREAM_MODEL=/models/Fun-CosyVoice3-0.5B-2512)
# or let the server download the default id into the /data volume on first start. COSYSTREAM_CACHE is the
# server's cache root (models, compile caches, saved voices): on the volume, a restarted container starts warm.
# Neither image is built in CI (no Docker daemon there); CI lints this file with hadolint.
ARG DEVICE=cuda
# vLLM 0.26 with its CUDA torch; vllm-ascend ships torch-npu, CANN and vLLM for Ascend (untested here).
FROM vllm/vllm-openai:v0.26.0 AS base-cuda
FROM quay.io/ascend/vllm-ascend:v0.12.0 AS base-npu

# hadolint ignore=DL3006
FROM base-${DEVICE}
ARG DEVICE=cuda
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HOME=/data/hf \
    MODELSCOPE_CACHE=/data/modelscope \
    COSYSTREAM_CACHE=/data/cosystream \
    COSYSTREAM_MODEL=FunAudioLLM/Fun-CosyVoice3-0.5B-2512 \
    VLLM_USE_FLASHINFER_SAMPLER=0 \
    COSYSTREAM_DEVICE=${DEVICE}
WORKDIR /app
COPY requirements.txt requirements-gpu.txt requirements-npu.txt ./
# torch and vLLM come with the base image: install the rest without touching them. On CUDA the prompt's speech
# tokenizer runs on the GPU only with onnxruntime-gpu (1.31 is built for CUDA 13, as vLLM 0.26's torch is):
# it replaces the CPU build requirements.txt names (untested here: no image is built in CI; where its CUDA
# provider cannot load, onnxruntime falls back to the CPU and the server's log says so).
RUN grep -v -E '^(torch|vllm)' requirements.txt > /tmp/req.txt \
    && python3 -m pip install -r /tmp/req.txt "modelscope>=1.20" \
    && if [ "$DEVICE" = cuda ]; then \
         python3 -m pip uninstall -y onnxruntime && python3 -m pip install "onnxruntime-gpu>=1.31"; \
       fi \
    && useradd --create-home --uid 1000 cosy \
    && mkdir -p /data && chown cosy /data
COPY --chown=1000 . .
USER 1000
VOLUME ["/data"]
EXPOSE 7860
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:7860/health', timeout=4)"]
ENTRYPOINT []
# app.py reads COSYSTREAM_MODEL / COSYSTREAM_DEVICE as its --model / --device defaults
CMD ["python3", "app.py", "--host", "0.0.0.0", "--port", "7860"]
