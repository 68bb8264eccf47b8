#!/usr/bin/env bash
# On the H200 (device tool): unpack the vLLM bundle parts already copied to /root/vb (the last part and the
# wheels in .whl travel with this call), install them into /root/site. Source it: it exports PYTHONPATH.
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1
D=/root/vb SITE=/root/site
mkdir -p "$D/b" "$SITE"
cp .vb/vllm-bundle.part.* "$D/" 2>/dev/null
if [ ! -f "$SITE/.done" ]; then
  cat "$D"/vllm-bundle.part.* | tar -x -C "$D/b" && xz -dc "$D/b/vllm-slim.tar.xz" | tar -x -C "$SITE" \
    && python3 -m pip install -q --no-index --no-deps --target "$SITE" "$D"/b/deps/*.whl \
    && python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl && touch "$SITE/.done"
fi
export PYTHONPATH="$SITE:$PWD"
python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())"
