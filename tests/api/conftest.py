"""Fixtures of the API tests (helpers live in ``support.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from api.app import build_api
from engine.config import Limits
from tests.api.support import RecordingEngine, client_for


@pytest.fixture
def engine() -> RecordingEngine:
    return RecordingEngine(n_chunks=4, chunk_s=0.2, delay_s=0.0)


@pytest.fixture
async def client(engine: RecordingEngine) -> AsyncIterator[httpx.AsyncClient]:
    async with client_for(build_api(engine, Limits(), api_key="")) as c:
        yield c
