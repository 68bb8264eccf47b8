"""Per-request streaming state: the token chunk schedule and v3's silence filter (the vocoder's continuations
are ``engine.vocoder.streaming``).

CosyVoice2/3 stream (cli/model.py, spec 6.3-6.4): the first chunk is ``hop + pad`` tokens so that
prompt + chunk ends on the flow's 25-token chunk grid; each chunk needs 3 more tokens of look-ahead; the
flow re-runs on ALL tokens so far and the new mel is sliced from ``offset * 2`` frames; the hop doubles
up to 100. The reference keeps the hop on the shared model object, so request N inherits request N-1's
hop (and races under concurrency); here every request owns its planner, which fixes that defect.

The flow's output starts at the prompt's last mel frame (its ``prompt_feat_len``), which is 2 x the prompt
tokens except in voice conversion, whose prompt is not trimmed to that ratio (spec §3.7). The reference
slices every chunk from ``offset * 2`` of that output, so with an untrimmed prompt of 2P - d mel frames each
chunk after the first repeats d frames of the one before (skips -d when d < 0), and starts inside the frames
a reusing flow call has not computed. Here a later chunk starts at its first token's frame,
2 x (prompt tokens + offset) in the whole sequence: the chunks tile the whole-file call's frames exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.config import StreamConfig

TOKEN_MEL_RATIO = 2  # mel frames per speech token (25 Hz tokens, 50 Hz mel)
SAMPLES_PER_FRAME = 480  # 24 kHz / 50 Hz
MEL_FRAMES_PER_S = 24000 // SAMPLES_PER_FRAME


@dataclass(frozen=True)
class ChunkJob:
    """Run the flow on tokens [0:end) and keep mel frames from ``mel_start`` on."""

    end: int
    mel_start: int
    finalize: bool

    @property
    def streaming(self) -> bool:
        # The last call uses full-attention masks (reference: finalize=True with stream=False).
        return not self.finalize


class ChunkPlanner:
    """Decides when a chunk is ready; one per request.

    The reference schedule is a sequence of boundaries (token offsets): hop + pad, then hops growing to
    ``max_token_hop`` (or, with the split first chunk, pad then hop). Every streaming chunk ends on one of
    them. With ``cfg.adaptive_hop`` a chunk may span several consecutive boundaries: while the client has
    ``hold_buffer_s`` of audio buffered (``buffered_s``, from the request's playback clock) a ready chunk
    waits to grow up to ``max_adaptive_hop`` tokens, and when the buffer runs low every ready boundary goes
    in one flow call. v3's flow is chunk-causal and its HiFT causal, so merging chunks that end on the
    reference's boundaries leaves the audio as it was (the split first chunk is the same fact the other way
    round); the final boundary is the same too, because the last streaming chunk still ends on the last
    boundary whose look-ahead the tokens cover.
    """

    def __init__(
        self, prompt_tokens: int, cfg: StreamConfig, stream: bool = True, prompt_frames: int | None = None
    ):
        """``prompt_frames``: the prompt's mel frames, where the flow's output starts (None: 2 x the
        prompt tokens, a trimmed prompt's)."""
        self.cfg, self.stream = cfg, stream
        # frames between the flow output's start and the first token's: token t's frames start at output
        # frame 2t + lag
        self.lag = 0 if prompt_frames is None else TOKEN_MEL_RATIO * prompt_tokens - prompt_frames
        pad = math.ceil(prompt_tokens / cfg.token_hop) * cfg.token_hop - prompt_tokens
        split = bool(cfg.fast_start) and pad >= cfg.min_first_hop  # None (unresolved): off
        # split: pad tokens, then hop: the reference's first chunk ends on this same grid line
        self.at = _Boundary(0, pad if split else cfg.token_hop + pad, cfg.token_hop, split)
        self.done = False

    @property
    def offset(self) -> int:
        """Tokens already turned into audio."""
        return self.at.offset

    @property
    def this_hop(self) -> int:
        """Tokens in the reference's next chunk."""
        return self.at.this_hop

    def next_job(self, n_tokens: int, lm_done: bool, buffered_s: float = 0.0) -> ChunkJob | None:
        """The next flow job given ``n_tokens`` buffered tokens, or None to wait for more.
        ``buffered_s``: seconds of audio the client has not played yet (only adaptive hops read it)."""
        if self.done:
            return None
        if self.stream and self._ready(self.at, n_tokens):
            last = self._merged(n_tokens)
            if not lm_done and self._holds(last, buffered_s):
                return None
            start, self.at = self.at.offset, last.next(self.cfg)
            return ChunkJob(self.at.offset + self.cfg.lookahead, self._mel_start(start), False)
        if not lm_done:
            return None
        self.done = True
        return ChunkJob(n_tokens, self._mel_start(self.offset), True)

    def _mel_start(self, offset: int) -> int:
        """The flow output's frame where a chunk from token ``offset`` starts: the first chunk emits the
        output from its start, a later one from its first token's frame (the module doc says why)."""
        return 0 if offset == 0 else max(0, offset * TOKEN_MEL_RATIO + self.lag)

    def _ready(self, chunk: _Boundary, n_tokens: int) -> bool:
        """That chunk's tokens and their look-ahead are buffered."""
        return n_tokens >= chunk.end + self.cfg.lookahead

    def _merged(self, n_tokens: int) -> _Boundary:
        """The last reference chunk the next job covers: the next one, or (adaptive) every ready one after
        it while the job stays within ``max_adaptive_hop`` tokens."""
        last = self.at
        while self.cfg.adaptive_hop:
            after = last.next(self.cfg)
            if not self._ready(after, n_tokens) or after.end - self.at.offset > self.cfg.max_adaptive_hop:
                break
            last = after
        return last

    def _holds(self, last: _Boundary, buffered_s: float) -> bool:
        """Adaptive: wait for one more reference chunk while the client's buffer covers the wait and the
        job can still grow."""
        if not self.cfg.adaptive_hop or buffered_s < self.cfg.hold_buffer_s:
            return False
        return last.next(self.cfg).end - self.at.offset <= self.cfg.max_adaptive_hop


@dataclass(frozen=True)
class _Boundary:
    """One chunk of the reference schedule: tokens [offset, offset + this_hop); ``hop`` grows after it."""

    offset: int
    this_hop: int
    hop: int
    split_first: bool  # this is the split-off first piece: the hop does not grow after it

    @property
    def end(self) -> int:
        return self.offset + self.this_hop

    def next(self, cfg: StreamConfig) -> _Boundary:
        hop = self.hop if self.split_first else min(cfg.max_token_hop, self.hop * cfg.hop_growth)
        return _Boundary(self.end, hop, hop, False)


SILENT_TOKENS_V3 = frozenset({1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323})  # FSQ silence / breath


class SilenceFilter:
    """v3 only (cli/model.py llm_job): keep at most 5 consecutive silent tokens for the flow.

    The LM still conditions on every token; only the list handed to the flow is thinned, which shortens
    long pauses. A non-silent token resets the run.
    """

    def __init__(self, silent: frozenset[int], max_run: int = 5):
        self.silent, self.max_run, self.run = silent, max_run, 0

    def keep(self, token: int) -> bool:
        if token not in self.silent:
            self.run = 0
            return True
        self.run += 1
        return self.run <= self.max_run
