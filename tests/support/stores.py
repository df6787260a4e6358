"""Object stores for tests: S3 on the session stack, and two ways to inject faults around a real store.

- `FaultyStore` wraps any `ObjectStore` (the public interface): `fault(method, key)` decides, call by call,
  to raise instead of reaching the store. For faults a caller of the store sees (an outage, a write that
  fails, a process killed before its manifest).
- `ResponseLosingProxy` sits between an `S3Store` and the S3 server: every request reaches the server, but
  the response to the first one it is told to lose never comes back (the connection closes). For faults
  inside `S3Store` (its retries of a write that landed).
"""

from __future__ import annotations

import socket
import socketserver
import threading
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

from infra.stack import StackState, load_credentials
from storage.objectstore import ObjectStore
from storage.s3 import S3Options, S3Store

Fault = Callable[[str, str], BaseException | None]
"""`fault(method, key)`: the exception the call raises instead of running, or None to let it through."""
WRITE_METHODS = frozenset({"put", "put_if_absent", "put_if_match"})
"""The calls that write an object (a fault meant for writes leaves reads and deletes alone)."""


def s3_store(stack: StackState, prefix: str, **options: Any) -> S3Store:
    """An `S3Store` on the test stack's bucket under `prefix`, with its credentials (and `options`)."""
    creds = load_credentials(stack.dir)
    opts = S3Options(
        endpoint=options.pop("endpoint", stack.s3_endpoint),
        region=stack.region,
        access_key_id=creds.access_key_id,
        secret_access_key=creds.secret_access_key,
        **options,
    )
    return S3Store(stack.bucket, prefix, opts)


class FaultyStore(ObjectStore):
    """`inner`, except that each call first asks `fault(method, key)` and raises what it returns.

    Methods are named as on `ObjectStore` (`put`, `put_if_absent`, `put_if_match`, `get_with_etag`,
    `get_range`, `size`, `delete`, `list` with the prefix as key). A call that raises never reached
    `inner`. Closing the wrapper leaves `inner` open: its owner closes it.
    """

    def __init__(self, inner: ObjectStore, fault: Fault) -> None:
        self.inner = inner
        self.url = inner.url
        self.fault = fault
        self.calls: list[tuple[str, str]] = []
        """Every (method, key) asked of the store, faulted or not, in order."""

    def _check(self, method: str, key: str) -> None:
        self.calls.append((method, key))
        exc = self.fault(method, key)
        if exc is not None:
            raise exc

    def put(self, key: str, data: bytes) -> str:
        self._check("put", key)
        return self.inner.put(key, data)

    def put_if_absent(self, key: str, data: bytes) -> str:
        self._check("put_if_absent", key)
        return self.inner.put_if_absent(key, data)

    def put_if_match(self, key: str, data: bytes, etag: str) -> str:
        self._check("put_if_match", key)
        return self.inner.put_if_match(key, data, etag)

    def get_with_etag(self, key: str) -> tuple[bytes, str]:
        self._check("get_with_etag", key)
        return self.inner.get_with_etag(key)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        self._check("get_range", key)
        return self.inner.get_range(key, start, end)

    def size(self, key: str) -> int:
        self._check("size", key)
        return self.inner.size(key)

    def delete(self, key: str) -> None:
        self._check("delete", key)
        self.inner.delete(key)

    def delete_many(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        for key in keys:
            self._check("delete", key)
        self.inner.delete_many(keys)

    def list(self, prefix: str = "") -> list[str]:
        self._check("list", prefix)
        return self.inner.list(prefix)


# ---- a proxy that loses one HTTP response -------------------------------------------------------------------


class ResponseLosingProxy:
    """A loopback HTTP/1.1 proxy to `upstream` (an S3 endpoint URL) that loses one response.

    Each request is forwarded and its response read; the first request for which `lose(request_line)` is
    true has its response dropped and the client's connection closed (as when a response is lost on the
    way), every other response is relayed. `request_lines` records what passed, `lost` what was lost.
    Use as a context manager; point `S3Options.endpoint` at `endpoint`.
    """

    def __init__(self, upstream: str, lose: Callable[[str], bool]) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.lose = lose
        self.request_lines: list[str] = []
        self.lost: list[str] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                proxy.serve_connection(self.request)

        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="losing-proxy", daemon=True)

    def __enter__(self) -> ResponseLosingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def serve_connection(self, client: socket.socket) -> None:
        """Relay one client connection (request by request) to a connection of its own upstream."""
        with client, socket.create_connection(self.upstream) as upstream:
            client_in, upstream_in = client.makefile("rb"), upstream.makefile("rb")
            while True:
                head = _read_head(client_in)
                if head is None:
                    return
                line, headers = head
                if headers.get("expect", "").lower() == "100-continue":
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")  # we take the body, then send it on
                    headers.pop("expect")
                body = client_in.read(int(headers.get("content-length", 0)))
                upstream.sendall(_encode_head(line, headers) + body)
                response, closes = _read_response(upstream_in, head_only=line.startswith("HEAD "))
                with self._lock:
                    self.request_lines.append(line)
                    drop = not self.lost and self.lose(line)
                    if drop:
                        self.lost.append(line)
                if drop:
                    return  # both connections close: the request landed, its response is lost
                client.sendall(response)
                if closes:
                    return


def _read_head(stream: Any) -> tuple[str, dict[str, str]] | None:
    """A request or response head: its first line and its headers (lower-case names); None at EOF."""
    first = stream.readline()
    if not first:
        return None
    headers: dict[str, str] = {}
    while (raw := stream.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = raw.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return first.decode("latin-1").rstrip("\r\n"), headers


def _encode_head(line: str, headers: dict[str, str]) -> bytes:
    return (line + "\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode("latin-1")


def _read_response(stream: Any, *, head_only: bool) -> tuple[bytes, bool]:
    """One whole response, re-encoded with a Content-Length, and whether the server closes the connection."""
    head = _read_head(stream)
    if head is None:
        raise ConnectionError("the upstream closed the connection without a response")
    line, headers = head
    closes = headers.get("connection", "").lower() == "close"
    status = int(line.split()[1])
    if head_only or status in (204, 304) or 100 <= status < 200:
        return _encode_head(line, headers), closes
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = b""
        while size := int(stream.readline().split(b";")[0], 16):
            body += stream.read(size)
            stream.readline()
        while stream.readline() not in (b"\r\n", b"\n", b""):  # trailers
            pass
        headers.pop("transfer-encoding")
        headers["content-length"] = str(len(body))
        return _encode_head(line, headers) + body, closes
    return _encode_head(line, headers) + stream.read(int(headers.get("content-length", 0))), closes
