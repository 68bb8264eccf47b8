#!/usr/bin/env bash
# Next H200 session, call 2 (straight after s5_call1.sh): v3 at 64 streams with every flow graph captured at
# load (~90 s of capture after vLLM's start), for its TTFA and memory peaks; cut twice before by call limits;
# then v3 offline at 16/64/128 requests against the fourth session's bf16 offline run. Extra arguments (e.g.
# --hift-graphs, once s5_call1.sh shows they gain) go to both runs.
set -u
source bench/gpu/setup.sh
bash bench/gpu/level.sh v3_precaptured64 330 bench/results/h200-2026-11-30c/bench_v3_bf16/results.json \
  --random-full v3 --concurrency 64 --modes stream --graph-warmup-s 15 "$@"
bash bench/gpu/level.sh v3_offline128 200 bench/results/h200-2026-11-30d/v3_offline_bf16/results.json \
  --random-full v3 --concurrency 16,64,128 --modes offline "$@"
