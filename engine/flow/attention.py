"""Self-attention over the flow's mel frames, with the mask the estimators share: key padding, plus in
streaming the chunk-causal rule (query i sees keys j < (i // chunk + 1) * chunk, counted from frame 0).

The mask is a dense [B,1,T,T] bool built once per estimator call, so SDPA runs its memory-efficient
kernel. FlexAttention (the mask as a function, no dense tensor, invisible key blocks skipped) was tried
inside the compiled estimator on the H200 (torch 2.11, dynamic shapes): Inductor failed to lower it
(``LoweringException`` on the mask function's captured tensor), so the dense mask is the default;
BENCHMARKS.md lists attention among the remaining costs. The folded rule below is the other way.

``WindowAttention`` is the same rule for a streaming call that reuses a request's cached keys
(engine.flow.dit_cache, engine.flow.unet_cache): queries and keys carry their absolute frame
positions, so the keys may come in any order (the cached prefix first, then the window's own).

Folded (``folded=True``; the estimators' ``fold_masks``, ``EngineConfig.flow_attention``): no mask tensor
at all. The rule moves into E extra dimensions of q and k, whose product adds a large negative bias to a
score exactly where the mask says no, so SDPA runs unmasked and may pick its flash kernel. A key is
hidden by its padding flag (one dimension) and, streaming, by the chunk thresholds it passes that the
query does not: sum over b of [query chunk < b] x [key chunk >= b] is 0 for key chunk <= query chunk and
at least 1 after. A visible key's score gets exactly 0 added (products of 0 and 1 with the bias, summed),
so the softmax is the masked one. E pads the head dimension to a multiple of 8 (flash's need): 64 -> 72
for full attention, 64 -> 96 streaming (31 thresholds: calls of up to 32 chunks, 1600 frames at 50;
longer ones use the dense mask).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

FOLD_THRESHOLDS = 31  # chunk thresholds of a folded streaming rule: calls of up to 32 chunks
MASKED_SCORE = -1.0e4  # a hidden key's score after the softmax scale: exp(-1e4) is 0 in float32


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
    ``dense`` [B,1,T,T] bool, or (``folded``) ``fold`` and no dense mask. A plain class, not a frozen
    dataclass: TorchDynamo traces its construction inside the compiled estimator."""

    def __init__(self, valid: Tensor, chunk: int, folded: bool = False) -> None:
        self.valid = valid
        self.fold: Fold | None = None
        if folded:
            pos = torch.arange(valid.size(1), device=valid.device).expand_as(valid)
            self.fold = Fold.of(pos, pos, valid, chunk)
        self.dense = None if self.fold else attention_mask(valid, chunk).unsqueeze(1)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q, k, v [B,H,T,D] -> [B,H,T,D], softmax scale 1/sqrt(D)."""
        if self.fold is not None:
            return self.fold(q, k, v)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.dense)


class Fold:
    """A mask folded into extra q/k dimensions (module docstring): ``query`` [B,Q,F] and ``key`` [B,K,F]
    of 0/1 and bias entries (F = 1 + thresholds), their q/k product the mask's bias. A plain class:
    TorchDynamo traces it."""

    def __init__(self, query: Tensor, key: Tensor) -> None:
        self.query, self.key = query, key
        # (head dim, dtype) -> the extra dims ready for every layer: padded, scaled and cast once per call
        # of the estimator, not once per layer (22 DiT or 56 U-Net layers x 10 steps)
        self._ready: dict[tuple[int, torch.dtype], tuple[Tensor, Tensor]] = {}

    @classmethod
    def of(cls, query_pos: Tensor, key_pos: Tensor, key_valid: Tensor, chunk: int) -> Fold | None:
        """The rule of ``positional_mask`` folded; None where it does not fit: streaming past 32 chunks.
        Every caller's positions are below the key width (frames 0..T-1, or a cached prefix and then
        queries after it), so the check reads shapes only (no host sync, one guard when compiled)."""
        if chunk > 0 and key_pos.size(1) > (FOLD_THRESHOLDS + 1) * chunk:
            return None
        hidden = (~key_valid).float()[..., None]  # [B,K,1]
        ones = torch.ones_like(query_pos, dtype=torch.float32)[..., None]  # [B,Q,1]
        if chunk <= 0:
            return cls(ones, hidden)
        bounds = torch.arange(1, FOLD_THRESHOLDS + 1, device=query_pos.device)  # [N] chunk thresholds
        before = (query_pos[..., None] // chunk < bounds).float()  # [B,Q,N]
        passed = (key_pos[..., None] // chunk >= bounds).float()  # [B,K,N]
        return cls(torch.cat([ones, before], -1), torch.cat([hidden, passed], -1))

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [B,H,Q,D], k and v [B,H,K,D] -> [B,H,Q,D]: unmasked SDPA over the folded dimensions, scale
        1/sqrt(D) as the masked call's."""
        (b, h, _, d), scale = q.shape, 1.0 / math.sqrt(q.size(-1))
        qx, kx = self._extras(d, q.dtype)
        q2 = torch.cat([q, qx[:, None].expand(b, h, -1, -1)], -1)
        k2 = torch.cat([k, kx[:, None].expand(b, h, -1, -1)], -1)
        out = F.scaled_dot_product_attention(q2, k2, F.pad(v, (0, qx.size(-1))), scale=scale)
        return out[..., :d]

    def _extras(self, d: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The query and key extra dims [B,Q,E], [B,K,E] for heads of ``d`` in ``dtype``: padded so the head
        is a multiple of 8, the key entries scaled to the bias."""
        if (d, dtype) not in self._ready:
            width = self.query.size(-1)
            pad = -(-(d + width) // 8) * 8 - d - width
            # a key dimension's entry (its product with a query's 1, scaled, is the hidden score), finite in
            # the dtype with room for a sum of every fold dimension (float16: -1023, e^-128 is still 0)
            bias = max(MASKED_SCORE * math.sqrt(d), -torch.finfo(dtype).max / 64)
            qx = F.pad(self.query, (0, pad)).to(dtype)
            self._ready[(d, dtype)] = qx, (F.pad(self.key, (0, pad)) * bias).to(dtype)
        return self._ready[(d, dtype)]


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
        self,
        query_pos: Tensor,
        query_valid: Tensor,
        key_pos: Tensor,
        key_valid: Tensor,
        chunk: int,
        folded: bool = False,
    ):
        self.valid = query_valid
        self.fold = Fold.of(query_pos, key_pos, key_valid, chunk) if folded else None
        self.dense = None if self.fold else positional_mask(query_pos, key_pos, key_valid, chunk).unsqueeze(1)

    @classmethod
    def after_prefix(
        cls,
        query_pos: Tensor,
        query_valid: Tensor,
        past: int,
        starts: Tensor,
        chunk: int,
        folded: bool = False,
    ) -> WindowAttention:
        """Queries [2B,Q] over a cached prefix of ``past`` key columns (column j is frame j, real below the
        row's start, ``starts`` [2B,1]), then over the queries themselves."""
        cached = torch.arange(past, device=query_pos.device).expand(query_pos.size(0), -1)  # [2B,past]
        keys, keys_valid = torch.cat([cached, query_pos], 1), torch.cat([cached < starts, query_valid], 1)
        return cls(query_pos, query_valid, keys, keys_valid, chunk, folded)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [B,H,Q,D], k and v [B,H,K,D] -> [B,H,Q,D], softmax scale 1/sqrt(D)."""
        if self.fold is not None:
            return self.fold(q, k, v)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.dense)
