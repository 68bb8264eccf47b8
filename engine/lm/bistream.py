"""Bistream: the speech LM reads text as it arrives and writes speech tokens in between (spec 5.4).

The reference loop (``Qwen2LM.inference_bistream``) interleaves m0 = 5 text tokens with m1 = 15 speech
tokens: the prompt text and prompt speech first, then after every fill token the next m0 text tokens, and
when the text ends all remaining text plus the task id, decoded to eos. ``Interleaver`` is that layout as a
pure state machine: it says what to feed next (a ``Round``) and learns what came out. A backend session
runs a round (``LMSession``); ``NativeSession`` does it step by step on its own KV cache, in the native
backend's decode thread; the vLLM backend re-submits the grown prompt per round (prefix caching).

Reproduced from the reference, step for step: the forced fill positions (the first one a block late when
the prompt speech length is a multiple of 15), the input of the last call fed a second time in front of
the final text. Fixed (docs/engine-api.md): several text chunks are consumed per piece when
they are there (the reference takes one per piece, so text piles up), leftover prompt speech is kept
(after the task id, where the one-shot layout has it) when the text ends first, v3 with no prompt speech
waits for a text chunk before decoding, special ids other than fill are masked while streaming (the
reference raises on them), and the final phase has the non-streaming min/max lengths.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.config import SamplingConfig
from engine.lm.sampling import SamplerState, sample_step, token_limits
from engine.lm.speech_lm import SpeechLM, SpeechLMConfig

MIX_RATIO = (5, 15)  # text tokens, speech tokens per round (the released yaml's mix_ratio)
END_OF_PROMPT_ID = 151646  # v3: the prompt text up to and including it leads the input


class Table(enum.IntEnum):
    """Which embedding table a fed id indexes (the fixture's codes)."""

    SPECIAL = 0  # v2 llm_embedding [2, H]: sos, task id
    TEXT = 1  # Qwen embed_tokens
    SPEECH = 2  # speech_embedding (v3 sos / task id are rows of it)


@dataclass(frozen=True)
class Feed:
    table: Table
    ids: tuple[int, ...]


@dataclass(frozen=True)
class Layout:
    """The family's constants for the loop."""

    sos: Feed
    task: Feed
    fill_id: int
    speech_token_size: int
    v3: bool

    @classmethod
    def of(cls, config: SpeechLMConfig) -> Layout:
        table = Table.SPECIAL if config.is_v2 else Table.SPEECH
        return cls(
            Feed(table, (config.sos_id,)),
            Feed(table, (config.task_id,)),
            config.fill_id,
            config.speech_token_size,
            not config.is_v2,
        )


@dataclass(frozen=True)
class Round:
    """One backend round: feed ``feeds``, then sample until it ends.

    Streaming (``final`` False): ends on a sampled fill, or after ``budget`` speech tokens when one more
    forward (feeding the last of them) is followed by a forced fill. Final: ends on any stop id, allowed
    only after ``min_tokens`` speech tokens, or after ``budget`` speech tokens (the max length).
    """

    feeds: tuple[Feed, ...]
    budget: int
    final: bool
    min_tokens: int = 0


class Interleaver:
    """The reference's input layout for one request, fed text ids as they arrive (all ids are ints)."""

    def __init__(self, layout: Layout, prompt_text: Sequence[int], prompt_speech: Sequence[int]):
        self.layout = layout
        split = _after_end_of_prompt(prompt_text) if layout.v3 else 0
        lead = [Feed(Table.TEXT, tuple(int(i) for i in prompt_text[:split]))] if split else []
        self._input: list[Feed] = [layout.sos, *lead]
        self._text = [int(i) for i in prompt_text[split:]]
        self._speech = [int(i) for i in prompt_speech]
        self._mixed = False  # a prompt round or a first text chunk is in the input
        self.out: list[int] = []  # every appended token, fills and the final stop id included
        self.received = 0  # text ids pushed (the prompt text excluded): the length limits count them
        n, m1 = len(self._speech), MIX_RATIO[1]
        self._next_fill = (n // m1 + 1) * m1 - n  # in [1, 15]: 15 when n is a multiple of 15

    def push(self, ids: Sequence[int]) -> None:
        """A piece of text ids; prompt rounds [m0 text, <=m1 prompt speech] are laid out as text allows."""
        m0, m1 = MIX_RATIO
        self._text += [int(i) for i in ids]
        self.received += len(ids)
        while self._speech and len(self._text) >= m0:
            self._input += [self._take_text(m0), Feed(Table.SPEECH, tuple(self._speech[:m1]))]
            self._speech = self._speech[m1:]
            self._mixed = True

    def next_round(self) -> Round | None:
        """What to decode now, or None to wait for more text."""
        m0 = MIX_RATIO[0]
        if self._speech:
            return None
        after_fill = bool(self.out) and self.out[-1] == self.layout.fill_id
        if after_fill or not self._mixed:  # the next text chunk is needed
            if len(self._text) < m0:
                return None
            chunk = self._take_text(m0)
            self._input = [chunk] if after_fill else [*self._input, chunk]  # the fill itself is not fed
            self._mixed = True
        elif self.out:
            return None
        return Round(tuple(self._input), self._next_fill - len(self.out), final=False)

    def record(self, tokens: Sequence[int]) -> None:
        """The tokens a streaming round appended (its last one a fill)."""
        if not tokens or tokens[-1] != self.layout.fill_id:
            raise ValueError(f"a streaming round ends with the fill token, got {list(tokens)[-1:]}")
        if len(tokens) > 1:  # the last call fed the last speech token: the reference keeps it as lm_input
            self._input = [Feed(Table.SPEECH, (int(tokens[-2]),))]
        self.out += [int(t) for t in tokens]
        self._next_fill = len(self.out) - 1 + MIX_RATIO[1] + 1

    def final_round(self, sampling: SamplingConfig, forced_tokens: int | None = None) -> Round:
        """After the last piece: [lm_input, all remaining text, task id] (+ leftover prompt speech).
        ``forced_tokens`` (bench, tests): exactly that many speech tokens in all, if not already past."""
        feeds = [*self._input, Feed(Table.TEXT, tuple(self._text)), self.layout.task]
        if self._speech:  # fix: the reference drops it; the one-shot layout has it after the task id
            feeds.append(Feed(Table.SPEECH, tuple(self._speech)))
        feeds = [f for f in feeds if f.ids]
        self._text, self._speech = [], []
        min_len, max_len = token_limits(self.received, sampling)
        if forced_tokens is not None:
            min_len = max_len = forced_tokens
        spoken = self.spoken
        return Round(tuple(feeds), max(0, max_len - spoken), final=True, min_tokens=max(0, min_len - spoken))

    @property
    def spoken(self) -> int:
        """Speech tokens generated so far."""
        return sum(1 for t in self.out if t < self.layout.speech_token_size)

    def _take_text(self, n: int) -> Feed:
        chunk, self._text = self._text[:n], self._text[n:]
        return Feed(Table.TEXT, tuple(chunk))


def _after_end_of_prompt(prompt_text: Sequence[int]) -> int:
    """v3: how many prompt-text ids lead the input (through <|endofprompt|>); 0 if it has none."""
    ids = [int(i) for i in prompt_text]
    return ids.index(END_OF_PROMPT_ID) + 1 if END_OF_PROMPT_ID in ids else 0


def embed(lm: SpeechLM, feeds: Sequence[Feed]) -> torch.Tensor:
    """The embeddings [P, H] the feeds name (on the model's device and dtype)."""
    tables = {Table.TEXT: lm.embed_tokens, Table.SPEECH: lm.speech_embedding}
    if lm.config.has_llm_embedding:
        tables[Table.SPECIAL] = lm.llm_embedding
    device = lm.speech_embedding.weight.device
    parts = [tables[f.table].weight[torch.tensor(f.ids, dtype=torch.long, device=device)] for f in feeds]
    return torch.cat(parts)


# ------------------------------------------------------------------------------------------ sessions


class LMSession(Protocol):
    """One bistream request's state on a backend (its KV cache or its fed prompt)."""

    def round(self, rnd: Round) -> AsyncIterator[int]:
        """Every token the round appends, the fill / stop id that ends it included."""
        ...

    async def aclose(self) -> None: ...


class Picker(Protocol):
    """Chooses each token: ``allowed`` are the non-speech ids it may return (the rest are masked)."""

    def pick(self, logp: torch.Tensor, allowed: tuple[int, ...]) -> int: ...

    def forced(self, token: int) -> None:
        """A token the loop chose itself (a forced fill): it still enters the history."""
        ...


class RASPicker:
    """The engine's sampler (RAS, seeded per request) with the round's special ids masked."""

    def __init__(self, seed: int, sampling: SamplingConfig, speech_token_size: int):
        self.state = SamplerState.seeded(seed, 0, 1 << 30, ())
        self.sampling, self.speech = sampling, speech_token_size

    def pick(self, logp: torch.Tensor, allowed: tuple[int, ...]) -> int:
        masked = logp.float().clone()
        keep = masked[list(allowed)].clone() if allowed else None
        masked[self.speech :] = -torch.inf
        if keep is not None:
            masked[list(allowed)] = keep
        return sample_step(masked[None], [self.state], self.sampling)[0]

    def forced(self, token: int) -> None:
        # draw the step's two uniforms anyway, so step i always uses pair i (as DeviceRAS on vLLM does)
        torch.rand(2, generator=self.state.generator)
        self.state.history.append(token)


@dataclass(frozen=True)
class Step:
    """One forward call (recorded when a session traces): its inputs, KV length before it, outputs."""

    feeds: tuple[Feed, ...]
    cache_len: int
    hidden: torch.Tensor  # [H] float32, the last position's final hidden state
    logp: torch.Tensor  # [V] float32 log-softmax


Forward = Callable[[tuple[Feed, ...]], Awaitable[tuple[torch.Tensor, torch.Tensor]]]


async def run_round(
    rnd: Round, forward: Forward, picker: Picker, layout: Layout, specials: tuple[int, ...]
) -> AsyncIterator[int]:
    """A round step by step: ``forward(feeds)`` -> (hidden [H], logp [V]) against the session's cache."""
    feeds, j = rnd.feeds, 0
    while not (rnd.final and j >= rnd.budget):
        _, logp = await forward(feeds)
        if not rnd.final and j == rnd.budget:
            tok = layout.fill_id
            picker.forced(tok)
        else:
            allowed = (layout.fill_id,) if not rnd.final else (specials if j >= rnd.min_tokens else ())
            tok = picker.pick(logp, allowed)
        yield tok
        if tok >= layout.speech_token_size:
            return
        feeds, j = (Feed(Table.SPEECH, (tok,)),), j + 1


async def bistream_tokens(
    session: LMSession,
    interleaver: Interleaver,
    pieces: AsyncIterable[list[int]],
    sampling: SamplingConfig,
    forced_tokens: int | None = None,
) -> AsyncIterator[int]:
    """Speech-token ids as the text pieces (token ids) arrive; fills and the stop id are not yielded."""
    speech = interleaver.layout.speech_token_size
    async for ids in pieces:
        interleaver.push(ids)
        while (rnd := interleaver.next_round()) is not None:
            tokens = []
            async for tok in session.round(rnd):
                tokens.append(tok)
                if tok < speech:
                    yield tok
            interleaver.record(tokens)
    async for tok in session.round(interleaver.final_round(sampling, forced_tokens)):
        interleaver.out.append(tok)
        if tok < speech:
            yield tok
