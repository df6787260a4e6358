"""The sandbox pool: at most max_concurrent at once, starts in waves of starts_per_s, reservations out of the
machine's CPUs and memory, a wait for a slot bounded (sandbox_start_timeout, naming the wait), an idle sandbox
reaped (its next request is sandbox_lost), every sandbox torn down when its block ends or the pool closes, the
unisolated backend refused unless allowed, and sandbox timeouts and limits that are nan, inf or negative refused."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from pipeline.config_sections import SandboxConfig
from pipeline.sandbox import SandboxLost, SandboxRefused, SandboxSpec, SandboxStartTimeout
from pipeline.sandbox.local import LocalSandbox
from pipeline.sandbox.pool import PoolSettings, SandboxPool
from pipeline.sandbox.supervised import uid_processes


def test_waves_space_the_starts_and_max_concurrent_bounds_the_live_ones() -> None:
    async def go() -> tuple[list[float], int]:
        pool = SandboxPool(PoolSettings(max_concurrent=3, starts_per_s=10.0, cpus=0.01, memory_mb=16))
        peak = 0

        async def episode() -> None:
            nonlocal peak
            async with pool.sandbox(SandboxSpec(label="wave")) as box:
                peak = max(peak, pool.live)
                assert (await box.exec("echo ok", timeout_s=30)).stdout == "ok\n"

        await asyncio.gather(*(episode() for _ in range(8)))
        await pool.close()
        return pool.stats.admitted_s, peak

    admitted, peak = asyncio.run(go())
    assert len(admitted) == 8 and peak <= 3
    gaps = [b - a for a, b in zip(admitted[:-1], admitted[1:], strict=True)]
    assert min(gaps) >= 0.1 - 1e-3, gaps  # 10 a second: never two starts closer than 0.1 s


def test_a_reservation_waits_for_room_on_the_machine() -> None:
    async def go() -> int:
        import os

        pool = SandboxPool(PoolSettings(max_concurrent=8, starts_per_s=0, cpus=float(os.cpu_count() or 1)))
        peak = 0

        async def episode() -> None:
            nonlocal peak
            async with pool.sandbox(SandboxSpec(label="big")):
                peak = max(peak, pool.live)
                await asyncio.sleep(0)

        await asyncio.gather(*(episode() for _ in range(3)))
        return peak

    assert asyncio.run(go()) == 1  # each reserves every CPU: one at a time


def test_an_idle_sandbox_is_reaped_and_its_next_request_is_sandbox_lost() -> None:
    async def go() -> None:
        pool = SandboxPool(PoolSettings(starts_per_s=0, cpus=0.01, memory_mb=16, idle_timeout_s=0.2))
        async with pool.sandbox(SandboxSpec(label="idle")) as box:
            while box.alive:  # the reaper's event: it kills the box once it has been idle past the timeout
                await asyncio.sleep(0.05)
            with pytest.raises(SandboxLost, match="reaped"):
                await box.exec("true", timeout_s=30)
        assert pool.stats.reaped == 1
        await pool.close()

    asyncio.run(go())


def test_a_sandbox_still_starting_is_never_reaped_as_idle() -> None:
    """Every start takes longer than this idle timeout; the reaper, looking every 0.25 ms, must wait for it to end."""

    async def go() -> None:
        pool = SandboxPool(PoolSettings(starts_per_s=0, cpus=0.01, memory_mb=16, idle_timeout_s=0.001))
        async with pool.sandbox(SandboxSpec(label="slow-start")) as box:
            assert box.started_s is not None and box.started_s > 0.001
            while box.alive:  # once started and idle, it is reaped
                await asyncio.sleep(0.01)
        assert (pool.stats.started, pool.stats.start_failed, pool.stats.reaped) == (1, 0, 1)
        await pool.close()

    asyncio.run(go())


def test_every_sandbox_is_torn_down_when_its_block_ends_however_it_ends() -> None:
    async def go() -> list[int]:
        pool = SandboxPool(PoolSettings(starts_per_s=0, cpus=0.01, memory_mb=16))
        uids = []
        with pytest.raises(RuntimeError, match="the episode failed"):
            async with pool.sandbox(SandboxSpec(label="fails")) as box:
                await box.exec("sleep 1000 &", timeout_s=30)
                assert box.uid is not None
                uids.append(box.uid)
                raise RuntimeError("the episode failed")
        await pool.close()
        return uids

    (uid,) = asyncio.run(go())
    assert uid_processes(uid) == []


def test_the_unisolated_backend_is_refused_unless_allowed() -> None:
    with pytest.raises(SandboxRefused, match="allow_unisolated"):
        SandboxPool(PoolSettings(backend="local"))
    pool = SandboxPool(PoolSettings(backend="local", allow_unisolated=True, cpus=0.01, memory_mb=16))
    assert pool.backend == "local"

    async def go() -> str:
        async with pool.sandbox(SandboxSpec(label="local")) as box:
            assert isinstance(box, LocalSandbox)
            await box.exec("echo here > note.txt", timeout_s=30)
            return (await box.exec("cat note.txt; pwd", timeout_s=30)).stdout

    out = asyncio.run(go())
    assert out.startswith("here\n") and "leeway-sandbox-" in out  # its private directory stands for /app


def test_waiting_for_a_slot_is_bounded_and_the_wait_is_named() -> None:
    async def go() -> None:
        pool = SandboxPool(
            PoolSettings(
                backend="local",
                allow_unisolated=True,
                max_concurrent=1,
                cpus=0.01,
                memory_mb=16,
                admission_timeout_s=0.2,
            )
        )
        holding, done = asyncio.Event(), asyncio.Event()

        async def holder() -> None:
            async with pool.sandbox(SandboxSpec(label="holder")):
                holding.set()
                await done.wait()

        task = asyncio.ensure_future(holder())
        await holding.wait()
        with pytest.raises(SandboxStartTimeout, match="waited .* for a sandbox slot"):
            async with pool.sandbox(SandboxSpec(label="never")):
                pass
        done.set()
        await task
        async with pool.sandbox(SandboxSpec(label="after")) as box:  # the slot it waited for was never taken
            assert (await box.exec("echo ok", timeout_s=30)).stdout == "ok\n"
        await pool.close()

    asyncio.run(go())


@pytest.mark.parametrize("field", ["start_timeout_s", "admission_timeout_s", "command_timeout_s", "idle_timeout_s"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, 0.0])
def test_sandbox_timeouts_must_be_finite_and_positive(field: str, value: float) -> None:
    with pytest.raises(ValidationError, match=field):
        SandboxConfig(**{field: value})


def test_sandbox_limits_reject_nan_inf_and_negatives() -> None:
    for field, value in (("starts_per_s", float("nan")), ("cpus", float("inf")), ("cpu_quota", -1.0), ("disk_mb", 0)):
        with pytest.raises(ValidationError, match=field):
            SandboxConfig(**{field: value})
