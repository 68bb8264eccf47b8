#!/usr/bin/env bash
# H200 x2, call 2 of 3 (the soak runs on GPU 1), on GPU 0: v3 with fast start (auto, the default) at 1/16/128
# streams, compared with the last session's v3 run; then the GPU tests (vLLM greedy parity v2 + v3 in fp32 on
# the small models, a 16-stream engine run, the graph output copy): four vLLM starts, ~4-5 min.
set -u
source bench/gpu/setup.sh
CACHE=/root/.cache/cosystream
CUDA_VISIBLE_DEVICES=0 timeout 220 python3 -m bench --random-full v3 --cache-dir "$CACHE" \
  --backend vllm --device cuda --concurrency 1,16,128 --modes stream --tokens 250 --requests 16 \
  --hardware "1x NVIDIA H200 (141 GB), torch 2.11 cu130, vLLM 0.26.0" \
  --out "$OUT/bench_v3_fast" > "$OUT/bench_v3_fast.log" 2>&1
echo "bench v3 fast start rc=$? $(date +%T)"; grep " c=" "$OUT/bench_v3_fast.log" | tail -3
python3 -m bench.compare bench/results/h200-2026-11-30b/bench_v3.json "$OUT/bench_v3_fast/results.json" \
  --out "$OUT/compare_v3_fast_start.md" && cat "$OUT/compare_v3_fast_start.md"
rm -f "$OUT"/*/results.png
CUDA_VISIBLE_DEVICES=0 timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short \
  tests/engine/lm/test_vllm_backend.py tests/engine/test_flow_graphs.py > "$OUT/pytest_gpu.log" 2>&1
echo "pytest gpu rc=$? $(date +%T)"; grep -E "passed|failed|FAILED|Error" "$OUT/pytest_gpu.log" | tail -8
grep -v "INFO:httpx" /root/soak.log | tail -2
