"""The endpoint's HTTP side: a FastAPI app over an `EndpointService`, and `Endpoint`, which serves it with
uvicorn inside the generator's event loop.

Routes (vLLM's conventions), each also under ``/sessions/{session_id}`` so a harness that takes only a
base URL is session-scoped by it (``base_url = http://host:port/sessions/<id>/v1``)::

    GET  /health                  GET  /v1/models
    POST /v1/chat/completions     POST /v1/completions     POST /inference/v1/generate

The session is the path's, else the body's ``session_id``, else the ``X-Session-ID`` header; none: the
request is served alone. Bodies are read by hand, not by FastAPI's validation, so every error has
OpenAI's shape: a missing or wrong key 401, a body that is not ``application/json`` 415 (a browser page can
post ``text/plain`` to loopback without asking), a body over ``generator.serve.max_body_bytes`` 413, malformed
JSON or a bad field 400 (naming it), over a session's limits 413, over capacity 429 and not ready 503 (both with
``Retry-After``). An unexpected error is a 500 with the same shape, logged; the generator goes on. JSON is
decoded and validated in a worker thread, and the responses arrive as bytes built there (`service.py`), so the
event loop only moves bytes.

Every generator's endpoint has a key (`read_api_key`): the configured one, else one generated into
``<run dir>/endpoint.key`` (mode 0600), which the run's agents are handed and a harness on the machine can read.
``GET /health`` answers liveness (``{"status": "ok"}``, 503 ``starting``) to anyone, and the policy version
only with the key.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import secrets
import socket
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from actors.generator.serve.protocol import (
    ChatRequest,
    CompletionRequest,
    EndpointError,
    TokensRequest,
    parse_body,
)
from actors.generator.serve.service import Body, EndpointService

log = logging.getLogger(__name__)


router = APIRouter()
"""The endpoint's routes (vLLM's ``api_router.py``): plain functions that find the `EndpointService` and its
settings on ``request.app.state`` (set by `build_app`), so a route reads on its own, not as a closure."""

SESSION_PREFIX = "/sessions/{session_id}"
KEY_FILE = "endpoint.key"
"""The generated key's file in the run directory (mode 0600)."""
FRAMES_PER_YIELD = 64
"""Stream frames sent between two yields to the event loop."""


def build_app(service: EndpointService, *, api_key: str | None, max_body_bytes: int) -> FastAPI:
    """The app over ``service``; ``api_key`` None: no key asked (in-process tests only: a generator's endpoint
    always has one, `read_api_key`)."""
    app = FastAPI(title="Leeway generator", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    app.state.api_key = api_key
    app.state.max_body_bytes = max_body_bytes
    app.add_exception_handler(EndpointError, _endpoint_error)
    app.add_exception_handler(Exception, _unexpected)
    app.include_router(router)
    return app


def _service(request: Request) -> EndpointService:
    service: EndpointService = request.app.state.service
    return service


async def _endpoint_error(request: Request, exc: EndpointError) -> Response:
    metrics = _service(request).metrics
    metrics.errors[exc.status] = metrics.errors.get(exc.status, 0) + 1
    headers = {} if exc.retry_after_s is None else {"Retry-After": str(exc.retry_after_s)}
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def _unexpected(request: Request, exc: Exception) -> Response:
    """A bug answers 500 in OpenAI's shape and is logged with its traceback; the generator goes on."""
    log.exception("endpoint: unexpected error")
    metrics = _service(request).metrics
    metrics.errors[500] = metrics.errors.get(500, 0) + 1
    error = EndpointError(500, f"internal error: {type(exc).__name__}: {exc}", kind="internal_error")
    return JSONResponse(error.body(), status_code=500)


def _has_key(request: Request) -> bool:
    api_key: str | None = request.app.state.api_key
    if api_key is None:
        return True
    given = request.headers.get("authorization", "")
    token = given[7:] if given.lower().startswith("bearer ") else ""
    return hmac.compare_digest(token.encode(), api_key.encode())


def _check_key(request: Request) -> None:
    if not _has_key(request):
        raise EndpointError(401, "missing or wrong API key (Authorization: Bearer <key>)", kind="authentication_error")


async def _body_of(request: Request) -> Any:
    """The request's JSON, once its key, its media type and its size are checked. The body is read by hand,
    never by FastAPI's validation, so every error keeps OpenAI's shape; its size is counted while reading,
    since a client can leave out or understate ``Content-Length``."""
    _check_key(request)
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise EndpointError(
            415,
            f"the body must be application/json (Content-Type is {media_type or 'missing'!r})",
            param="content-type",
        )
    max_body_bytes: int = request.app.state.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        raise EndpointError(413, f"the body is over {max_body_bytes} bytes (generator.serve.max_body_bytes)")
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > max_body_bytes:
            raise EndpointError(413, f"the body is over {max_body_bytes} bytes (generator.serve.max_body_bytes)")
    _service(request).metrics.requests += 1
    try:
        return await asyncio.to_thread(orjson.loads, bytes(data))
    except orjson.JSONDecodeError as exc:
        raise EndpointError(400, f"the body is not valid JSON: {exc}") from None


def _session_of(request: Request, path_session: str | None, body: Any) -> str | None:
    if path_session is not None:
        return path_session
    if isinstance(body, dict) and isinstance(body.get("session_id"), str):
        return body["session_id"]
    return request.headers.get("x-session-id")


@router.get("/health")
async def health(request: Request) -> Response:
    """200 once the generator holds policy weights, 503 before (and while stopping), for load balancers; the
    policy version only to a caller with the key."""
    service = _service(request)
    ready = service.engine.version >= 0 and not service.stopping
    body: dict[str, Any] = {"status": "ok" if ready else "starting"}
    if _has_key(request):
        body["policy_version"] = service.engine.version
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/v1/models")
@router.get(SESSION_PREFIX + "/v1/models")
async def models(request: Request, session_id: str | None = None) -> Response:
    _check_key(request)
    return JSONResponse(_service(request).models().model_dump())


@router.post("/v1/chat/completions")
@router.post(SESSION_PREFIX + "/v1/chat/completions")
async def chat(request: Request, session_id: str | None = None) -> Response:
    data = await _body_of(request)
    req = await asyncio.to_thread(parse_body, ChatRequest, data)
    return _response(await _service(request).chat(req, _session_of(request, session_id, data)))


@router.post("/v1/completions")
@router.post(SESSION_PREFIX + "/v1/completions")
async def completions(request: Request, session_id: str | None = None) -> Response:
    data = await _body_of(request)
    req = await asyncio.to_thread(parse_body, CompletionRequest, data)
    return _response(await _service(request).completions(req, _session_of(request, session_id, data)))


@router.post("/inference/v1/generate")
@router.post(SESSION_PREFIX + "/inference/v1/generate")
async def tokens(request: Request, session_id: str | None = None) -> Response:
    data = await _body_of(request)
    req = await asyncio.to_thread(parse_body, TokensRequest, data)
    return _response(await _service(request).tokens(req, _session_of(request, session_id, data)))


def _response(body: Body) -> Response:
    if isinstance(body, list):
        return StreamingResponse(_sse(body), media_type="text/event-stream")
    return Response(body, media_type="application/json")


async def _sse(frames: list[bytes]) -> AsyncIterator[bytes]:
    """The frames, yielding to the event loop every `FRAMES_PER_YIELD` (a socket write does not yield)."""
    for k, frame in enumerate(frames):
        if k and k % FRAMES_PER_YIELD == 0:
            await asyncio.sleep(0)
        yield frame


def read_api_key(*, env_name: str, file: str | None, run_dir: Path) -> str:
    """The endpoint's key: the 0600 file if given, else the environment variable, else the run's generated key
    (`KEY_FILE` in ``run_dir``, made 0600 by the first generator that needs it; the others read it)."""
    if file is not None:
        key = _read_key_file(Path(file), f"generator.serve.api_key_file = {file!r}")
        if key is None:
            raise ValueError(f"generator.serve.api_key_file = {file!r}: the file is empty")
        return key
    if os.environ.get(env_name, "").strip():
        return os.environ[env_name].strip()
    return generated_key(run_dir)


def generated_key(run_dir: Path) -> str:
    """The run's generated endpoint key, in ``run_dir / KEY_FILE`` (created 0600 when missing)."""
    path = run_dir / KEY_FILE
    key = _read_key_file(path, str(path)) if path.exists() else None
    if key is not None:
        return key
    run_dir.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(32)
    draft = run_dir / f".{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(key + "\n")
    try:
        os.link(draft, path)  # whole or not at all; another generator of the run may have linked its key first
    except FileExistsError:
        key = _read_key_file(path, str(path)) or key
    finally:
        draft.unlink()
    return key


def _read_key_file(path: Path, what: str) -> str | None:
    if not path.is_file():
        raise ValueError(f"{what}: no such file")
    if stat.S_IMODE(path.stat().st_mode) & 0o077:
        raise ValueError(f"{what}: readable by others; chmod 600 it")
    return path.read_text().strip() or None


class Endpoint:
    """The app served by uvicorn as a task of the running event loop, on a socket bound up front (so the
    address is known at once, port 0 included). uvicorn's own signal handling is left out: the generator
    process owns SIGINT and SIGTERM."""

    def __init__(self, app: FastAPI, *, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.socket.listen(256)
        self.socket.setblocking(False)
        bound_host, bound_port = self.socket.getsockname()[:2]
        shown = f"[{bound_host}]" if family == socket.AF_INET6 else bound_host
        self.url = f"http://{shown}:{bound_port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False, timeout_graceful_shutdown=2)
        self._server = _QuietServer(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self.socket]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        self.socket.close()


class _QuietServer(uvicorn.Server):
    """uvicorn without its signal handlers: the generator process owns SIGINT and SIGTERM."""

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()
