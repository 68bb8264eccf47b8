"""Flow (tokens -> mel): golden parity with the official CausalMaskedDiffWithXvec / CausalMaskedDiffWithDiT,
full-size key layout, the fixed noise buffer, padded batches, yaml validation."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.errors import TooLarge
from engine.flow.attention import attention_mask
from engine.flow.cfm import CfmInputs, CosyVoice2Flow, CosyVoice3Flow, Flow, FlowBatch, build_flow, flow_noise
from engine.flow.precompiled import specialisation
from tests.conftest import FAMILIES, NO_CASES, fixture_file, tiny_cases, tiny_yaml
from tests.engine.flow.test_dit_cache import tiny_flow, voice

CASES = tiny_cases()
needs_fixtures = pytest.mark.skipif(not CASES, reason=NO_CASES)
case_param = pytest.mark.parametrize("case", CASES, ids=[p.parent.name for p in CASES])
FULL_SIZE = {"CausalMaskedDiffWithXvec": CosyVoice2Flow, "CausalMaskedDiffWithDiT": CosyVoice3Flow}


def flow_node(case: Path) -> dict:
    return tiny_yaml(case)["flow"]


@functools.cache
def load_tiny(case: Path) -> Flow:
    flow = build_flow(flow_node(case))
    flow.load_state_dict(torch.load(fixture_file(case / "flow.pt"), weights_only=True), strict=True)
    return flow.eval()


@functools.cache
def ref(case: Path) -> dict[str, torch.Tensor]:
    with np.load(fixture_file(case / "ref_flow.npz")) as z:
        return {k: torch.from_numpy(z[k]) for k in z.files}


def reference_args(r: dict[str, torch.Tensor], num_tokens: int | None = None) -> FlowBatch:
    token = r["token"].long()[:, :num_tokens]
    return FlowBatch.one(token, r["prompt_token"].long(), r["prompt_feat"], r["embedding"])


def close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-4) -> None:
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


@needs_fixtures
@case_param
def test_cfm_inputs_match_reference(case: Path) -> None:
    flow, r = load_tiny(case), ref(case)
    inputs = flow.prepare(reference_args(r), streaming=False, finalize=True)
    close(inputs.mu, r["cfm_mu"])
    close(inputs.spks, r["cfm_spks"])
    close(inputs.cond, r["cfm_cond"])
    assert inputs.mask.shape == (1, 1, r["cfm_mu"].shape[2]) and bool((inputs.mask == 1).all())
    z0 = flow.decoder.initial_noise(r["cfm_mu"].shape[2], torch.device("cpu"), torch.float32)
    close(z0, r["rand_noise_first_frames"], atol=0)


@needs_fixtures
@case_param
def test_nonstreaming_mel_matches_reference(case: Path) -> None:
    flow, r = load_tiny(case), ref(case)
    mel = flow.inference(reference_args(r), streaming=False, finalize=True)
    assert mel.dtype == torch.float32
    close(mel, r["mel_nonstream"])


@needs_fixtures
@case_param
def test_first_streaming_chunk_matches_reference(case: Path) -> None:
    flow, r = load_tiny(case), ref(case)
    n = int(r["stream_chunk0_num_tokens"])
    batch = reference_args(r, n)
    mel = flow.inference(batch, streaming=True, finalize=False)
    close(mel, r["mel_stream_chunk0"])
    node = flow_node(case)  # mel frames per token; tokens the last ones look ahead (held back meanwhile)
    ratio, lookahead = node["token_mel_ratio"], node["pre_lookahead_len"]
    expected_len = ratio * (r["prompt_token"].shape[1] + n - lookahead) - r["prompt_feat"].shape[1]
    lengths = flow.mel_lengths(batch.token_len, batch.prompt_token_len, batch.prompt_feat_len, finalize=False)
    assert mel.shape[2] == expected_len == int(lengths)
    # The chunk masks and the look-ahead split matter: full attention / finalize give other frames.
    assert not torch.allclose(mel, flow.inference(batch, streaming=False, finalize=False), atol=1e-3)


@pytest.mark.parametrize("family", FAMILIES)
def test_full_size_layout_matches_release_manifest(family: str) -> None:
    manifest = json.loads(fixture_file(family, "manifest_flow.json").read_text())
    with torch.device("meta"):
        flow = FULL_SIZE[manifest["class"].rsplit(".", 1)[-1]]()
    keys = [(k, list(v.shape)) for k, v in flow.state_dict().items()]
    assert keys == [(k["key"], k["shape"]) for k in manifest["keys"]]
    assert sum(p.numel() for p in flow.parameters()) == manifest["num_parameters_unique"]


@pytest.mark.parametrize("family", FAMILIES)
def test_noise_buffer_fingerprint_and_global_rng_untouched(family: str) -> None:
    want = json.loads(fixture_file(family, "full_size_inference_noise.json").read_text())[
        "flow.decoder.rand_noise"
    ]
    before = torch.get_rng_state()
    noise = flow_noise()
    assert torch.equal(torch.get_rng_state(), before)
    flat = noise.reshape(-1)
    assert list(noise.shape) == want["shape"]
    assert flat[: len(want["first"])].tolist() == want["first"]
    assert flat[-len(want["last"]) :].tolist() == want["last"]
    assert noise.double().sum().item() == pytest.approx(want["sum_f64"], abs=1e-6)
    assert hashlib.sha256(noise.numpy().astype("<f4").tobytes()).hexdigest() == want["sha256_f32_bytes"]


@needs_fixtures
@case_param
@pytest.mark.parametrize(("streaming", "finalize"), [(False, True), (True, False)])
def test_padded_batch_equals_rows_alone(case: Path, streaming: bool, finalize: bool) -> None:
    flow, gen, node = load_tiny(case), torch.Generator().manual_seed(7), flow_node(case)
    vocab, mels, spk = node["vocab_size"], node["output_size"], node["spk_embed_dim"]
    rows = [(7, 30, 13), (10, 43, 20)]  # (prompt tokens, tokens, prompt frames); row 0 is a VC-style mismatch
    token, prompt, feat = (
        torch.zeros(2, 43, dtype=torch.long),
        torch.zeros(2, 10, dtype=torch.long),
        torch.zeros(2, 24, mels),
    )
    for i, (p, n, f) in enumerate(rows):
        token[i, :n], prompt[i, :p] = (
            torch.randint(0, vocab, (n,), generator=gen),
            torch.randint(0, vocab, (p,), generator=gen),
        )
        feat[i, :f] = torch.randn(f, mels, generator=gen)
    emb = torch.randn(2, spk, generator=gen)
    lens = [torch.tensor(c) for c in zip(*rows)]
    mel = flow.inference(FlowBatch(token, lens[1], prompt, lens[0], feat, lens[2], emb), streaming, finalize)
    out_lens = flow.mel_lengths(lens[1], lens[0], lens[2], finalize)
    assert mel.shape == (2, mels, int(out_lens.max()))
    for i, (p, n, f) in enumerate(rows):
        row = FlowBatch.one(token[i : i + 1, :n], prompt[i : i + 1, :p], feat[i : i + 1, :f], emb[i : i + 1])
        alone = flow.inference(row, streaming, finalize)
        close(mel[i : i + 1, :, : int(out_lens[i])], alone, atol=1e-5)
        assert not mel[i, :, int(out_lens[i]) :].any()


@needs_fixtures
def test_sequences_past_the_noise_buffer_are_refused() -> None:
    cfm = load_tiny(CASES[0]).decoder
    assert cfm.initial_noise(cfm.noise.size(2), torch.device("cpu"), torch.float32).shape == cfm.noise.shape
    with pytest.raises(TooLarge, match="300 s"):
        cfm.initial_noise(cfm.noise.size(2) + 1, torch.device("cpu"), torch.float32)


def test_streaming_attention_mask_is_chunked_from_frame_zero() -> None:
    valid = torch.tensor([[True] * 5 + [False]])
    mask = attention_mask(valid, chunk=2)[0]
    expected = torch.tensor([[j < (i // 2 + 1) * 2 and j < 5 for j in range(6)] for i in range(6)])
    assert torch.equal(mask, expected)
    assert torch.equal(attention_mask(valid)[0], valid.expand(6, 6))


@needs_fixtures
def test_yaml_errors_name_the_problem() -> None:
    node = flow_node(CASES[0])
    broken = {k: v for k, v in node.items() if k != "vocab_size"}
    with pytest.raises(KeyError, match="vocab_size"):
        build_flow(broken)
    with pytest.raises(ValueError, match="unsupported flow class"):
        build_flow({**node, "__tag__": "new:cosyvoice.flow.flow.MaskedDiffWithXvec"})
    decoder = node["decoder"]
    params = {**decoder["cfm_params"], "content": {**decoder["cfm_params"]["content"], "solver": "rk4"}}
    with pytest.raises(ValueError, match="solver"):
        build_flow({**node, "decoder": {**decoder, "cfm_params": params}})


@pytest.mark.parametrize("family", FAMILIES)
def test_the_schedule_is_the_reference_loop_and_one_step_at_a_time_solves_exactly(family: str) -> None:
    """``schedule``'s t and dt are the reference loop's (dt taken against the accumulated t, cosine span),
    and ``solve_step`` run once per step from the noise, the step an index tensor as a captured step reads
    it, computes what ``forward`` computes, to the bit."""
    flow = tiny_flow(family)
    cfm, cpu = flow.decoder, torch.device("cpu")
    times, sizes = cfm.schedule(cpu, torch.float32)
    span = 1 - torch.cos(torch.linspace(0, 1, 11) * 0.5 * torch.pi)
    t, want_t, want_dt = span[0], [], []
    for step in range(10):
        dt = span[1] - span[0] if step == 0 else span[step + 1] - t
        want_t.append(t.item())
        want_dt.append(dt.item())
        t = t + dt
    assert times.tolist() == want_t and sizes.tolist() == want_dt and len(times) == cfm.cfg.n_timesteps
    v = voice(13, seed=2)
    for streaming in (True, False):
        batch = FlowBatch.one(v.tokens[:, :41], v.prompt, v.feat, v.embedding)
        with torch.inference_mode():
            inputs = flow.prepare(batch, streaming=streaming, finalize=not streaming)
            whole = cfm(inputs, streaming)
            x = cfm.initial_noise(inputs.mu.size(2), cpu, torch.float32).expand_as(inputs.mu).clone()
            for step in range(10):
                cfm.solve_step(x, torch.tensor([step]), inputs, streaming)
        assert torch.equal(x, whole)


class KeySpy(torch.nn.Module):
    """The estimator, with each call's specialisation key (engine.flow.precompiled) noted."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.keys = inner, set()

    def forward(self, *args):
        self.keys.add(specialisation(args))
        return self.inner(*args)


@pytest.mark.parametrize("streaming", [True, False])
def test_the_whole_solve_calls_the_estimator_as_the_stepped_solve_does(streaming: bool) -> None:
    """A call past the graphs runs the whole solve; its estimator calls have the specialisation key of the
    captured (stepped) solve's, so the programs loaded for those serve it and none compiles while serving."""
    flow = tiny_flow("cosyvoice3")
    v = voice(13, seed=4)
    batch = FlowBatch.one(v.tokens[:, :41], v.prompt, v.feat, v.embedding)
    whole, stepped = KeySpy(flow.decoder.estimator), KeySpy(flow.decoder.estimator)
    with torch.inference_mode():
        inputs = flow.prepare(batch, streaming=streaming, finalize=not streaming)
        flow.decoder.with_estimator(whole)(inputs, streaming)
        x = flow.decoder.initial_noise(inputs.mu.size(2), torch.device("cpu"), torch.float32)
        x = x.expand_as(inputs.mu).clone()
        for step in range(flow.decoder.cfg.n_timesteps):
            flow.decoder.with_estimator(stepped).solve_step(x, torch.tensor([step]), inputs, streaming)
    assert len(whole.keys) == 1 and whole.keys == stepped.keys, (whole.keys, stepped.keys)


def test_a_solve_with_autograd_on_after_one_in_inference_mode_runs() -> None:
    """The schedule kept by a solve in inference mode (the engine's) serves a later solve with autograd
    on (a bench's or a test's): its tables are normal tensors, which autograd may save."""
    flow = tiny_flow("cosyvoice3")
    v = voice(13, seed=3)
    batch = FlowBatch.one(v.tokens[:, :41], v.prompt, v.feat, v.embedding)
    inputs = flow.prepare(batch, streaming=True, finalize=False)
    with torch.inference_mode():
        first = flow.decoder(inputs, True)
    inputs = CfmInputs(*(t.clone() for t in dataclasses.astuple(inputs)))  # normal tensors again
    again = flow.decoder(inputs, True)
    assert again.requires_grad and torch.equal(again.detach(), first)
