#!/usr/bin/env bash
# H200 call: set up vLLM, build the full-size random v3 model once, run the vLLM-vs-native check.
set -u
source bench/gpu/setup.sh
CACHE=/root/.cache/cosystream
python3 -c "from bench.__main__ import random_model; print(random_model('cosyvoice3', 'full', '$CACHE'))" 2>&1 | tail -2
M=$CACHE/bench/cosyvoice3-full
timeout 330 python3 -m bench.vllm_check --model "$M" --dtype bfloat16 --cache "$CACHE" --out "$OUT/vllm_check_v3_bf16.json" \
  > "$OUT/vllm_check_v3.log" 2>&1; echo "vllm_check rc=$?"
tail -40 "$OUT/vllm_check_v3.log"
