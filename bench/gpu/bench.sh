#!/usr/bin/env bash
# H200 call: the streaming benchmark of the full-size random v3 model on vLLM (after check.sh on the same machine).
set -u
source bench/gpu/setup.sh
CACHE=/root/.cache/cosystream
timeout ${BENCH_TIMEOUT:-420} python3 -m bench --random-full v3 --cache-dir "$CACHE" --backend vllm --device cuda \
  --concurrency ${LEVELS:-1,16} --modes ${MODES:-stream} --tokens 250 --requests 16 --baseline --baseline-max-concurrency 1 \
  --hardware "1x NVIDIA H200 (141 GB), torch 2.11 cu130, vLLM 0.26.0" ${EXTRA:-} --out "$OUT/bench_v3" \
  > "$OUT/bench_v3.log" 2>&1; echo "bench rc=$?"
grep -v "^INFO:httpx" "$OUT/bench_v3.log" | tail -40
