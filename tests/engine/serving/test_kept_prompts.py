"""A voice's prompt tensors kept on the device across its requests."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from engine.frontend import PromptFeatures
from engine.serving.kept_prompts import KeptPrompts, PromptTensors

CPU = torch.device("cpu")


def voice(seed: int, tokens: int = 10) -> PromptFeatures:
    rng = np.random.default_rng(seed)
    return PromptFeatures(
        speech_tokens=rng.integers(0, 6561, tokens),
        speaker_embedding=rng.standard_normal(192),
        prompt_mel=rng.standard_normal((2 * tokens, 80)),
        num_samples=24000,
        content_hash="the same name for every voice: the key must not trust it",
        family="cosyvoice3",
        trimmed=True,
    )


def test_a_prompts_tensors_hold_its_arrays_as_the_flow_reads_them():
    features = voice(0)
    made = PromptTensors.of(features, CPU)
    assert (made.tokens.dtype, made.feat.dtype, made.embedding.dtype) == (
        torch.long,
        torch.float32,
        torch.float32,
    )
    assert (made.tokens.shape, made.feat.shape, made.embedding.shape) == ((1, 10), (1, 20, 80), (1, 192))
    np.testing.assert_array_equal(made.tokens[0].numpy(), features.speech_tokens)
    np.testing.assert_array_equal(made.feat[0].numpy(), features.prompt_mel)
    assert made.tokens.data_ptr() != PromptTensors.of(features, CPU).tokens.data_ptr()  # copies, not views


def test_a_voice_that_comes_back_gets_its_kept_tensors_by_content_and_the_oldest_goes_first():
    kept = KeptPrompts(CPU, size=2)
    a, b, c = voice(1), voice(2), voice(3)
    first = kept.get(a)
    again = voice(1)  # the same voice, decoded again: another object, the same arrays
    assert kept.get(again) is first and kept.get(a) is first
    assert kept.get(b) is not first and len(kept) == 2
    kept.get(a)  # a used last: b is the oldest now
    kept.get(c)
    assert len(kept) == 2 and kept.get(a) is first
    assert kept.get(b) is not kept.get(c)  # b came back as a fresh copy, evicting c
    assert kept.get(voice(4, tokens=12)).tokens.shape == (1, 12)


def test_none_kept_copies_for_every_request_and_a_resize_evicts():
    kept = KeptPrompts(CPU)
    a = voice(5)
    assert kept.get(a) is not kept.get(a) and len(kept) == 0
    kept.size = 3
    for seed in range(3):
        kept.get(voice(seed))
    assert len(kept) == 3
    kept.size = 1
    assert len(kept) == 1
    kept.size = 0
    assert len(kept) == 0
    for bad in (-1, 5000):
        with pytest.raises(ValueError, match="kept prompts"):
            kept.size = bad


def test_threads_asking_for_one_voice_get_its_tensors():
    kept = KeptPrompts(CPU, size=4)
    features = voice(7)
    got: list[PromptTensors] = []
    threads = [threading.Thread(target=lambda: got.append(kept.get(features))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and len(kept) == 1
    assert all(torch.equal(g.feat, got[0].feat) for g in got)
    assert kept.get(features) in got
