#!/usr/bin/env bash
# H200 x2, call 2 of 3 (the soak runs on GPU 1), on GPU 0: v3 with fast start (auto, the default) at 1/16/128
# streams, compared with the last session's v3 run; v2 at 64 and 128 streams, streaming and offline; then
# the flow graphs pre-captured at load (graph_warmup_s=15, native LM: no vLLM needed): count, time, memory.
set -u
source bench/gpu/setup.sh
CACHE=/root/.cache/cosystream
HW="1x NVIDIA H200 (141 GB), torch 2.11 cu130, vLLM 0.26.0"
CUDA_VISIBLE_DEVICES=0 timeout ${BENCH_TIMEOUT:-220} python3 -m bench --random-full v3 --cache-dir "$CACHE" \
  --backend vllm --device cuda --concurrency 1,16,128 --modes stream --tokens 250 --requests 16 \
  --hardware "$HW" --out "$OUT/bench_v3_fast" > "$OUT/bench_v3_fast.log" 2>&1
echo "bench v3 fast start rc=$? $(date +%T)"; grep " c=" "$OUT/bench_v3_fast.log" | tail -4
python3 -m bench.compare bench/results/h200-2026-11-30b/bench_v3.json "$OUT/bench_v3_fast/results.json" \
  --out "$OUT/compare_v3_fast_start.md" && cat "$OUT/compare_v3_fast_start.md"
CUDA_VISIBLE_DEVICES=0 timeout ${BENCH_TIMEOUT:-220} python3 -m bench --random-full v2 --cache-dir "$CACHE" \
  --backend vllm --device cuda --concurrency 64,128 --modes stream,offline --tokens 250 --hardware "$HW" \
  --out "$OUT/bench_v2_high" > "$OUT/bench_v2_high.log" 2>&1; echo "bench v2 64/128 rc=$? $(date +%T)"
grep " c=" "$OUT/bench_v2_high.log" | tail -4
rm -f "$OUT"/*/results.png  # at most 8 files come back; python -m bench.report redraws a plot from the json
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -c "
import logging, time, torch
from engine.config import EngineConfig
from engine.engine import TTSEngine
logging.basicConfig(level=logging.INFO)
t = time.time()
e = TTSEngine.load(EngineConfig(model='$CACHE/bench/cosyvoice3-full', backend='native', graph_warmup_s=15))
print(f'precapture probe: load {time.time() - t:.0f} s, allocated {torch.cuda.memory_allocated() / 2**30:.1f} GiB, '
      f'reserved {torch.cuda.memory_reserved() / 2**30:.1f} GiB, peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB')
e.close()
" 2>&1 | grep -E "precapture probe|captured|Error" | tail -3
grep -v "INFO:httpx" /root/soak.log | tail -2
