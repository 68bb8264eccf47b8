"""Reuse of a request's finished frames across its streaming CosyVoice2 flow calls (the U-Net estimator).

Why it is exact: as for the DiT (engine.flow.dit_cache). In a streaming call every attention layer of the
U-Net is chunk-causal on absolute frames (chunks of ``static_chunk_size`` from frame 0), every conv is
causal (kernel 3: frame i reads frames i-2..i of its input) or 1x1, LayerNorm, Mish and the FFNs work per
frame, the time embedding per row, the skip concatenation per frame, and the masks are 1 on every real
frame. With the fixed noise and unchanged mu/cond/spks of earlier frames, frames [0, F), F = (T // C) * C,
follow the same trajectory in every later call (checked on a tiny random U-Net in fp32: conv inputs and
keys/values of finished frames equal to 5e-6 between calls; a frame of the incomplete chunk moves by 0.2).

What a request keeps (``UNetCache``): the ``DiTCache`` buffers of keys/values of every step, attention
layer and CFG row for frames [0, F) (no x: mel_dim 0 in its layout), and per causal conv, step and CFG row
its input's last (kernel - 1) frames before F, the "conv state": a fixed cost per request. A window of
query frames [F, T) (``UNetWindow``) runs every layer: each causal conv reads its cached left frames where
the full call reads the frames before F (zeros where the window starts at frame 0, as the conv's padding),
each attention layer attends over the cached keys/values followed by the window's. The new conv states, at
the new boundary, are taken from the window's conv inputs and replace the old ones at ``commit``, so a
failed call leaves the cache as it was.

Memory: keys + values x steps x layers x 2 CFG rows x heads x dim_head a frame. The released U-Net (56
attention layers of 8 x 64, 10 steps) keeps 2 * 10 * 56 * 2 * 512 = 1.15M numbers a frame: 4.6 MB in
float32; its conv states (31 convs of 8,256 input channels in all, 2 frames each) 10 * 2 * 2 * 8,256 = 330k
numbers, 1.3 MB a request.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from engine.flow.attention import WindowAttention
from engine.flow.dit_cache import CacheLayout, DiTCache, DiTWindow, KeysValues, ReuseBudget

# One attention layer's rule in a window: (q, k, v) of the window -> its queries' output, as FrameAttention
AttentionRule = Callable[[Tensor, Tensor, Tensor], Tensor]


class CausalConv(Protocol):
    """engine.flow.unet.CausalConv1d, as a window runs it (that module imports this one)."""

    def after(self, past: Tensor, x: Tensor) -> Tensor:
        """x [B,C,Q] following ``past`` [B,C,kernel-1], the input's frames before x -> [B,C_out,Q]."""
        ...


@dataclass(frozen=True)
class UNetLayout(CacheLayout):
    """``CacheLayout`` (depth: attention layers; mel_dim and lead 0) plus the causal convs, in call order:
    each one's (input channels, left frames it reads = kernel - 1)."""

    convs: tuple[tuple[int, int], ...]


class UNetCache(DiTCache):
    """One request's finished frames of its streaming U-Net calls: ``DiTCache``'s keys/values, plus each
    causal conv's state at ``frames`` (see the module doc)."""

    def __init__(self, budget: ReuseBudget | None = None) -> None:
        super().__init__(budget)
        # per causal conv: [steps, 2 (cond, uncond), channels, left]: input frames [frames - left, frames)
        self.states: list[Tensor] | None = None

    def _fixed_bytes(self, layout: CacheLayout) -> int:
        if not isinstance(layout, UNetLayout):
            raise TypeError(f"a U-Net cache needs a UNetLayout, got {type(layout).__name__}")
        numbers = sum(channels * left for channels, left in layout.convs)
        return layout.steps * 2 * numbers * layout.kv_dtype.itemsize

    def clear(self) -> None:
        self.states = None
        super().clear()


class UNetWindow(DiTWindow):
    """One cached streaming U-Net call over a batch of rows (``DiTWindow`` with no lead): row b runs query
    frames [start_b, total_b) and afterwards keeps [start_b, end_b); ``step`` gives each Euler step's
    convs and attention layers their cached left context."""

    def __init__(self, caches: Sequence[UNetCache], totals: Sequence[int], layout: UNetLayout):
        super().__init__(caches, totals, layout)
        self.unet_caches, self.layout = list(caches), layout
        self.mask = self.rule.valid[:, None, :]  # [2B,1,Q] bool: the real query frames
        self.pending = [self._new_states(s, e) for s, e in zip(self.starts, self.ends)]

    def _new_states(self, start: int, end: int) -> list[Tensor] | None:
        """Buffers for a row's conv states at its new boundary; None where the row keeps no new frames."""
        if end <= start:
            return None
        lay = self.layout
        shape = (lay.steps, 2)
        return [torch.empty(*shape, c, left, dtype=lay.kv_dtype, device=lay.device) for c, left in lay.convs]

    def step(self, step: int) -> UNetStep:
        return UNetStep(self, step)

    def conv(self, step: int, index: int, conv: CausalConv, x: Tensor) -> Tensor:
        """Causal conv ``index`` on the window's frames x [2B,C,Q] (masked): each row's cached left frames
        in place of the padding; the frames before each row's new boundary are kept on the way."""
        left = self.layout.convs[index][1]
        past = x.new_zeros(x.size(0), x.size(1), left)  # zeros: a window from frame 0 pads as the conv does
        for row, (cache, start, end) in enumerate(zip(self.unet_caches, self.starts, self.ends)):
            if start > 0 and cache.states is not None:
                past[row :: self.rows] = cache.states[index][step]
            pending = self.pending[row]
            if pending is not None:
                pending[index][step] = x[row :: self.rows, :, end - start - left : end - start]
        return conv.after(past, x)

    def attention(self, step: int, layer: int) -> AttentionRule:
        return functools.partial(attend, self.rule, self.keys_values(step, layer))

    def commit(self) -> None:
        super().commit()
        for cache, pending in zip(self.unet_caches, self.pending):
            if pending is not None:
                cache.states = pending


def attend(rule: WindowAttention, keys_values: KeysValues, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """A window's attention layer: its queries (q) over what ``keys_values`` makes of its keys/values."""
    return rule(q, *keys_values(k, v))


class UNetStep:
    """One Euler step of a ``UNetWindow``: numbers the convs and attention layers in the order the U-Net
    calls them (``check`` then confirms it called all of them once)."""

    def __init__(self, window: UNetWindow, step: int) -> None:
        self.window, self.index, self.convs, self.layers = window, step, 0, 0

    @property
    def mask(self) -> Tensor:
        """[2B,1,Q] bool: the window's real query frames."""
        return self.window.mask

    def conv(self, conv: CausalConv, x: Tensor) -> Tensor:
        self.convs += 1
        return self.window.conv(self.index, self.convs - 1, conv, x)

    def attention(self) -> AttentionRule:
        self.layers += 1
        return self.window.attention(self.index, self.layers - 1)

    def check(self) -> None:
        lay = self.window.layout
        if (self.convs, self.layers) != (len(lay.convs), lay.depth):
            raise RuntimeError(
                f"U-Net window: {self.convs} convs and {self.layers} attention layers ran, the layout has "
                f"{len(lay.convs)} and {lay.depth}"
            )
