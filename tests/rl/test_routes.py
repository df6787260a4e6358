"""A trajectory's routes from its turns' engine reports: each position once, from the forward that computed it."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.rl.engine_records import GenerateResult
from pipeline.rl.routes import assemble_routes
from pipeline.rl.scoring import build_sample
from pipeline.rl.turns import Trajectory, Turn
from pipeline.wire.trajectory import TrajectoryGroup

LAYERS, TOP_K = 3, 2


def _result(n_gen: int, start: int, n_routes: int, version: int, seed: int) -> GenerateResult:
    rng = np.random.default_rng(seed)
    return GenerateResult(
        token_ids=rng.integers(0, 50, n_gen).astype(np.int32),
        logprobs=np.full(n_gen, -0.5, np.float32),
        versions=np.full(n_gen, version, np.int32),
        finish_reason="stop",
        routes=rng.integers(0, 8, (n_routes, LAYERS, TOP_K)).astype(np.uint8),
        route_versions=np.full(n_routes, version, np.int32),
        routes_start=start,
    )


def test_a_second_turn_adds_only_its_new_positions_and_each_keeps_its_version() -> None:
    first = _result(3, start=0, n_routes=4 + 3 - 1, version=6, seed=1)  # prompt of 4, reply of 3: 6 fed positions
    second = _result(2, start=6, n_routes=1 + 2 + 2 - 1, version=7, seed=2)  # r2 + env of 2 + reply of 2
    turns = [
        Turn.context("prompt", [1, 2, 3, 4]),
        Turn.policy(first),
        Turn.context("env", [9, 9]),
        Turn.policy(second),
    ]
    routes = assemble_routes(turns)
    assert routes is not None and routes.recomputed == 0
    assert routes.versions.tolist() == [6] * 6 + [7] * 4 + [-1]
    np.testing.assert_array_equal(routes.routes[:6], first.routes)
    np.testing.assert_array_equal(routes.routes[6:10], second.routes)
    sample = build_sample(Trajectory.of(turns), trajectory_id="t", reward=1.0, status="ok", tags=(), gen_s=0.0)
    group = TrajectoryGroup.from_samples(group_id="g", prompt_id="p", generator_id="x", samples=[sample])
    assert group.routes is not None and group.route_versions.tolist() == routes.versions.tolist()
    assert "recomputed_route_positions" not in sample.info


def test_a_recomputed_prefix_replaces_the_earlier_routes_and_is_counted() -> None:
    first = _result(3, start=0, n_routes=6, version=6, seed=1)
    again = _result(2, start=0, n_routes=4 + 3 + 2 + 2 - 1, version=7, seed=3)  # the cache was gone: all from 0
    turns = [Turn.context("prompt", [1, 2, 3, 4]), Turn.policy(first), Turn.context("env", [9, 9]), Turn.policy(again)]
    routes = assemble_routes(turns)
    assert routes is not None and routes.recomputed == 6
    assert routes.versions.tolist() == [7] * 10 + [-1]
    np.testing.assert_array_equal(routes.routes[:10], again.routes)
    sample = build_sample(Trajectory.of(turns), trajectory_id="t", reward=1.0, status="ok", tags=(), gen_s=0.0)
    assert sample.info["recomputed_route_positions"] == 6


def test_dense_turns_have_no_routes_and_routes_past_the_trajectory_are_refused() -> None:
    dense = GenerateResult(np.array([5], np.int32), np.array([-0.1], np.float32), np.array([0], np.int32), "stop")
    assert assemble_routes([Turn.context("prompt", [1, 2]), Turn.policy(dense)]) is None
    with pytest.raises(ValueError, match="do not fit"):
        assemble_routes(
            [Turn.context("prompt", [1, 2]), Turn.policy(_result(1, start=2, n_routes=3, version=0, seed=0))]
        )
