#!/usr/bin/env bash
# H200 x2, call 1 of 3 (after the bundle parts are in /root/vb): set up, build both full-size random models,
# start the 32-stream soak on GPU 1 as a daemon (x2_call3.sh collects it), then on GPU 0 the v3 bench with the
# bf16 flow solver (fast start off: one change against the last session's v3 run) and v2 at 64/128 streams.
# Env: SOAK_MIN (default 20). Budget: setup ~60 s + model builds ~40 s + 200 s + 220 s, inside 600 s.
set -u
source bench/gpu/setup.sh
CACHE=/root/.cache/cosystream
HW="1x NVIDIA H200 (141 GB), torch 2.11 cu130, vLLM 0.26.0"
for fam in cosyvoice2 cosyvoice3; do
  python3 -c "from bench.__main__ import random_model; print(random_model('$fam', 'full', '$CACHE'))" &
done; wait
mkdir -p /root/soakhome
# its own HOME: its own vLLM export directory (no race with the bench's export of the same llm.pt)
HOME=/root/soakhome CUDA_VISIBLE_DEVICES=1 setsid nohup python3 -m bench.soak --model "$CACHE/bench/cosyvoice3-full" \
  --streams 32 --minutes ${SOAK_MIN:-20} --backend vllm --device cuda --sample-s 10 --trim --out /root/soak \
  > /root/soak.log 2>&1 < /dev/null &
echo "soak started $(date +%T)"
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m bench --random-full v3 --cache-dir "$CACHE" \
  --backend vllm --device cuda --concurrency 1,16,64 --modes stream --tokens 250 --requests 16 \
  --flow-dtype bfloat16 --fast-start off --hardware "$HW" \
  --out "$OUT/bench_v3_bf16" > "$OUT/bench_v3_bf16.log" 2>&1; echo "bench v3 bf16 rc=$? $(date +%T)"
grep " c=" "$OUT/bench_v3_bf16.log" | tail -3
python3 -m bench.compare bench/results/h200-2026-11-30b/bench_v3.json "$OUT/bench_v3_bf16/results.json" \
  --out "$OUT/compare_v3_bf16.md" && cat "$OUT/compare_v3_bf16.md"
CUDA_VISIBLE_DEVICES=0 timeout 220 python3 -m bench --random-full v2 --cache-dir "$CACHE" \
  --backend vllm --device cuda --concurrency 64,128 --modes stream,offline --tokens 250 --hardware "$HW" \
  --out "$OUT/bench_v2_high" > "$OUT/bench_v2_high.log" 2>&1; echo "bench v2 64/128 rc=$? $(date +%T)"
grep " c=" "$OUT/bench_v2_high.log" | tail -4
rm -f "$OUT"/*/results.png  # at most 8 files come back; python -m bench.report redraws a plot from the json
grep -v "INFO:httpx" /root/soak.log | tail -2
