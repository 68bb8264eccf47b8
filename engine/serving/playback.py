"""One client's playback clock: when the audio delivered so far runs out (the next chunk's deadline).

The model is the bench's player (``bench.load.underruns``): playback starts when the first audio is
delivered and runs without gaps; audio delivered after the buffer ran dry starts again from its arrival.
Owned by its request (the engine's stream generator), read by that request only.
"""

from __future__ import annotations

from collections.abc import Callable


class Playback:
    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.runs_out_at: float | None = None  # clock s; None until the first audio is delivered
        self.chunks = 0  # audio chunks delivered
        self.finished = False  # all its audio was delivered: its buffer may run out

    def deadline(self) -> float | None:
        """When the next audio is needed (clock s): when the buffer runs dry; None before the first audio,
        which is due as soon as it is queued (the token2wav queue then marks it a first chunk, the one the
        first-chunk lane may take)."""
        return self.runs_out_at

    def buffered_s(self) -> float:
        """Seconds of delivered audio not yet played (0 before the first audio and after a stall)."""
        return 0.0 if self.runs_out_at is None else max(0.0, self.runs_out_at - self.clock())

    def slack_s(self) -> float | None:
        """Admission's view: seconds until this client runs dry (below 0: it is waiting), once it plays past
        its first chunk (right after it, every stream has little buffered) and until its last audio."""
        if self.runs_out_at is None or self.chunks < 2 or self.finished:
            return None
        return self.runs_out_at - self.clock()

    def delivered(self, seconds: float) -> None:
        """``seconds`` of audio reached the client now."""
        if seconds <= 0:
            return
        now = self.clock()
        self.chunks += 1
        start = now if self.runs_out_at is None else max(self.runs_out_at, now)
        self.runs_out_at = start + seconds
