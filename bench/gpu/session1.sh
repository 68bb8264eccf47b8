#!/usr/bin/env bash
# H200 call (after the bundle parts are in /root/vb): the v2 vLLM proof (greedy parity, RAS, LM tokens/s),
# then the v3 streaming bench at 1 and 16 streams with a profiled wave at each. 8 files come back.
set -u
source bench/gpu/setup.sh
CACHE=/root/.cache/cosystream
for fam in cosyvoice2 cosyvoice3; do
  python3 -c "from bench.__main__ import random_model; print(random_model('$fam', 'full', '$CACHE'))" &
done; wait
timeout 240 python3 -m bench.vllm_check --model "$CACHE/bench/cosyvoice2-full" --dtype bfloat16 --cache "$CACHE" \
  --out "$OUT/vllm_check_v2_bf16.json" > "$OUT/vllm_check_v2.log" 2>&1; echo "vllm_check v2 rc=$?"
grep -v "^INFO:httpx" "$OUT/vllm_check_v2.log" | tail -15
timeout ${BENCH_TIMEOUT:-300} python3 -m bench --random-full v3 --cache-dir "$CACHE" --backend vllm --device cuda \
  --concurrency 1,16 --modes stream --tokens 250 --requests 16 --profile-dir "$OUT/prof_v3" \
  --hardware "1x NVIDIA H200 (141 GB), torch 2.11 cu130, vLLM 0.26.0" --out "$OUT/bench_v3" \
  > "$OUT/bench_v3.log" 2>&1; echo "bench v3 rc=$?"
rm -f "$OUT/bench_v3/results.png"
grep -v "^INFO:httpx" "$OUT/bench_v3.log" | grep -v "captured the flow solver" | tail -25
