#!/usr/bin/env bash
# H200 x2, call 1 of 2: set up, build both full models, start the 32-stream soak on GPU 1 as a daemon, then on
# GPU 0 the v3 bench (stream + offline, 1/16/64, profiled waves at 1 and 64) and the GPU tests.
set -u
source bench/gpu/setup.sh
CACHE=/root/.cache/cosystream
for fam in cosyvoice2 cosyvoice3; do
  python3 -c "from bench.__main__ import random_model; print(random_model('$fam', 'full', '$CACHE'))" &
done; wait
mkdir -p /root/soakhome
HOME=/root/soakhome CUDA_VISIBLE_DEVICES=1 setsid nohup python3 -m bench.soak --model "$CACHE/bench/cosyvoice3-full" \
  --streams 32 --minutes ${SOAK_MIN:-10} --backend vllm --device cuda --sample-s 10 --out /root/soak \
  > /root/soak.log 2>&1 < /dev/null &
echo "soak started $(date +%T)"
CUDA_VISIBLE_DEVICES=0 timeout ${BENCH_TIMEOUT:-330} python3 -m bench --random-full v3 --cache-dir "$CACHE" \
  --backend vllm --device cuda --concurrency 1,16,64 --modes stream,offline --tokens 250 --requests 16 \
  --profile-dir "$OUT/prof_v3" --hardware "1x NVIDIA H200 (141 GB), torch 2.11 cu130, vLLM 0.26.0" \
  --out "$OUT/bench_v3" > "$OUT/bench_v3.log" 2>&1; echo "bench v3 rc=$? $(date +%T)"
rm -f "$OUT/bench_v3/results.png"
grep -v "^INFO:httpx" "$OUT/bench_v3.log" | grep -v "^(EngineCore" | grep -v "^\s" | tail -12
CUDA_VISIBLE_DEVICES=0 timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/engine/lm/test_vllm_backend.py tests/engine/test_flow_graphs.py > "$OUT/pytest_gpu.log" 2>&1
echo "pytest gpu rc=$? $(date +%T)"; grep -E "passed|failed|Error|assert" "$OUT/pytest_gpu.log" | tail -8
grep -v "INFO:httpx" /root/soak.log | tail -3
