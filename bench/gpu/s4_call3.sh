#!/usr/bin/env bash
# Ran 2026-11-30 (fourth session), partly inline: the log is in BENCHMARKS.md, results in bench/results/h200-2026-11-30d.
# Planned as call 3 of 3: v3 with every graph captured at load at 16 and 64 streams (its memory
# peaks); v2 offline at 64/128 requests at once; and the token2wav worker on its own CUDA stream, A/B at
# 16 streams x 48 requests (closed loop: after the first wave, new requests start while flows run).
set -u
source bench/gpu/setup.sh
bash bench/gpu/level.sh v3_precaptured 250 bench/results/h200-2026-11-30c/bench_v3_bf16/results.json \
  --random-full v3 --concurrency 16,64 --modes stream --requests 16 --graph-warmup-s 15
bash bench/gpu/level.sh v2_offline 120 bench/results/h200-2026-11-30b/bench_v2.json \
  --random-full v2 --concurrency 64,128 --modes offline
bash bench/gpu/level.sh v3_c16x48 90 - --random-full v3 --concurrency 16 --modes stream --requests 48
bash bench/gpu/level.sh v3_c16x48_own_stream 90 "$OUT/v3_c16x48/results.json" --random-full v3 \
  --concurrency 16 --modes stream --requests 48 --t2w-own-stream
