"""The estimators' attention rule: key padding plus, streaming, the chunk-causal mask from frame 0."""

from __future__ import annotations

import torch

from engine.flow.attention import FrameAttention, WindowAttention, attention_mask, positional_mask


def test_streaming_mask_is_chunked_from_frame_zero_and_hides_padding():
    valid = torch.tensor([[True] * 5 + [False] * 2])
    rule = FrameAttention(valid, chunk=3)
    dense = rule.dense[0, 0]
    assert bool(dense[2, 2]) and not bool(dense[2, 3])  # chunk [0, 3) ends at frame 3
    assert bool(dense[3, 4]) and not bool(dense[3, 5])  # frame 5 is padding
    assert torch.equal(dense, attention_mask(valid, 3)[0]) and torch.equal(rule.valid, valid)


def test_attention_ignores_what_the_mask_hides():
    """Changing a hidden key's value changes nothing for the queries that may not see it."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 7, 16, generator=g) for _ in range(3))
    rule = FrameAttention(torch.tensor([[True] * 5 + [False] * 2]), chunk=3)
    out = rule(q, k, v)
    v2 = v.clone()
    v2[:, :, 5:] += 100.0  # padding frames
    v2[:, :, 3] += 100.0  # frame 3: hidden from the first chunk's queries only
    changed = rule(q, k, v2)
    torch.testing.assert_close(changed[:, :, :3], out[:, :, :3])
    assert not torch.allclose(changed[:, :, 3:5], out[:, :, 3:5])


def test_positional_mask_is_the_frame_mask_with_keys_in_any_order():
    """Stated on absolute positions, the mask follows the keys wherever they sit in the tensor."""
    valid = torch.tensor([[True] * 6 + [False] * 2])
    pos = torch.arange(8)[None]
    assert torch.equal(positional_mask(pos, pos, valid, chunk=3), attention_mask(valid, 3))
    order = torch.tensor([5, 0, 7, 2, 1, 6, 3, 4])
    shuffled = positional_mask(pos[:, 4:], pos[:, order], valid[:, order], chunk=3)  # queries 4..7 only
    assert torch.equal(shuffled, attention_mask(valid, 3)[:, 4:][:, :, order])


def test_window_attention_equals_the_frame_rule_on_its_queries():
    """A window of queries over shuffled keys computes what the whole sequence computes for those queries."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g) for _ in range(3))
    valid = torch.tensor([[True] * 6 + [False] * 2])
    whole = FrameAttention(valid, chunk=3)(q, k, v)
    pos, order = torch.arange(8)[None], torch.tensor([5, 0, 7, 2, 1, 6, 3, 4])
    rule = WindowAttention(pos[:, 3:], valid[:, 3:], pos[:, order], valid[:, order], chunk=3)
    window = rule(q[:, :, 3:], k[:, :, order], v[:, :, order])
    torch.testing.assert_close(window, whole[:, :, 3:], atol=1e-6, rtol=0)
    assert torch.equal(rule.valid, valid[:, 3:])


def test_a_folded_rule_computes_the_masked_attention_without_a_mask():
    """Folded into q/k dimensions, the rule needs no mask tensor and gives the masked softmax: full
    attention with padding, streaming chunks, and a window after a cached prefix; float32 and bf16."""
    g = torch.Generator().manual_seed(2)
    valid = torch.ones(3, 230, dtype=torch.bool)
    valid[1, 150:], valid[2, 40:] = False, False
    q, k, v = (torch.randn(3, 4, 230, 16, generator=g) for _ in range(3))
    for chunk in (0, 50, 9):
        folded = FrameAttention(valid, chunk, folded=True)
        assert folded.dense is None and folded.fold is not None
        want = FrameAttention(valid, chunk)(q, k, v)
        torch.testing.assert_close(folded(q, k, v), want, atol=1e-6, rtol=0)
        low = [t.bfloat16() for t in (q, k, v)]
        torch.testing.assert_close(folded(*low), FrameAttention(valid, chunk)(*low), atol=1e-2, rtol=0)
    starts = torch.tensor([[100], [37], [0]])
    query = starts + torch.arange(60)
    query_valid = query < torch.tensor([[150], [90], [60]])
    rules = [WindowAttention.after_prefix(query, query_valid, 100, starts, 10, f) for f in (False, True)]
    qw, kw, vw = q[:, :, :60], k[:, :, :160], v[:, :, :160]
    assert rules[1].dense is None
    torch.testing.assert_close(rules[1](qw, kw, vw), rules[0](qw, kw, vw), atol=1e-6, rtol=0)
    half = [t.half() for t in (qw, kw, vw)]  # the bias stays finite: no inf x 0 = NaN in a visible score
    torch.testing.assert_close(rules[1](*half), rules[0](*half), atol=2e-3, rtol=0)


def test_a_streaming_rule_past_32_chunks_keeps_the_dense_mask():
    """The folded dims hold 31 chunk thresholds: a longer streaming call uses the dense mask (the same
    result); full attention folds at any length."""
    valid = torch.ones(1, 33 * 5, dtype=torch.bool)
    long = FrameAttention(valid, 5, folded=True)
    assert long.fold is None and long.dense is not None
    assert FrameAttention(valid[:, : 32 * 5], 5, folded=True).fold is not None
    assert FrameAttention(valid, 0, folded=True).fold is not None
