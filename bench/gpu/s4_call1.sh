#!/usr/bin/env bash
# Ran 2026-11-30 (fourth session), partly inline: the log is in BENCHMARKS.md, results in bench/results/h200-2026-11-30d.
# Planned as call 1 of 3 (after the four part-copy calls; kind nvidia-h200 is enough): set up, build
# the full-size random v2 and v3 models (shared with the GPU tests through ~/.cache/cosystream), run the GPU
# tests (issue 4: vLLM bf16 greedy parity within the documented tolerance, 16-stream engine run, graph
# output copy; every wait bounded), then v3 offline with the bf16 solver (issue 5).
set -u
source bench/gpu/setup.sh
CACHE=/root/.cache/cosystream
for fam in cosyvoice2 cosyvoice3; do
  python3 -c "from bench.__main__ import random_model; print(random_model('$fam', 'full', '$CACHE'))" &
done; wait
CUDA_VISIBLE_DEVICES=0 timeout 330 python3 -u -m pytest -v -m gpu -p no:cacheprovider -rf --tb=short \
  tests/engine/lm/test_vllm_backend.py tests/engine/test_flow_graphs.py tests/engine/test_token2wav.py \
  > "$OUT/pytest_gpu.log" 2>&1
echo "pytest gpu rc=$? $(date +%T)"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/pytest_gpu.log" | tail -10
bash bench/gpu/level.sh v3_offline_bf16 130 bench/results/h200-2026-11-30b/bench_v3.json \
  --random-full v3 --concurrency 1,16,64 --modes offline --requests 16
