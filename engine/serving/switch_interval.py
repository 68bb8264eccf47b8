"""The interpreter's switch interval while the engine is open (EngineConfig.gil_switch_ms).

A thread that wants the GIL waits this long before the holder is asked to drop it. The event loop carries
every stream and hands the GIL over at each blocking device call (a new request's prompt copies) to the
token2wav threads, which hold it between their launches: under a burst, each hand-back costs up to one
interval. A shorter one bounds that wait at the price of more switches between the serving threads.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

log = logging.getLogger(__name__)


@contextlib.contextmanager
def switch_interval(ms: float | None) -> Iterator[None]:
    """``sys.setswitchinterval`` at ``ms`` milliseconds while entered (None: left as it is), then restored."""
    before = sys.getswitchinterval()
    if ms is not None:
        sys.setswitchinterval(ms / 1000.0)
        log.info("the interpreter's switch interval: %.2f ms (was %.2f)", ms, before * 1000.0)
    try:
        yield
    finally:
        sys.setswitchinterval(before)
