#!/usr/bin/env bash
# One bench run on GPU 0 of the H200 machine: level.sh NAME TIMEOUT_S BEFORE_JSON|- BENCH_ARGS...
# Keeps two files per run (at most 8 come back per call): $OUT/NAME/results.json and $OUT/NAME.log, which
# ends with the before/after table against BEFORE_JSON (python -m bench.report redraws md and plot later).
name=$1 limit=$2 before=$3
shift 3
CUDA_VISIBLE_DEVICES=0 timeout "$limit" python3 -m bench --cache-dir /root/.cache/cosystream --device cuda \
  --backend vllm --tokens 250 --hardware "1x NVIDIA H200 (141 GB), torch 2.11 cu130, vLLM 0.26.0" "$@" \
  --out "$OUT/$name" > "$OUT/$name.log" 2>&1
echo "$name rc=$? $(date +%T)"
grep -E " c=|captured|Error" "$OUT/$name.log" | cut -c1-220 | tail -8
rm -f "$OUT/$name/results.png" "$OUT/$name/results.md"
if [ "$before" != - ] && [ -f "$OUT/$name/results.json" ]; then
  python3 -m bench.compare "$before" "$OUT/$name/results.json" --out /tmp/compare_$name.md >/dev/null \
    && tee -a "$OUT/$name.log" < /tmp/compare_$name.md | tail -6
fi
