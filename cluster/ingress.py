"""The ingress deployment: the single-process server's app (API + studio, ``server.web.create_app``) over a
``RemoteEngine``, so every route, limit and message is the same code as on one GPU.

Run one ingress replica: the studio keeps a browser session's stream and downloads in this process, and it
is light (no model); the engine replicas are what scales.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ray import serve

from cluster.engine_replica import EngineInfo, board_actor
from cluster.metrics import ReplicaCollector
from cluster.remote_engine import RemoteEngine
from engine.config import Limits

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IngressConfig:
    limits: Limits
    ui_lang: str = "zh"
    api_key: str | None = None  # None: COSYSTREAM_API_KEY in the ingress's environment, as in one process
    random_weights: bool = False
    board: str = ""
    refresh_s: float = 0.5
    stale_s: float = 5.0


@serve.ingress()
class Ingress:
    async def __init__(self, engine: Any, cfg: IngressConfig):  # type: ignore[misc]  # Serve awaits it
        from api.context import EngineLike
        from server.web import create_app  # gradio and the API load here, in the replica
        from webui.handlers import Engine as StudioEngine

        info: EngineInfo = await engine.info.remote()  # waits for the first engine replica to be up
        self.engine = RemoteEngine(engine, board_actor(cfg.board, cfg.stale_s), info, cfg.refresh_s)
        for_api: EngineLike = self.engine  # mypy checks the remote engine against both protocols
        for_studio: StudioEngine = self.engine
        assert for_api is for_studio
        self.web = create_app(
            for_api, ui_lang=cfg.ui_lang, limits=cfg.limits, api_key=cfg.api_key,
            random_weights=cfg.random_weights,
        )  # fmt: skip
        self.web.state.cosystream_api.telemetry.registry.register(ReplicaCollector(self.engine))
        log.info("ingress up over %s (%s)", info.model_name, info.family)

    def __serve_build_asgi_app__(self) -> Any:
        return self.web
