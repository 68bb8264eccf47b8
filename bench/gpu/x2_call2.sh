#!/usr/bin/env bash
# H200 x2, call 2 of 2: the v2 bench with the baseline on GPU 0, then collect the soak from GPU 1.
set -u
source bench/gpu/setup.sh
CACHE=/root/.cache/cosystream
CUDA_VISIBLE_DEVICES=0 timeout ${BENCH_TIMEOUT:-270} python3 -m bench --random-full v2 --cache-dir "$CACHE" \
  --backend vllm --device cuda --concurrency 1,16 --modes stream,offline --tokens 250 --requests 8 \
  --baseline --baseline-max-concurrency 1 --hardware "1x NVIDIA H200 (141 GB), torch 2.11 cu130, vLLM 0.26.0" \
  --out "$OUT/bench_v2" > "$OUT/bench_v2.log" 2>&1; echo "bench v2 rc=$? $(date +%T)"
grep -v "^INFO:httpx" "$OUT/bench_v2.log" | grep -v "^(EngineCore" | grep -v "^\s" | tail -10
for _ in $(seq ${SOAK_WAIT:-40}); do [ -f /root/soak/soak.md ] && break; sleep 5; done
cp /root/soak/soak.json /root/soak/soak.md "$OUT/" 2>/dev/null; grep -v "INFO:httpx" /root/soak.log | tail -300 > "$OUT/soak.log"
head -40 /root/soak/soak.md 2>/dev/null; tail -3 /root/soak.log
