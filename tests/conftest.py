"""Shared fixtures: one real embedded stack (nats-server + SeaweedFS S3) per test session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from infra.stack import StackState, start_stack, stop_stack

TEST_STOP_TIMEOUT_S = 2.0
"""SIGTERM grace for test stacks: SeaweedFS would otherwise take ~17 s; a SIGKILL loses nothing written."""


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackState]:
    """A running stack on free ports for the whole session.

    `s3_client(stack)` carries its S3 key and `stack.nats_url` its NATS token (nats-server refuses
    clients without it); print `stack.nats_endpoint`, never `stack.nats_url`.
    """
    stack_dir = tmp_path_factory.mktemp("stack")
    state = start_stack(stack_dir)
    try:
        yield state
    finally:
        stop_stack(stack_dir, timeout_s=TEST_STOP_TIMEOUT_S)
