#!/usr/bin/env bash
# H200 x2, call 3 of 3: v3 offline and 128 streams on GPU 0, then wait for the soak on GPU 1 and collect it.
set -u
source bench/gpu/setup.sh
CACHE=/root/.cache/cosystream
CUDA_VISIBLE_DEVICES=0 timeout ${BENCH_TIMEOUT:-300} python3 -m bench --random-full v3 --cache-dir "$CACHE" \
  --backend vllm --device cuda --concurrency 1,16,64,128 --modes offline --tokens 250 --requests 16 \
  --hardware "1x NVIDIA H200 (141 GB), torch 2.11 cu130, vLLM 0.26.0" --out "$OUT/bench_v3_offline" \
  > "$OUT/bench_v3_offline.log" 2>&1; echo "bench v3 offline rc=$?"
rm -f "$OUT/bench_v3_offline/results.png"
grep -v "^INFO:httpx" "$OUT/bench_v3_offline.log" | grep -v "^(EngineCore" | tail -8
for _ in $(seq ${SOAK_WAIT:-60}); do [ -f /root/soak/soak.md ] && break; sleep 5; done
cp /root/soak/soak.json /root/soak/soak.md "$OUT/" 2>/dev/null; grep -v "INFO:httpx" /root/soak.log | tail -200 > "$OUT/soak.log"
cat /root/soak/soak.md 2>/dev/null | head -40; tail -5 /root/soak.log
