#!/usr/bin/env bash
# Next H200 session, call 3 of 3: v3 with every graph captured at load at 16 and 64 streams (its memory
# peaks), and v2 with the bf16 solver at 16/64/128 streams, streaming and offline.
set -u
source bench/gpu/setup.sh
bash bench/gpu/level.sh v3_precaptured 250 bench/results/h200-2026-11-30c/bench_v3_bf16/results.json \
  --random-full v3 --concurrency 16,64 --modes stream --requests 16 --graph-warmup-s 15
bash bench/gpu/level.sh v2_bf16 290 bench/results/h200-2026-11-30b/bench_v2.json \
  --random-full v2 --concurrency 16,64,128 --modes stream,offline
