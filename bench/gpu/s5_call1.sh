#!/usr/bin/env bash
# Fifth session, call 1 (after the four part-copy calls, sent in the SAME batch so the machine is not
# released in between; every copy does `mkdir -p /root/vb`; kind nvidia-h200): the graph GPU tests (v2 flow
# graph vs eager in true fp32; v3 flow and HiFT graph capture vs eager), then the HiFT-graph A/B (v3, 1 and
# 16 streams, eager first, same call). It ran with the then opt-in `--hift-graphs`; HiFT graphs are the
# default now, so the "before" level passes --no-hift-graphs. Each level gets >= 200 s: the engine and vLLM
# take ~70 s to start (150 s cut the first level before its 16-stream wave).
set -u
source bench/gpu/setup.sh
CUDA_VISIBLE_DEVICES=0 timeout 100 python3 -u -m pytest -v -m gpu -p no:cacheprovider -rf --tb=short \
  tests/engine/test_flow_graphs.py tests/engine/test_hift_graphs.py > "$OUT/pytest_graphs.log" 2>&1
echo "pytest rc=$? $(date +%T)"; grep -E "PASSED|FAILED|passed|failed" "$OUT/pytest_graphs.log" | tail -5
python3 -c "from bench.__main__ import random_model; print(random_model('cosyvoice3', 'full', '/root/.cache/cosystream'))"
bash bench/gpu/level.sh v3_base 200 - --random-full v3 --concurrency 1,16 --modes stream --requests 16 \
  --no-hift-graphs
bash bench/gpu/level.sh v3_hift_graphs 200 "$OUT/v3_base/results.json" --random-full v3 --concurrency 1,16 \
  --modes stream --requests 16
