"""The graphed solver's padding (bucketed batch and frames) leaves the real rows and frames unchanged.

CUDA graph capture itself needs a GPU (tests marked gpu); the exactness of the padding it relies on is a
property of the flow and is checked here on CPU with the eager solver.
"""

from __future__ import annotations

import pytest
import torch

from bench.make_model import build_model_dir
from engine.checkpoint import load_model
from engine.flow_graphs import GraphedCFM, _padded
from engine.hub import validate_model_dir
from engine.models.flow import CfmInputs


@pytest.fixture(scope="module", params=["cosyvoice2", "cosyvoice3"])
def flow(request, tmp_path_factory):
    model_dir = build_model_dir(tmp_path_factory.mktemp(request.param), request.param, "tiny")
    return load_model(validate_model_dir(model_dir), torch.device("cpu")).flow


def inputs(flow, rows: list[tuple[int, int]], finalize: bool, streaming: bool) -> CfmInputs:
    g = torch.Generator().manual_seed(0)
    b = len(rows)
    p_max, n_max = max(p for p, _ in rows), max(n for _, n in rows)
    return flow.prepare(
        token=torch.randint(0, 6561, (b, n_max), generator=g),
        token_len=torch.tensor([n for _, n in rows]),
        prompt_token=torch.randint(0, 6561, (b, p_max), generator=g),
        prompt_token_len=torch.tensor([p for p, _ in rows]),
        prompt_feat=torch.randn(b, 2 * p_max, 80, generator=g),
        prompt_feat_len=torch.tensor([2 * p for p, _ in rows]),
        embedding=torch.randn(b, 192, generator=g),
        streaming=streaming,
        finalize=finalize,
    )


@pytest.mark.parametrize("streaming", [True, False])
def test_padding_to_a_bucket_is_exact(flow, streaming):
    x = inputs(flow, [(9, 40), (13, 52), (20, 31)], finalize=not streaming, streaming=streaming)
    b, t = x.mu.shape[0], x.mu.shape[2]
    graphed = GraphedCFM(flow.decoder, frame_bucket=100)
    bb, tt = graphed.bucket(b, t)
    assert (bb, tt) == (4, 100 * -(-t // 100))
    mu, mask, spks, cond = _padded(x, bb, tt)
    frames = torch.zeros(bb, dtype=torch.long)
    with torch.inference_mode():
        padded = flow.decoder(CfmInputs(mu, mask, spks, cond, frames, frames), streaming)[:b, :, :t]
        plain = flow.decoder(x, streaming)
    valid = x.mask.bool().expand_as(plain)
    torch.testing.assert_close(padded[valid], plain[valid], atol=2e-5, rtol=1e-5)
    assert torch.isfinite(padded).all()
