#!/usr/bin/env bash
# Ran 2026-11-30 (fourth session), partly inline: the log is in BENCHMARKS.md, results in bench/results/h200-2026-11-30d.
# Planned as call 2 of 3: before/after for the speed changes not yet A/B-measured (issue 5), all
# against this session's bf16 run: the flow solver eager instead of CUDA graphs; no batching across
# requests (--flow-batch 1); and a torch.profiler pass over one fast-start stream, to see where its first
# chunk's 1.4 s goes.
set -u
source bench/gpu/setup.sh
B=bench/results/h200-2026-11-30c/bench_v3_bf16/results.json
bash bench/gpu/level.sh v3_eager 200 "$B" --random-full v3 --concurrency 1,16 --modes stream --requests 16 \
  --no-cuda-graphs
bash bench/gpu/level.sh v3_flow_batch1 170 "$B" --random-full v3 --concurrency 1,16 --modes stream \
  --requests 16 --flow-batch 1
bash bench/gpu/level.sh v3_fast_profile 160 "$B" --random-full v3 --concurrency 1 --modes stream \
  --requests 8 --fast-start on --profile-dir "$OUT/prof_fast"
ls "$OUT/prof_fast" 2>/dev/null
