"""The daemon's HTTP API (aiohttp): /healthz, /metrics, /stats, POST /lookup, /entries, /score."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from connector.daemon.service import Daemon, LookupRequest, ScoreRequest

__all__ = ["make_app"]

MAX_BODY = 64 * 1024 * 1024


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def make_app(daemon: Daemon) -> web.Application:
    """An aiohttp application serving ``daemon``."""
    app = web.Application(client_max_size=MAX_BODY)

    async def healthz(_: web.Request) -> web.Response:
        alive = daemon.subscriber._thread is not None and daemon.subscriber._thread.is_alive()
        body = {"status": "ok" if alive else "ingest thread not running",
                "sources": len(daemon.subscriber.sources)}
        return web.json_response(body, status=200 if alive else 503)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=daemon.metrics_text(),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def stats(_: web.Request) -> web.Response:
        return web.json_response(daemon.stats())

    async def _body(request: web.Request) -> Any:
        try:
            return await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ValueError("body is not valid JSON") from None

    async def _parse(request: web.Request) -> LookupRequest:
        return LookupRequest(await _body(request), daemon.token_hasher)

    async def lookup(request: web.Request) -> web.Response:
        try:
            return web.json_response(daemon.lookup(await _parse(request)))
        except ValueError as exc:
            return _error(400, str(exc))

    async def entries(request: web.Request) -> web.Response:
        try:
            return web.json_response({"entries": daemon.entries(await _parse(request))})
        except ValueError as exc:
            return _error(400, str(exc))

    async def score(request: web.Request) -> web.Response:
        try:
            req = ScoreRequest(await _body(request), daemon.token_hasher,
                               daemon.cfg.score_weights, daemon.media_seen())
            return web.json_response(daemon.score(req))
        except ValueError as exc:
            return _error(400, str(exc))

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/stats", stats)
    app.router.add_post("/lookup", lookup)
    app.router.add_post("/entries", entries)
    app.router.add_post("/score", score)
    return app
