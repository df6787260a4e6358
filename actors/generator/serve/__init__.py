"""The generator's OpenAI-compatible, token-exact endpoint: routes (`app.py`), request and response bodies
(`protocol.py`), the work behind them (`service.py`), engine results made into response bodies (`replies.py`)
and each session's conversation of exact turns (`conversations.py`). A generator process builds and starts it
in `actors.generator.runtime.open_endpoint`."""

from __future__ import annotations

from actors.generator.serve.app import Endpoint, build_app, read_api_key
from actors.generator.serve.service import EndpointService

__all__ = ["Endpoint", "EndpointService", "build_app", "read_api_key"]
