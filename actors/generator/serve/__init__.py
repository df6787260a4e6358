"""The generator's OpenAI-compatible, token-exact endpoint: routes (`app.py`), request bodies (`protocol.py`),
the work behind them (`service.py`), response bodies (`replies.py`) and sessions of exact turns
(`sessions.py`). `open_endpoint` builds and starts it for a generator process."""

from __future__ import annotations

from actors.generator.serve.app import Endpoint, build_app, read_api_key
from actors.generator.serve.service import EndpointService

__all__ = ["Endpoint", "EndpointService", "build_app", "read_api_key"]
