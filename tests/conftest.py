"""Shared fixtures: one real embedded stack (nats-server + SeaweedFS S3) per test session, an object store
of either kind on it, and the processes a test started (killed if it fails half-way)."""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from infra.stack import StackState
from storage.filestore import FileStore
from storage.objectstore import ObjectStore
from tests.support.stacks import running_stack
from tests.support.stores import s3_store


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackState]:
    """A running stack on free ports for the whole session.

    `s3_client(stack)` (`infra/stack.py`) and `s3_store(stack, prefix)` (`tests/support/stores.py`) carry its
    S3 key and `stack.nats_url` its NATS token (nats-server refuses clients without it); print `stack.nats_endpoint`, never `stack.nats_url`.
    """
    with running_stack(tmp_path_factory.mktemp("stack")) as state:
        yield state


@pytest.fixture
def s3_options() -> dict[str, Any]:
    """Extra `S3Options` of the `store` fixture's S3 store; a module overrides this fixture to change them."""
    return {}


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path, s3_options: dict[str, Any]) -> Iterator[ObjectStore]:
    """The test runs twice: on a `FileStore` in `tmp_path`, and on the stack's S3 under a fresh prefix."""
    if request.param == "file":
        s: ObjectStore = FileStore(tmp_path / "store")
    else:
        prefix = f"{request.module.__name__.rsplit('.', 1)[-1]}/{uuid.uuid4().hex}"
        s = s3_store(request.getfixturevalue("stack"), prefix, **s3_options)
    with s:
        yield s


@pytest.fixture
def cleanup() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test started (each the leader of its own process group); killed, with their groups, if the
    test leaves them running."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
