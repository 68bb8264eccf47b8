"""One thread at a time through imports that load transformers.

transformers' lazy top-level module is not thread-safe: two threads resolving its names at once have failed
with "cannot import name 'AutoTokenizer'". Two threads of a start import it: the LM backend's (vLLM imports
it) and Whisper's load. The serving path itself no longer does (the tokenizer is built with ``tokenizers``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_LOCK = threading.Lock()


@contextmanager
def transformers_import() -> Iterator[None]:
    """Held around an import statement that (directly or through vLLM) imports transformers."""
    with _LOCK:
        yield
