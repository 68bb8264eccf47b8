#!/usr/bin/env bash
# Fifth session, the later calls (each straight after the last; what ran is in BENCHMARKS.md, "fifth
# session"): v3 at 64 streams with every flow and HiFT graph captured at load, for its TTFA and memory
# peaks; v3 offline at 1/16/64/128 requests; v2 streaming at 1/16 with the current defaults (bf16). Together
# they need more than one call's 600 s: it ran as three calls (the v3 profile, `--profile-dir`, in one of them).
set -u
source bench/gpu/setup.sh
bash bench/gpu/level.sh v3_precaptured64_hg 330 bench/results/h200-2026-11-30c/bench_v3_bf16/results.json \
  --random-full v3 --concurrency 64 --modes stream --graph-warmup-s 15
bash bench/gpu/level.sh v3_offline_default 240 bench/results/h200-2026-11-30d/v3_offline_bf16/results.json \
  --random-full v3 --concurrency 1,16,64,128 --modes offline --requests 16
python3 -c "from bench.__main__ import random_model; print(random_model('cosyvoice2', 'full', '/root/.cache/cosystream'))"
bash bench/gpu/level.sh v2_stream_bf16 220 bench/results/h200-2026-11-30b/bench_v2.json --random-full v2 \
  --concurrency 1,16 --modes stream --requests 16
