#!/usr/bin/env bash
# H200 x2, call 1 of 3: set up, build both full-size random models, start the 32-stream soak on GPU 1 as a
# daemon (it outlives this call; session2c.sh collects it), then the v3 streaming bench (1/16/64 streams,
# profiled waves at 1 and 64) on GPU 0.
set -u
source bench/gpu/setup.sh
CACHE=/root/.cache/cosystream
python3 -c "import torch; print('GPUs', torch.cuda.device_count())"
for fam in cosyvoice2 cosyvoice3; do
  python3 -c "from bench.__main__ import random_model; print(random_model('$fam', 'full', '$CACHE'))" &
done; wait
mkdir -p /root/soakhome
# its own HOME: its own vLLM export directory (no race with the bench's export of the same llm.pt)
HOME=/root/soakhome CUDA_VISIBLE_DEVICES=1 setsid nohup python3 -m bench.soak --model "$CACHE/bench/cosyvoice3-full" \
  --streams 32 --minutes ${SOAK_MIN:-15} --backend vllm --device cuda --sample-s 10 --out /root/soak \
  > /root/soak.log 2>&1 < /dev/null &
echo "soak started $(date +%T)"
CUDA_VISIBLE_DEVICES=0 timeout ${BENCH_TIMEOUT:-400} python3 -m bench --random-full v3 --cache-dir "$CACHE" \
  --backend vllm --device cuda --concurrency 1,16,64 --modes stream --tokens 250 --requests 16 \
  --profile-dir "$OUT/prof_v3" --hardware "1x NVIDIA H200 (141 GB), torch 2.11 cu130, vLLM 0.26.0" \
  --out "$OUT/bench_v3" > "$OUT/bench_v3.log" 2>&1; echo "bench v3 rc=$?"
grep -v "^INFO:httpx" "$OUT/bench_v3.log" | grep -v "^(EngineCore" | tail -15
tail -3 /root/soak.log
