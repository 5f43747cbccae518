"""The edge's app: the Starlette routes of openai_routes, runs, model_routes and websocket, plus
liveness and metrics, over one `Edge` (core.py), every error in OpenAI's shape (errors.py);
`serve` runs it with the run-state projector."""

from __future__ import annotations

import contextlib
from typing import Any

import anyio
import anyio.abc
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute

from stages.edge.collection_routes import CollectionRoutes
from stages.edge.core import Edge, EdgeConfig
from stages.edge.errors import ErrorMiddleware, http_exception
from stages.edge.http_limits import HttpLimits, bounded_protocol
from stages.edge.keys import KeyRing
from stages.edge.model_routes import ModelRoutes
from stages.edge.openai_routes import OpenAIRoutes
from stages.edge.runs import RunRoutes
from stages.edge.websocket import stream_socket
from stages.runtime import worker as runtime
from stages.runtime.bus import Bus
from stages.runtime.service import Service
from stages.runtime.spec import StageContext, StageSpec


def build_app(edge: Edge) -> Starlette:
    openai = OpenAIRoutes(edge)
    runs = RunRoutes(edge)
    served = ModelRoutes(edge)
    stores = CollectionRoutes(edge)

    async def healthz(request: Request) -> Response:
        """Liveness of the edge itself (its NATS connection); /health is readiness."""
        ok = edge.bus.nc.is_connected
        return JSONResponse(
            {"status": "ok" if ok else "nats_disconnected"}, status_code=200 if ok else 503
        )

    async def metrics(request: Request) -> Response:
        beats = await edge.beats()  # the engines' own step histograms (iteration_tokens_total)
        if beats is not None:
            edge.metrics.engines.update(beats)
        return Response(edge.metrics.exposition(), media_type="text/plain; version=0.0.4")

    async def socket(websocket) -> None:
        await stream_socket(edge, websocket)

    routes = [
        Route("/healthz", healthz),
        Route("/health", served.health),
        Route("/version", served.version),
        Route("/metrics", metrics),
        Route("/tokenize", served.tokenize, methods=["POST"]),
        Route("/detokenize", served.detokenize, methods=["POST"]),
        Route("/v1/models", served.models),
        Route("/v1/models/{model:path}", served.model),
        Route("/v1/chat/completions", openai.chat, methods=["POST"]),
        Route("/v1/completions", openai.completions, methods=["POST"]),
        Route("/v1/runs/{request_id}", runs.get),
        Route("/v1/runs/{request_id}/stream", runs.stream),
        Route("/v1/vector_stores", stores.create, methods=["POST"]),
        Route("/v1/vector_stores", stores.list, methods=["GET"]),
        Route("/v1/vector_stores/{name}", stores.get, methods=["GET"]),
        Route("/v1/vector_stores/{name}", stores.delete, methods=["DELETE"]),
        Route("/v1/vector_stores/{name}/files", stores.add_file, methods=["POST"]),
        Route("/v1/vector_stores/{name}/files", stores.list_files, methods=["GET"]),
        Route("/v1/vector_stores/{name}/files/{doc_id}", stores.delete_file, methods=["DELETE"]),
        WebSocketRoute("/v1/stream", socket),
    ]
    return Starlette(
        routes=routes,
        middleware=[Middleware(ErrorMiddleware)],
        exception_handlers={HTTPException: http_exception},
    )


async def serve(*, config, stop: anyio.Event, ready: anyio.Event | None = None,
                edge_config: EdgeConfig | None = None, keys: KeyRing | None = None,
                handle_signals: bool = True) -> None:  # fmt: skip
    """`brigade stage edge`: the HTTP server plus the run-state projector, until `stop`."""
    await runtime.serve(
        spec(edge_config, keys),
        config=config,
        stop=stop,
        ready=ready,
        handle_signals=handle_signals,
    )


def spec(edge_config: EdgeConfig | None = None, keys: KeyRing | None = None) -> StageSpec:
    """The edge as a stage with no input: the runtime connects, signals, readies and stops it;
    in-flight streams get `drain_s` to finish after a stop, then they are cut."""

    def service(ctx: StageContext, state: None) -> EdgeService:
        return EdgeService(ctx.bus, edge_config or EdgeConfig.from_env(), keys)

    return StageSpec(name="edge", service=service, drain_s=10.0)


class EdgeService(Service):
    """uvicorn over build_app(edge), and the run-state projector beside it on its own worker."""

    def __init__(self, bus: Bus, config: EdgeConfig, keys: KeyRing | None) -> None:
        self.edge = Edge(bus, config, keys or KeyRing.from_env())
        self.config = config

    def health(self) -> dict[str, Any]:
        """The heartbeat names the id this worker puts on the runs it submits (follow.py)."""
        return {"edge_worker": self.edge.edge_worker}

    async def run(
        self,
        stopping: anyio.Event,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        from stages.eventlog import runstate

        edge, config = self.edge, self.config
        await edge.start()
        server = _Server(
            uvicorn.Config(
                build_app(edge),
                host=config.host,
                port=config.port,
                ws_max_size=2 * config.max_frame_bytes,
                # header and body read timeouts, 431 past max_header_bytes (h11's own bound,
                # a bare 400, stays above it)
                http=bounded_protocol(
                    HttpLimits(
                        max_header_bytes=config.max_header_bytes,
                        header_timeout_s=config.header_timeout_s,
                        body_timeout_s=config.body_timeout_s,
                    ),
                    config.http,
                ),
                h11_max_incomplete_event_size=4 * config.max_header_bytes + (64 << 10),
                log_level="warning",
                lifespan="off",
            )
        )
        projector_ready, server_done = anyio.Event(), anyio.Event()

        async def run_server() -> None:
            try:
                await server.serve()
            except SystemExit:  # uvicorn exits when it cannot bind: raised below, with where
                pass
            finally:
                server_done.set()

        async with anyio.create_task_group() as tg:
            edge.background = tg
            tg.start_soon(lambda: runtime.serve(runstate.SPEC, config=edge.bus.config,
                                                stop=stopping, ready=projector_ready,
                                                handle_signals=False))  # fmt: skip
            tg.start_soon(run_server)
            while not server.started and not server_done.is_set():
                await anyio.sleep(0.01)
            if server_done.is_set():
                raise RuntimeError(f"edge could not listen on {config.host}:{config.port}")
            await projector_ready.wait()
            task_status.started()
            try:
                await stopping.wait()
                server.should_exit = True
                await server_done.wait()  # the runtime cuts what is still streaming after drain_s
            finally:
                with anyio.CancelScope(shield=True):
                    await edge.stop()
            tg.cancel_scope.cancel()


class _Server(uvicorn.Server):
    """uvicorn's server without its own signal handlers: the hosting process owns signals."""

    def capture_signals(self):  # type: ignore[override]
        return contextlib.nullcontext()
