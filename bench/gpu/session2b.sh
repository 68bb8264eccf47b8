#!/usr/bin/env bash
# H200 x2, call 2 of 3 (the soak runs on GPU 1): the GPU tests, then the v2 bench with the baseline, on GPU 0.
set -u
source bench/gpu/setup.sh
CACHE=/root/.cache/cosystream
CUDA_VISIBLE_DEVICES=0 timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/lm/test_vllm_backend.py \
  tests/engine/test_flow_graphs.py > "$OUT/pytest_gpu.log" 2>&1; echo "pytest gpu rc=$?"
grep -E "passed|failed|Error|assert" "$OUT/pytest_gpu.log" | tail -8
CUDA_VISIBLE_DEVICES=0 timeout ${BENCH_TIMEOUT:-330} python3 -m bench --random-full v2 --cache-dir "$CACHE" \
  --backend vllm --device cuda --concurrency 1,16,64 --modes stream,offline --tokens 250 --requests 8 \
  --baseline --baseline-max-concurrency 1 --hardware "1x NVIDIA H200 (141 GB), torch 2.11 cu130, vLLM 0.26.0" \
  --out "$OUT/bench_v2" > "$OUT/bench_v2.log" 2>&1; echo "bench v2 rc=$?"
grep -v "^INFO:httpx" "$OUT/bench_v2.log" | grep -v "^(EngineCore" | tail -14
tail -2 /root/soak.log
