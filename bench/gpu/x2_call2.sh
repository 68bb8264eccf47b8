#!/usr/bin/env bash
# H200 x2, call 2 of 3 (the soak runs on GPU 1): on GPU 0 fast start (auto, the default) with the flow graphs
# pre-captured at load (pre-capture changes no per-request compute: TTFA vs the last run is fast start; device memory
# is pre-capture) with v3 at 1/16/128 streams, then v2 at 64 and 128 streams, streaming and offline.
set -u
source bench/gpu/setup.sh
CACHE=/root/.cache/cosystream
HW="1x NVIDIA H200 (141 GB), torch 2.11 cu130, vLLM 0.26.0"
CUDA_VISIBLE_DEVICES=0 timeout ${BENCH_TIMEOUT:-240} python3 -m bench --random-full v3 --cache-dir "$CACHE" \
  --backend vllm --device cuda --concurrency 1,16,128 --modes stream --tokens 250 --requests 16 \
  --graph-warmup-s 15 --hardware "$HW" --out "$OUT/bench_v3_precap" > "$OUT/bench_v3_precap.log" 2>&1
echo "bench v3 precapture rc=$? $(date +%T)"; grep -E " c=|captured .* flow graphs" "$OUT/bench_v3_precap.log" | tail -6
python3 -m bench.compare bench/results/h200-2026-11-30b/bench_v3.json "$OUT/bench_v3_precap/results.json" \
  --out "$OUT/compare_v3_fast_start.md" && cat "$OUT/compare_v3_fast_start.md"
rm -f "$OUT"/*/results.png  # at most 8 files come back; python -m bench.report redraws a plot from the json
CUDA_VISIBLE_DEVICES=0 timeout ${BENCH_TIMEOUT:-240} python3 -m bench --random-full v2 --cache-dir "$CACHE" \
  --backend vllm --device cuda --concurrency 64,128 --modes stream,offline --tokens 250 --hardware "$HW" \
  --out "$OUT/bench_v2_high" > "$OUT/bench_v2_high.log" 2>&1; echo "bench v2 64/128 rc=$? $(date +%T)"
grep " c=" "$OUT/bench_v2_high.log" | tail -6
rm -f "$OUT"/*/results.png
grep -v "INFO:httpx" /root/soak.log | tail -2
