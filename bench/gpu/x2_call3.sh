#!/usr/bin/env bash
# (As run on 2026-11-30: the fast-start-off flag and the pytest line were added on the device after call 2.)
# H200 x2, call 3 of 3: on GPU 0 every speed option at once (bf16 flow, fast start, every flow graph captured
# at load after vLLM has started: its count, time and memory in the log and the results' meta), compared with
# the last session's v3 run; then wait for the soak on GPU 1 to finish and collect its report.
set -u
source bench/gpu/setup.sh
CACHE=/root/.cache/cosystream
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m bench --random-full v3 --cache-dir "$CACHE" \
  --backend vllm --device cuda --concurrency 1,16,64 --modes stream --tokens 250 --requests 16 \
  --flow-dtype bfloat16 --graph-warmup-s 15 --fast-start off --hardware "1x NVIDIA H200 (141 GB), torch 2.11 cu130, vLLM 0.26.0" \
  --out "$OUT/bench_v3_all" > "$OUT/bench_v3_all.log" 2>&1
echo "bench v3 all rc=$? $(date +%T)"; grep -E " c=|captured|peak" "$OUT/bench_v3_all.log" | tail -6
python3 -m bench.compare bench/results/h200-2026-11-30b/bench_v3.json "$OUT/bench_v3_all/results.json" \
  --out "$OUT/compare_v3_all.md" && cat "$OUT/compare_v3_all.md"
rm -f "$OUT"/*/results.png
CUDA_VISIBLE_DEVICES=0 timeout 290 python3 -u -m pytest -v -m gpu -p no:cacheprovider -rf --tb=short tests/engine/lm/test_vllm_backend.py tests/engine/test_flow_graphs.py > "$OUT/pytest_gpu.log" 2>&1; echo "pytest rc=$?"; grep -E "PASSED|FAILED|passed|failed" "$OUT/pytest_gpu.log" | tail -12
for _ in $(seq ${SOAK_WAIT:-70}); do [ -f /root/soak/soak.md ] && break; sleep 5; done
cp /root/soak/soak.json /root/soak/soak.md "$OUT/" 2>/dev/null
grep -v "INFO:httpx" /root/soak.log | tail -300 > "$OUT/soak.log"
cat /root/soak/soak.md 2>/dev/null; tail -3 /root/soak.log
