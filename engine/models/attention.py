"""Self-attention over the flow's mel frames, with the mask the estimators share: key padding, plus in
streaming the chunk-causal rule (query i sees keys j < (i // chunk + 1) * chunk, counted from frame 0).

Two kernels compute the same thing. ``sdpa`` materialises a dense [B,1,T,T] bool mask and so runs SDPA's
memory-efficient kernel (every layer re-reads the mask). ``flex`` describes the mask as a function
(FlexAttention): inside ``torch.compile`` it becomes one fused kernel that never builds the dense mask and
skips the key blocks a chunk cannot see; outside a compiled program it runs a slow reference
implementation, so the engine picks it only for compiled estimators (``engine.compiled_estimator``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

KERNELS = ("sdpa", "flex")


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


@dataclass(frozen=True)
class FrameAttention:
    """One estimator call's attention rule, built once and used by every layer.

    ``valid`` [B,T] bool; ``dense`` [B,1,T,T] bool (sdpa) or ``blocks`` (flex), the other None.
    """

    valid: Tensor
    dense: Tensor | None
    blocks: BlockMask | None

    @classmethod
    def build(cls, valid: Tensor, chunk: int, kernel: str = "sdpa") -> FrameAttention:
        if kernel not in KERNELS:
            raise ValueError(f"attention kernel must be one of {KERNELS}, got {kernel!r}")
        if kernel == "flex":
            return cls(valid, None, _block_mask(valid, chunk))
        return cls(valid, attention_mask(valid, chunk).unsqueeze(1), None)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q, k, v [B,H,T,D] -> [B,H,T,D]; softmax scale 1/sqrt(D) either way."""
        if self.blocks is not None:
            out = flex_attention(q, k, v, block_mask=self.blocks)
            assert isinstance(out, Tensor)  # no return_lse: a tensor, not a tuple
            return out
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.dense)


def _block_mask(valid: Tensor, chunk: int) -> BlockMask:
    """The same rule as ``attention_mask`` as FlexAttention's mask function (evaluated per block and per
    element inside the kernel; no [T,T] tensor)."""
    batch, size = valid.shape

    def visible(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        if chunk <= 0:
            return valid[b, kv]
        return valid[b, kv] & (kv < (q // chunk + 1) * chunk)

    return create_block_mask(visible, batch, None, size, size, device=valid.device)
