"""The cut of a failed stream: its trace is dropped from uvicorn's error log (the route logged it once),
every other record kept."""

from __future__ import annotations

import logging

from api.streaming import QUIET_CUTS, StreamCut


def record(exc: BaseException | None) -> logging.LogRecord:
    info = None if exc is None else (type(exc), exc, exc.__traceback__)
    return logging.LogRecord(
        "uvicorn.error", logging.ERROR, __file__, 1, "Exception in ASGI application", (), info
    )


def test_a_cut_streams_trace_is_dropped_and_every_other_record_kept() -> None:
    assert not QUIET_CUTS.filter(record(StreamCut("device out of memory")))
    assert QUIET_CUTS.filter(record(RuntimeError("a bug")))
    assert QUIET_CUTS.filter(record(None))
