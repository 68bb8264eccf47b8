"""Bistream parity: the native session reproduces the reference's ``inference_bistream`` step for step on
every fixture set that has ``tiny/ref_bistream.npz`` (fixtures README, "tiny/ref_bistream.npz"), up to the
call where the fixture's scenario reaches one of the interleaver's documented departures from the reference
(found from the fixture's own data), plus those departures."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch

from engine.config import SamplingConfig
from engine.lm.bistream import MIX_RATIO, Feed, Interleaver, Layout, Round, Step, Table, bistream_tokens
from engine.lm.native import NativeLM, NativeSession
from engine.lm.sampling import token_limits
from engine.lm.speech_lm import SpeechLMConfig
from tests.conftest import tiny_cases, tiny_yaml
from tests.engine.lm.test_speech_lm import load_tiny

CASES = [c for c in tiny_cases() if (c / "ref_bistream.npz").is_file()]
needs_fixtures = pytest.mark.skipif(not CASES, reason="no fixture set has tiny/ref_bistream.npz")
case_param = pytest.mark.parametrize("case", CASES, ids=[p.parent.name for p in CASES])
ATOL = 1e-4


class FixturePicker:
    """The fixture's sampler rule: streaming calls return fill at ``sampler_fill_at`` else the speech
    argmax; the k-th final call returns the speech argmax while k < ``final_num_speech``, then eos."""

    def __init__(self, r: dict[str, np.ndarray], fill: int):
        self.fill_at = {int(i) for i in r["sampler_fill_at"]}
        self.final_left, self.eos = int(r["final_num_speech"]), int(r["eos_token"])
        self.speech, self.fill = int(r["speech_token_size"]), fill
        self.index = 0  # the index the next token takes in out_tokens
        self.sampled: list[int] = []  # out indices the sampler chose

    def pick(self, logp: torch.Tensor, allowed: tuple[int, ...]) -> int:
        streaming = allowed == (self.fill,)
        self.sampled.append(self.index)
        self.index += 1
        if streaming and self.index - 1 in self.fill_at:
            return self.fill
        if not streaming:
            self.final_left -= 1
            if self.final_left < 0:
                return self.eos
        return int(logp[: self.speech].argmax())

    def forced(self, token: int) -> None:
        self.index += 1


def load(case: Path) -> dict[str, np.ndarray]:
    with np.load(case / "ref_bistream.npz") as z:
        return {k: z[k] for k in z.files}


Replay = tuple[dict[str, np.ndarray], Interleaver, list[tuple[int, Step]], list[int], FixturePicker]


def replay(case: Path) -> Replay:
    r, lm = load(case), load_tiny(case)
    native = NativeLM(lm, SamplingConfig())
    layout = Layout.of(lm.config)
    picker = FixturePicker(r, layout.fill_id)
    piece = [0]

    class PieceTrace(list):  # tags each forward call with the piece being processed
        def append(self, step: Step) -> None:
            super().append((piece[0], step))

    trace = PieceTrace()
    session = NativeSession(native, picker, trace)  # type: ignore[arg-type]
    interleaver = Interleaver(layout, r["prompt_text"][0].tolist(), r["prompt_speech_token"][0].tolist())

    async def pieces() -> AsyncIterator[list[int]]:
        ids, start = r["text_ids"].tolist(), 0
        for j, n in enumerate(r["text_piece_lens"].tolist()):
            piece[0] = j
            yield ids[start : start + n]
            start += n
        piece[0] = len(r["text_piece_lens"])

    async def run() -> list[int]:
        return [t async for t in bistream_tokens(session, interleaver, pieces(), SamplingConfig())]

    try:
        yielded = asyncio.run(run())
    finally:
        native.close()
    return r, interleaver, list(trace), yielded, picker


@needs_fixtures
@case_param
def test_layout_constants_match_the_fixture(case: Path) -> None:
    r, lm = load(case), load_tiny(case)
    layout = Layout.of(lm.config)
    assert layout.sos == Feed(Table(int(r["sos_table"])), (int(r["sos_index_in_table"]),))
    assert layout.task == Feed(Table(int(r["task_id_table"])), (int(r["task_id_index_in_table"]),))
    assert layout.fill_id == int(r["fill_token"]) and lm.config.eos_id == int(r["eos_token"])
    assert lm.config.speech_vocab_size == int(r["decoder_vocab"])
    assert layout.speech_token_size == int(r["speech_token_size"])
    mix = tuple(r["mix_ratio"].tolist())
    assert mix == tuple(tiny_yaml(case)["llm"]["mix_ratio"]) == MIX_RATIO, "the engine's mix ratio is fixed"


class Reproduced(NamedTuple):
    """How many of the reference's forward calls the engine makes identically, and why not more."""

    calls: int
    why: str  # "" when every call is reproduced


def first_final_call(r: dict[str, np.ndarray]) -> int:
    """Index of the first call after the text ended (its ``step_piece`` is the number of pieces)."""
    return int(np.flatnonzero(r["step_piece"] == len(r["text_piece_lens"]))[0])


def reproduced(r: dict[str, np.ndarray]) -> Reproduced:
    """The engine follows the reference call for call until the scenario reaches one of its documented fixes
    (module docstring of engine.lm.bistream); which one, and where, follows from the fixture's own data."""
    m0, m1 = (int(m) for m in r["mix_ratio"])
    lead = int(r["eop_index"]) + 1  # v3: the prompt text through <|endofprompt|> leads the input
    n, final = len(r["out_tokens"]), first_final_call(r)
    speech_prompt = int(r["prompt_speech_token_len"][0])
    text = int(r["prompt_text_len"][0]) - lead + len(r["text_ids"])  # every id that enters the text cache
    if lead and not speech_prompt:
        return Reproduced(0, "v3 without prompt speech: the reference decodes before any text, we wait")
    if speech_prompt and text < m0 * -(-speech_prompt // m1):
        return Reproduced(final, "the text ends before the prompt speech is laid out: we keep the rest")
    fed_text = np.split(r["fed_table"] == Table.TEXT, np.cumsum(r["step_input_len"])[:-1])
    left = text - (sum(int(rows.sum()) for rows in fed_text[:final]) - lead)
    if final and left >= m0:
        return Reproduced(final, f"{left} text ids wait for the final call: we take complete chunks first")
    spoken = int((r["out_tokens"][:final] < int(r["speech_token_size"])).sum())
    budget = token_limits(len(r["text_ids"]), SamplingConfig())[1] - spoken
    if budget < n - final:
        return Reproduced(final + budget, "the final phase passes the one-shot max length: we stop there")
    return Reproduced(n, "")


def engine_pieces(r: dict[str, np.ndarray], calls: int) -> list[int]:
    """The piece each of the first ``calls`` calls runs in on the engine: as in the reference, except that a
    text chunk already waiting after a fill is taken in the same piece (the reference waits for the next)."""
    lead, pieces = int(r["eop_index"]) + 1, len(r["text_piece_lens"])
    arrived = int(r["prompt_text_len"][0]) - lead + np.cumsum(r["text_piece_lens"])
    fed_text = np.split(r["fed_table"] == Table.TEXT, np.cumsum(r["step_input_len"])[:-1])
    needed = np.cumsum([int(rows.sum()) for rows in fed_text]) - lead  # text ids consumed through each call
    out, current = [], 0
    for i in range(calls):
        if int(r["step_piece"][i]) == pieces:
            current = pieces
        elif r["step_kind"][i] in (0, 1):  # a call that takes text starts a decode run
            current = max(current, int(np.searchsorted(arrived, needed[i])))
        out.append(current)
    return out


@needs_fixtures
@case_param
def test_tokens_and_fed_inputs_match_the_reference_step_for_step(case: Path) -> None:
    r, interleaver, trace, yielded, picker = replay(case)
    k, why = reproduced(r)
    if k == 0:
        pytest.skip(f"{case.parent.name} bistream scenario: {why} (the interleaver tests below check it)")
    out = r["out_tokens"].tolist()
    assert interleaver.out[:k] == out[:k]
    speech = [t for t in out[:k] if t < int(r["speech_token_size"])]
    assert yielded[: len(speech)] == speech
    if not why:
        assert interleaver.out == out and yielded == r["yielded_tokens"].tolist() and len(trace) == k
    steps = [s for _, s in trace[:k]]
    assert len(steps) == k
    assert [p for p, _ in trace[:k]] == engine_pieces(r, k)
    lens = r["step_input_len"][:k]
    assert [sum(len(f.ids) for f in s.feeds) for s in steps] == lens.tolist()
    assert [s.cache_len for s in steps] == r["step_cache_len"][:k].tolist()
    fed = [(int(f.table), i) for s in steps for f in s.feeds for i in f.ids]
    assert fed == list(zip(r["fed_table"][: lens.sum()].tolist(), r["fed_ids"][: lens.sum()].tolist()))
    called = np.zeros(len(trace), np.int8)
    called[picker.sampled] = 1
    assert called[:k].tolist() == r["step_sampler_called"][:k].tolist()
    if why and k == first_final_call(r) and k < len(trace):  # fixed: the next chunk, not the final call
        start, stale, m0 = int(lens.sum()), int(r["final_stale_len"]), int(r["mix_ratio"][0])
        final_fed = list(zip(r["fed_table"][start:].tolist(), r["fed_ids"][start:].tolist()))[stale:]
        text = [i for t, i in final_fed if t == Table.TEXT]
        if len(text) >= m0:
            assert trace[k][1].feeds == (Feed(Table.TEXT, tuple(text[:m0])),)


@needs_fixtures
@case_param
def test_hidden_states_and_scores_match_the_reference_at_every_step(case: Path) -> None:
    r, _, trace, _, _ = replay(case)
    k, why = reproduced(r)
    if k == 0:
        pytest.skip(f"{case.parent.name} bistream scenario: {why}")
    hidden = torch.stack([s.hidden for _, s in trace[:k]])
    logp = torch.stack([s.logp for _, s in trace[:k]])
    torch.testing.assert_close(hidden, torch.from_numpy(r["step_hidden"][:k]), atol=ATOL, rtol=0)
    top = torch.from_numpy(r["step_top_ids"][:k]).long()
    expected_top = torch.from_numpy(r["step_top_logp"][:k])
    torch.testing.assert_close(logp.gather(1, top), expected_top, atol=ATOL, rtol=0)
    special = logp[:, int(r["speech_token_size"]) :]
    torch.testing.assert_close(special, torch.from_numpy(r["step_logp_special"][:k]), atol=ATOL, rtol=0)
    sel = r["step_logp_sel_steps"] < k
    rows = torch.from_numpy(r["step_logp_sel_steps"][sel]).long()
    torch.testing.assert_close(logp[rows], torch.from_numpy(r["step_logp_sel"][sel]), atol=ATOL, rtol=0)


# ------------------------------------------------------------------ departures from the reference (fixes)

V2, V3 = Layout.of(SpeechLMConfig(family="cosyvoice2")), Layout.of(SpeechLMConfig(family="cosyvoice3"))


def test_a_long_piece_is_consumed_in_several_rounds() -> None:
    """The reference takes one 5-token chunk per piece, so a 12-id piece would leave 7 ids behind."""
    il = Interleaver(V2, [], [])
    il.push(list(range(12)))
    first = il.next_round()
    assert first is not None and first.feeds == (V2.sos, Feed(Table.TEXT, (0, 1, 2, 3, 4)))
    il.record([7, V2.fill_id])
    second = il.next_round()
    assert second is not None and second.feeds == (Feed(Table.TEXT, (5, 6, 7, 8, 9)),)
    il.record([V2.fill_id])
    assert il.next_round() is None  # 2 ids left: wait for text


def test_leftover_prompt_speech_is_kept_when_the_text_ends_first() -> None:
    il = Interleaver(V2, [1, 2], list(range(40)))  # 40 prompt speech tokens need 15 text ids to mix in
    il.push([3, 4, 5])
    assert il.next_round() is None
    final = il.final_round(SamplingConfig())
    assert final.feeds[-2:] == (V2.task, Feed(Table.SPEECH, tuple(range(15, 40))))
    assert final.feeds[0] == V2.sos and final.final


def test_v3_without_prompt_speech_waits_for_text_before_decoding() -> None:
    il = Interleaver(V3, [7, 8, 151646], [])
    il.push([1, 2])
    assert il.next_round() is None  # the reference would decode here with no text at all
    il.push([3, 4, 5])
    rnd = il.next_round()
    assert rnd is not None
    assert rnd.feeds == (V3.sos, Feed(Table.TEXT, (7, 8, 151646)), Feed(Table.TEXT, (1, 2, 3, 4, 5)))


def test_final_round_has_the_one_shot_length_limits() -> None:
    il = Interleaver(V2, [], [])
    il.push(list(range(5)))
    rnd = il.next_round()
    assert isinstance(rnd, Round) and rnd.budget == 15  # no prompt speech: first forced fill at 15
    il.record([*range(15), V2.fill_id])
    il.push([9, 9, 9])
    final = il.final_round(SamplingConfig())  # 8 text ids: min 16, max 160 speech tokens in all
    assert (final.min_tokens, final.budget) == (16 - 15, 160 - 15)
    assert final.feeds[0] == Feed(Table.SPEECH, (14,))  # the last call's input, fed again as the reference
