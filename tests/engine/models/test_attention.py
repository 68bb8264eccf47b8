"""The two attention kernels compute the same masked attention; the estimators agree whichever they use."""

from __future__ import annotations

import pytest
import torch

from engine.models.attention import FrameAttention, attention_mask
from engine.models.dit import DiT, DiTConfig
from engine.models.unet import CausalConditionalDecoder, UNetConfig


def qkv(batch: int, frames: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, 2, frames, 16, generator=g) for _ in range(3))


@pytest.mark.parametrize("chunk", [0, 50])
def test_flex_equals_the_dense_mask(chunk):
    """Key padding (row 1 ends at frame 90) and the chunk-causal rule, frames not a multiple of the chunk
    nor of FlexAttention's 128-frame blocks."""
    valid = torch.ones(2, 130, dtype=torch.bool)
    valid[1, 90:] = False
    q, k, v = qkv(2, 130)
    dense = FrameAttention.build(valid, chunk, "sdpa")
    flex = FrameAttention.build(valid, chunk, "flex")
    assert dense.blocks is None and flex.dense is None
    torch.testing.assert_close(flex(q, k, v), dense(q, k, v), atol=1e-5, rtol=1e-5)


def test_dense_mask_is_the_chunk_rule():
    rule = FrameAttention.build(torch.ones(1, 7, dtype=torch.bool), 3, "sdpa")
    assert rule.dense is not None
    assert torch.equal(rule.dense[0, 0], attention_mask(torch.ones(1, 7, dtype=torch.bool), 3)[0])
    assert bool(rule.dense[0, 0, 2, 2]) and not bool(rule.dense[0, 0, 2, 3])  # chunk [0, 3) ends at 3


def test_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="attention kernel"):
        FrameAttention.build(torch.ones(1, 4, dtype=torch.bool), 0, "xformers")


@pytest.mark.parametrize(
    "estimator",
    [
        DiT(DiTConfig(dim=32, depth=2, heads=2, dim_head=16, conv_pos_groups=4)),
        CausalConditionalDecoder(
            UNetConfig(channels=(32,), attention_head_dim=16, n_blocks=1, num_mid_blocks=1, num_heads=2)
        ),
    ],
    ids=["dit", "unet"],
)
@pytest.mark.parametrize("streaming", [True, False])
def test_estimators_agree_across_kernels(estimator, streaming):
    g = torch.Generator().manual_seed(1)
    x, mu, cond = (torch.randn(2, 80, 120, generator=g) for _ in range(3))
    mask = torch.ones(2, 1, 120)
    mask[1, :, 75:] = 0
    args = (x, mask, mu, torch.rand(2, generator=g), torch.randn(2, 80, generator=g), cond, streaming)
    with torch.inference_mode():
        estimator.attention_kernel = "sdpa"
        dense = estimator(*args)
        estimator.attention_kernel = "flex"
        flex = estimator(*args)
    valid = mask.bool().expand_as(dense)
    torch.testing.assert_close(flex[valid], dense[valid], atol=1e-4, rtol=1e-4)
