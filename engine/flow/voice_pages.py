"""A voice's prompt frames kept across its requests in the page pool (``EngineConfig.flow_voice_pages``).

Why it is exact. The rules that make a request's finished frames exact (engine.flow.dit_cache: the fixed
noise buffer indexed by frame, chunk-causal attention on absolute frames, causal convs, per-frame layers)
also make the prompt's complete chunks before the look-ahead of its first speech token depend on the voice
alone: frames [0, F_v), F_v = (2 (P - look-ahead) // chunk) x chunk for a prompt of P tokens, since a
frame's mu reads its token and the look-ahead's next ones, and its cond and spks are the prompt's. So every
request of one voice computes the same keys/values, x and conv states in those chunks, in every step and
CFG row (a test transplants one request's cut cache into another's: tests/engine/flow/test_dit_cache.py).

What it keeps: the first request of a voice donates its pages of those chunks after its first call (they
hold what that committed call wrote); a later request of the voice starts its cache with them (shared,
read only: a window writes only the chunks from its start on, the request's own pages) and its first
call runs as a window from F_v instead of frame 0: for a 3.5-4.5 s prompt, 150-200 of the prompt's
175-225 frames are not computed again. The pool counts each page's holders, so a page goes back when the
last of the voice and its requests lets go. Voices are kept up to ``max_pages`` pages in all (they are
pages the streams' caches cannot take meanwhile). A new voice takes the place of the least recently used
one only where that one has been idle for ``idle_s``: where more voices recur than fit (the bench's 25
voices in turn; a public demo's one-off uploads between its example voices) plain LRU would evict each
voice just before it comes back and keep none that is ever used again; this keeps the ones that fit.

A voice is its prompt tokens, prompt mel and speaker embedding as the flow reads them (after any prompt
trim), by digest.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from engine.flow.dit_pages import PagedCache, PagePool

VOICE_IDLE_S = 60.0  # a kept voice unused this long may give its pages to a new one


def voice_key(tokens: np.ndarray, mel: np.ndarray, embedding: np.ndarray) -> bytes:
    """The flow's view of a voice -> a digest: prompt tokens [P], prompt mel [2P, 80], embedding [192]."""
    h = hashlib.blake2b(digest_size=16)
    for part in (tokens.astype(np.int64), mel.astype(np.float32), embedding.astype(np.float32)):
        h.update(str(part.shape).encode())
        h.update(np.ascontiguousarray(part).tobytes())
    return h.digest()


def voice_frames(prompt_tokens: int, lookahead: int, chunk: int, mel_ratio: int = 2) -> int:
    """F_v: the prompt's frames in complete chunks before its first speech token's look-ahead reaches."""
    return max(mel_ratio * (prompt_tokens - lookahead), 0) // chunk * chunk


@dataclass(frozen=True)
class VoicePrefix:
    """A kept voice: ``pages[c]`` holds chunk c of its first ``frames`` frames."""

    pages: tuple[int, ...]
    frames: int


class VoicePages:
    """The voices a page pool keeps (see the module: least recently used out once idle for ``idle_s``);
    thread-safe (both token2wav workers). ``clock``: seconds, monotonic (tests inject one)."""

    def __init__(
        self,
        pool: PagePool,
        max_pages: int,
        idle_s: float = VOICE_IDLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool, self.max_pages, self.idle_s, self._clock = pool, max_pages, idle_s, clock
        self._voices: OrderedDict[bytes, VoicePrefix] = OrderedDict()
        self._used_at: dict[bytes, float] = {}
        self._lock = threading.Lock()

    @property
    def pages(self) -> int:
        """Pages the kept voices hold."""
        with self._lock:
            return self._held()

    def find(self, key: bytes) -> VoicePrefix | None:
        with self._lock:
            return self._used(key)

    def start(self, key: bytes, cache: PagedCache) -> bool:
        """A fresh request's cache begins with the voice's pages where the voice is kept -> whether it did."""
        with self._lock:  # under the lock: an eviction cannot give the pages back before the cache holds them
            if (prefix := self._used(key)) is None:
                return False
            cache.adopt(prefix.pages, prefix.frames)
            return True

    def _used(self, key: bytes) -> VoicePrefix | None:
        """The kept voice, now the most recently used (called under the lock)."""
        prefix = self._voices.get(key)
        if prefix is not None:
            self._voices.move_to_end(key)
            self._used_at[key] = self._clock()
        return prefix

    def keep(self, key: bytes, cache: PagedCache, frames: int) -> bool:
        """After a committed call: the cache's first ``frames`` frames (F_v) kept for the voice, unless it is
        kept already, they are none, the cache does not hold them yet, or they fit neither free room nor
        the place of voices idle for ``idle_s`` -> kept."""
        chunks = frames // self.pool.layout.chunk
        if chunks == 0 or cache.frames < frames or len(cache.pages) < chunks or chunks > self.max_pages:
            return False
        with self._lock:
            if key in self._voices or (evicted := self._room(chunks)) is None:
                return False
            pages = tuple(cache.pages[:chunks])
            self.pool.share(pages)
            self._voices[key], self._used_at[key] = VoicePrefix(pages, frames), self._clock()
        for prefix in evicted:
            self.pool.give(prefix.pages)
        return True

    def clear(self) -> None:
        """Let every voice go (their pages back to the pool once no request holds them)."""
        with self._lock:
            voices, self._voices, self._used_at = list(self._voices.values()), OrderedDict(), {}
        for prefix in voices:
            self.pool.give(prefix.pages)

    def _held(self) -> int:
        return sum(len(v.pages) for v in self._voices.values())

    def _room(self, chunks: int) -> list[VoicePrefix] | None:
        """Room for ``chunks`` more pages: the least recently used voices that must go for it, or None where
        one of them was used within ``idle_s`` (then none goes). Called under the lock."""
        need, now, out = self._held() + chunks - self.max_pages, self._clock(), []
        for key in self._voices:
            if need <= 0:
                break
            if now - self._used_at[key] < self.idle_s:
                return None
            out.append(key)
            need -= len(self._voices[key].pages)
        for key in out:
            del self._used_at[key]
        return [self._voices.pop(key) for key in out]
