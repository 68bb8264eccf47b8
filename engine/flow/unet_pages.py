"""Reuse of a request's finished frames in the CUDA-graph flow solver for CosyVoice2's U-Net: the page pool
of engine.flow.dit_pages, plus each causal conv's state.

Why it is exact, and what is kept: engine.flow.unet_cache. Here a chunk's keys/values live in its page, as
for the DiT, and so does every causal conv's input over the chunk's last (kernel - 1) frames, at every step
and in both CFG rows: the "conv state" that a window starting right after the chunk reads in place of the
frames before it. A window takes its states from the page of the chunk before it (``PagedBatch.lead``;
zeros for a window from frame 0, as the conv's own padding), and writes the states of every chunk it keeps.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from engine.flow.dit_pages import PagedRows, PagedWindow
from engine.flow.unet_cache import attend

if TYPE_CHECKING:
    from engine.flow.unet_cache import CausalConv


class PagedUNetStep:
    """One U-Net call (one Euler step) over a batch of page windows: what ``forward_window`` asks of its step
    (mask, convs and attention layers in call order), built inside the compiled estimator from tensors only
    (a plain class: TorchDynamo traces it).

    kv and ``rows`` as ``PagedWindow``'s (rows.lead [2B,1]: the page of the chunk before each window);
    states [steps x pages, 2, numbers]: the pool's conv states (``PagePool.states_pages``; each conv's
    channels x left frames, flattened, convs in call order); convs: each conv's (input channels, left frames).
    """

    def __init__(
        self,
        kv: Tensor,
        states: Tensor,
        rows: PagedRows,
        chunk: int,
        queries: int,
        convs: Sequence[tuple[int, int]],
        folded: bool = False,  # the attention rule folded into q/k dims (engine.flow.attention)
    ) -> None:
        self.window = PagedWindow(kv, rows, 0, chunk, queries, folded)
        self.mask = self.window.rule.valid[:, None, :]  # [2B,1,Q] bool: the real query frames
        self.chunk, self.convs, self.layers = chunk, list(convs), 0
        # [2B,N], each row's CFG half; zero where a window starts at frame 0
        past = states[rows.lead[:, 0], rows.cfg]
        self.past = past * rows.start[:, None].gt(0).to(past.dtype)
        self.offsets = [0, *itertools.accumulate(c * left for c, left in self.convs)]
        # each conv's states at every window chunk's end: [2B,chunks,C*left]
        self.kept: list[Tensor] = []

    def conv(self, conv: CausalConv, x: Tensor) -> Tensor:
        """The next causal conv on the window's frames x [2B,C,Q] (masked), its cached left frames in place
        of the padding; the states at each chunk's end are kept on the way."""
        index = len(self.kept)
        channels, left = self.convs[index]
        past = self.past[:, self.offsets[index] : self.offsets[index + 1]].unflatten(1, (channels, left))
        chunks = x.size(2) // self.chunk
        ends = x[:, :, : chunks * self.chunk].unflatten(2, (chunks, self.chunk))[..., self.chunk - left :]
        self.kept.append(ends.transpose(1, 2).flatten(2))
        return conv.after(past, x)

    def attention(self) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
        """The next attention layer's rule: its queries over the prefix pages' keys, then the window's."""
        self.layers += 1
        return functools.partial(attend, self.window.rule, self.window.keys_values(0, self.layers - 1))

    def check(self) -> None:
        if len(self.kept) != len(self.convs):
            raise RuntimeError(f"U-Net window: {len(self.kept)} convs ran, the layout has {len(self.convs)}")

    def written(self) -> tuple[Tensor, Tensor]:
        """(keys/values [depth,2,2B,H,Q,D], conv states [2B,chunks,numbers]) to keep."""
        return self.window.written(), torch.cat(self.kept, dim=2)
