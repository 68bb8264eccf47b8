#!/usr/bin/env bash
# Next H200 session, one call (after the four part-copy calls, sent in the SAME batch so the machine is not
# released in between; every copy does `mkdir -p /root/vb`; kind nvidia-h200). What the fourth session left:
# the GPU tests not yet run (v2 flow graph vs eager in true fp32; v3 HiFT graph capture vs eager), then the
# HiFT-graph A/B (v3, 1 and 16 streams, same call for before and after). s5_call2.sh: v3 at 64 streams with
# every graph pre-captured. Each bench level gets >= 150 s: the engine and vLLM take ~70 s to start.
set -u
source bench/gpu/setup.sh
CUDA_VISIBLE_DEVICES=0 timeout 100 python3 -u -m pytest -v -m gpu -p no:cacheprovider -rf --tb=short \
  tests/engine/test_flow_graphs.py tests/engine/test_hift_graphs.py > "$OUT/pytest_graphs.log" 2>&1
echo "pytest rc=$? $(date +%T)"; grep -E "PASSED|FAILED|passed|failed" "$OUT/pytest_graphs.log" | tail -5
python3 -c "from bench.__main__ import random_model; print(random_model('cosyvoice3', 'full', '/root/.cache/cosystream'))"
bash bench/gpu/level.sh v3_base 150 - --random-full v3 --concurrency 1,16 --modes stream --requests 16
bash bench/gpu/level.sh v3_hift_graphs 170 "$OUT/v3_base/results.json" --random-full v3 --concurrency 1,16 \
  --modes stream --requests 16 --hift-graphs
