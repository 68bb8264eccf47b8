"""Self-attention over the flow's mel frames, with the mask the estimators share: key padding, plus in
streaming the chunk-causal rule (query i sees keys j < (i // chunk + 1) * chunk, counted from frame 0).

The mask is a dense [B,1,T,T] bool built once per estimator call, so SDPA runs its memory-efficient
kernel. FlexAttention (the mask as a function, no dense tensor, invisible key blocks skipped) was tried
inside the compiled estimator on the H200 (torch 2.11, dynamic shapes): Inductor failed to lower it
(``LoweringException`` on the mask function's captured tensor), so the dense mask stays; BENCHMARKS.md
lists attention among the remaining costs.

``WindowAttention`` is the same rule for a streaming call that reuses a request's cached keys
(engine.models.dit_cache, engine.models.unet_cache): queries and keys carry their absolute frame
positions, so the keys may come in any order (the cached prefix first, then the window's own).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def attention_mask(valid: Tensor, chunk: int = 0) -> Tensor:
    """[B,T] valid positions -> [B,T,T] bool, True = query i may attend key j.

    chunk > 0 is the streaming mask: j < (i // chunk + 1) * chunk, all left chunks (the reference's
    ``subsequent_chunk_mask`` ignores num_left_chunks); chunks count from frame 0, i.e. from the prompt.
    """
    size = valid.size(1)
    keys = valid[:, None, :]
    if chunk <= 0:
        return keys.expand(-1, size, -1)
    pos = torch.arange(size, device=valid.device)
    visible = pos[None, :] < ((pos // chunk + 1) * chunk)[:, None]
    return keys & visible[None]


class FrameAttention:
    """One estimator call's attention rule, built once and used by every layer: ``valid`` [B,T] bool and
    ``dense`` [B,1,T,T] bool. A plain class, not a frozen dataclass: TorchDynamo traces its construction
    inside the compiled estimator."""

    def __init__(self, valid: Tensor, chunk: int) -> None:
        self.valid = valid
        self.dense = attention_mask(valid, chunk).unsqueeze(1)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q, k, v [B,H,T,D] -> [B,H,T,D], softmax scale 1/sqrt(D)."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.dense)


def positional_mask(query_pos: Tensor, key_pos: Tensor, key_valid: Tensor, chunk: int = 0) -> Tensor:
    """Queries [B,Q] and keys [B,K] at absolute frame positions -> [B,Q,K] bool, True = may attend.

    The rule of ``attention_mask`` (key padding; chunk > 0: j < (i // chunk + 1) * chunk) stated on
    positions instead of indices: with query_pos = key_pos = arange(T) it is ``attention_mask``.
    """
    keys = key_valid[:, None, :]
    if chunk <= 0:
        return keys.expand(-1, query_pos.size(1), -1)
    ends = (query_pos // chunk + 1) * chunk  # [B,Q]: first frame past each query's chunk
    return keys & (key_pos[:, None, :] < ends[:, :, None])


class WindowAttention:
    """The attention rule of a window of queries over keys in any order, both at absolute positions:
    ``valid`` [B,Q] the real (unpadded) queries and ``dense`` [B,1,Q,K]; called like ``FrameAttention``."""

    def __init__(
        self, query_pos: Tensor, query_valid: Tensor, key_pos: Tensor, key_valid: Tensor, chunk: int
    ):
        self.valid = query_valid
        self.dense = positional_mask(query_pos, key_pos, key_valid, chunk).unsqueeze(1)

    @classmethod
    def after_prefix(
        cls, query_pos: Tensor, query_valid: Tensor, past: int, starts: Tensor, chunk: int
    ) -> WindowAttention:
        """Queries [2B,Q] over a cached prefix of ``past`` key columns (column j is frame j, real below the
        row's start, ``starts`` [2B,1]), then over the queries themselves."""
        cached = torch.arange(past, device=query_pos.device).expand(query_pos.size(0), -1)  # [2B,past]
        keys, keys_valid = torch.cat([cached, query_pos], 1), torch.cat([cached < starts, query_valid], 1)
        return cls(query_pos, query_valid, keys, keys_valid, chunk)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [B,H,Q,D], k and v [B,H,K,D] -> [B,H,Q,D], softmax scale 1/sqrt(D)."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.dense)
