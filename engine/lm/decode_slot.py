"""The native loop's lone request decoded from one CUDA graph: a fixed key/value buffer (the slot) and a step
captured once, replayed at every position.

Why: the native loop serves a start's first requests while vLLM starts (``engine.lm.handover``), and every
request where vLLM is absent. Op by op, a step of the 24-layer LM is ~800 kernel launches from Python; beside
a start's background work on other threads (graph captures, the flow compile, vLLM's import) the warm-up's
steps took 50-80 ms each on the H200. Replayed, a step is one launch.

A request adopts the slot when it is the only one decoding: its cache's positions are copied into the slot
once, and its ``KVCache`` then reads and writes the slot itself (its ``kv`` is the slot), so a batched
step with later arrivals uses it like any other cache. It leaves the slot when it ends (its cache is
dropped) or when it outgrows it (``KVCache.reserve`` moves it to a buffer of its own). Attention reads the
whole slot under a mask (``qwen2.SlotStep``): at batch 1 that costs less than the launches it saves.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from engine import device as devices
from engine.lm.qwen2 import KVCache
from engine.lm.speech_lm import SpeechLM

log = logging.getLogger(__name__)
# positions the slot holds (prompt speech + text + generated tokens): 12 KiB each for the 0.5B LMs in
# bf16 (24 layers x 2 x 2 kv heads x 64 x 2 B), so 24 MiB; a longer request goes on op by op
SLOT_POSITIONS = 2048


class DecodeSlot:
    """One request's keys/values at a fixed address and its decode step, replayed from a CUDA graph where
    graphs are supported (``graphs``), else run op by op on the same buffers (the CPU: for tests)."""

    def __init__(self, lm: SpeechLM, capacity: int = SLOT_POSITIONS, graphs: bool = True):
        c, weight = lm.config, lm.speech_embedding.weight
        self.lm = lm
        shape = (c.num_layers, 2, c.num_kv_heads, capacity, c.head_dim)
        self.kv = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        self.ids = torch.zeros(1, dtype=torch.long, device=weight.device)  # the last sampled id
        self.pos = torch.zeros(1, dtype=torch.long, device=weight.device)  # where its keys/values go
        self.graphs = graphs and devices.graphs_supported(weight.device)
        self._call: devices.CapturedCall | None = None

    @property
    def capacity(self) -> int:
        return self.kv.shape[3]

    def holds(self, cache: KVCache | None) -> bool:
        """Whether ``cache`` reads and writes the slot."""
        return cache is not None and cache.kv is self.kv

    def has_room(self, cache: KVCache) -> bool:
        """Room for the next position of ``cache`` (adopted or not)."""
        return cache.length < self.capacity

    def adopt(self, cache: KVCache) -> None:
        """Copy the cache's positions into the slot; from now on the cache is the slot. The caller makes
        sure no other live cache holds it (the native loop: only when one request is decoding)."""
        n = cache.length
        self.kv[:, :, :, :n] = cache.kv[:, :, :, :n]
        cache.kv = self.kv

    def step(self, last: int, cache: KVCache) -> Tensor:
        """The next position of the slot's cache: the last sampled id -> hidden [1, H]; the cache grows by
        one."""
        if not (self.holds(cache) and self.has_room(cache)):
            raise ValueError("the slot's step needs a cache that holds the slot and has room")
        self.ids.fill_(last)
        self.pos.fill_(cache.length)
        hidden = self._replay() if self.graphs else self._run()
        cache.length += 1
        return hidden

    def _run(self) -> Tensor:
        return self.lm.decode_in_slot(self.ids, self.kv, self.pos)

    def _replay(self) -> Tensor:
        """Captured at the first step (its warm-up run writes this position's keys/values, as the replay
        then does again: the step is idempotent at a position); a capture that fails turns graphs off."""
        if self._call is None:
            try:
                self._call = devices.CapturedCall(self._run, ())
            except RuntimeError as err:  # the step then runs op by op: slower, the same tokens
                log.warning("the native LM's decode step could not be captured (%s): it runs op by op", err)
                self.graphs = False
                return self._run()
            log.info("the native LM's decode step is captured (%d positions)", self.capacity)
        return self._call()
