#!/usr/bin/env bash
# Next H200 session, one call (after the four part-copy calls, sent in the same batch; kind nvidia-h200):
# what the fourth session left unmeasured. The v2 graph-vs-eager test in true fp32 (fixed after TF32
# convolutions failed it); v3 with every graph pre-captured at 64 streams (memory peaks); v3 offline at
# 128 requests. Each bench level gets >= 150 s: the engine and vLLM take ~70 s to start.
set -u
source bench/gpu/setup.sh
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -u -m pytest -v -m gpu -p no:cacheprovider -rf --tb=short \
  tests/engine/test_flow_graphs.py > "$OUT/pytest_flow_graphs.log" 2>&1
echo "pytest rc=$? $(date +%T)"; grep -E "PASSED|FAILED|passed|failed" "$OUT/pytest_flow_graphs.log" | tail -4
bash bench/gpu/level.sh v3_precaptured64 260 bench/results/h200-2026-11-30c/bench_v3_bf16/results.json \
  --random-full v3 --concurrency 64 --modes stream --graph-warmup-s 15
bash bench/gpu/level.sh v3_offline128 170 - --random-full v3 --concurrency 128 --modes offline
