"""Hostile replies against the real scorers, in their sandboxed workers (`pipeline/tasks/verifiers.py`): an answer
that a scorer evaluates never runs in the caller (no credential, no host file), an answer that freezes math-verify
never freezes the event loop, a hung scorer is killed and replaced, and the self-check refuses the scorers that
evaluate answers. One pool per module: worker starts are paid once. The hostile cases run again as an unprivileged
host user (a non-root generator: workers in a user namespace, no uid of their own) through a pool of its own."""

from __future__ import annotations

import asyncio
import ctypes
import fcntl
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.sandbox.uids import LOCK_DIR, allocate_uid, uid_processes
from pipeline.tasks import Prompt, Task, VerifierPool, get_task
from pipeline.tasks.self_check import TaskSelfCheckError, require_verified_task, self_check
from tests.support.forked import drop_to, in_forked_child
from tests.support.waits import wait_until
from tests.tasks.scorer_tasks import MisbehavingTask

SECRET_ENV = "LEEWAY_SCORER_TEST_SECRET"


@pytest.fixture(scope="module")
def pool() -> Iterator[VerifierPool]:
    with VerifierPool(timeout_s=6.0, workers=2) as shared:
        yield shared


def _first(task: Task) -> Prompt:
    return next(iter(task.prompts()))


def test_an_evaluated_answer_runs_in_the_worker_never_in_the_caller(pool, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(SECRET_ENV, "s3cret")
    task = get_task("reasoning_gym", dataset="countdown", size=4, eval_size=0)
    stolen, ran = tmp_path / "stolen", tmp_path / "ran"
    steal = f"__import__('pathlib').Path('{stolen}').write_text(__import__('os').environ.get('{SECRET_ENV}', 'none'))"
    system = f"__import__('os').system('touch {ran}')"
    for answer in (steal, system):
        result = asyncio.run(pool.verify(task, _first(task), task.completion_for(answer), []))
        assert result.status != "infra_error" and result.reward is not None and result.reward < 1.0, result
    assert not stolen.exists() and not ran.exists()  # countdown's scorer evaluates it: in the caller, both would be


def test_a_worker_has_no_credentials_network_host_files_or_root(pool, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(SECRET_ENV, "s3cret")
    (tmp_path / "run-file").write_text("x")
    prompt = Prompt("p", text="x", metadata={"host_path": str(tmp_path / "run-file")})
    info = asyncio.run(pool.verify(MisbehavingTask(), prompt, "where", [])).info
    assert SECRET_ENV not in info["env"] and not any(k.startswith(("AWS", "NATS")) for k in info["env"])
    assert info["sees_host_path"] is False
    assert info["network"] != "connected" and "refused" in info["network"]  # the audit hook, before the netns
    if os.geteuid() == 0:
        assert info["uid"] != 0


def test_a_hung_scorer_is_killed_replaced_and_its_sample_is_the_policys_failure() -> None:
    task, prompt = MisbehavingTask(), Prompt("p", text="x")
    with VerifierPool(timeout_s=1.0, workers=1) as short:
        assert asyncio.run(short.verify(task, prompt, "ok", [])).reward == 1.0
        hung = asyncio.run(short.verify(task, prompt, "hang", []))
        assert (hung.reward, hung.status, hung.info["error"]) == (0.0, "ok", "scorer_timeout")
        assert short.kills == 1
        assert asyncio.run(short.verify(task, prompt, "ok", [])).reward == 1.0  # the replacement answers
        crashed = asyncio.run(short.verify(task, prompt, "raise", []))
        assert crashed.status == "infra_error" and crashed.info["infra_reason"] == "verifier_crashed"
        assert "scorer broke" in crashed.info["error"] and short.kills == 1  # an exception kills nothing


def test_a_huge_expression_never_freezes_the_event_loop(pool, tmp_path) -> None:
    rows = tmp_path / "math.jsonl"
    rows.write_text(json.dumps({"id": "m", "prompt": "3?", "answer": "3"}) + "\n")
    task = get_task("math", path=str(rows))

    async def main() -> tuple[object, int, float]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        await pool.verify(task, _first(task), "\\boxed{3}", [])  # the scorer built: what follows is the answer
        started = time.monotonic()
        result = await pool.verify(task, _first(task), "\\boxed{9^{9^{9}}}", [])
        ticker.cancel()
        return result, ticks, time.monotonic() - started

    result, ticks, took = asyncio.run(main())
    assert result.reward == 0.0 and (result.status == "format_error" or result.status == "ok"), result
    assert took > 0.5 and ticks >= took / 0.01 * 0.2  # the loop ticked all along (a frozen loop: none)


def test_self_check_refuses_scorers_that_evaluate_answers_and_passes_the_shipped_ones(pool, tmp_path) -> None:
    countdown = get_task("reasoning_gym", dataset="countdown", size=4, eval_size=0)
    with pytest.raises(TaskSelfCheckError, match="'reasoning_gym'.*evaluates answers as code"):
        asyncio.run(
            require_verified_task(countdown, "reasoning_gym", [_first(countdown)], pool, skip=False, has_agent=False)
        )
    chain = get_task("reasoning_gym", dataset="chain_sum", size=8, eval_size=0, config={"min_terms": 2, "max_terms": 2})
    assert asyncio.run(self_check(chain, list(itertools.islice(chain.prompts(), 2)), pool)) == []
    rows = tmp_path / "math.jsonl"
    rows.write_text(json.dumps({"id": "m", "prompt": "1/2?", "answer": "\\frac{1}{2}"}) + "\n")
    math_task = get_task("math", path=str(rows))
    assert asyncio.run(self_check(math_task, [_first(math_task)], pool)) == []


SEEDED_PROMPTS = """
import itertools, json
from pipeline.tasks import get_task
task = get_task("reasoning_gym", dataset="polynomial_multiplication", size=3, eval_size=0)
prompts = [p.to_json().decode() for p in itertools.islice(task.prompts(), 3)]
print(json.dumps({"hash": hash("leeway"), "prompts": prompts}))
"""


def test_items_that_depend_on_the_hash_seed_match_workers_only_under_pythonhashseed_0(pool) -> None:
    """polynomial_multiplication picks monomials from a set: its items differ between processes of other hash
    seeds. Workers run with PYTHONHASHSEED=0: prompts made under it are scored, others refused naming the seed."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    runs = {
        seed: subprocess.Popen(
            [sys.executable, "-c", SEEDED_PROMPTS], env={**env, "PYTHONHASHSEED": seed}, stdout=subprocess.PIPE
        )
        for seed in ("0", "1")
    }
    made = {seed: json.loads(run.communicate(timeout=120)[0]) for seed, run in runs.items()}
    task = get_task("reasoning_gym", dataset="polynomial_multiplication", size=3, eval_size=0)
    where = asyncio.run(pool.verify(MisbehavingTask(), Prompt("p", text="x"), "where", [])).info
    assert where["hash"] == made["0"]["hash"] != made["1"]["hash"]  # the worker's hash seed is 0
    differ = 0
    for same, other in zip(made["0"]["prompts"], made["1"]["prompts"], strict=True):
        prompt = Prompt.from_json(same.encode())
        ok = asyncio.run(pool.verify(task, prompt, task.completion_for(str(prompt.answer)), []))
        assert (ok.reward, ok.status) == (1.0, "ok"), ok
        if other != same:
            differ += 1
            stranger = Prompt.from_json(other.encode())
            refused = asyncio.run(pool.verify(task, stranger, task.completion_for(str(stranger.answer)), []))
            assert refused.status == "infra_error" and "PYTHONHASHSEED=0" in refused.info["error"], refused
    assert differ  # the cause is real: another hash seed made other items


def test_skyrl_environments_that_run_the_reply_are_refused_by_name(tmp_path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "q", "prompt": "2+3?", "answer": "5"}) + "\n")
    for env in ("lcb", "searchcode"):
        with pytest.raises(ValueError, match=f"environment '{env}' is refused: it runs the reply"):
            get_task("skyrl_gym", env=env, path=str(rows))


def test_a_task_without_a_recipe_is_named(pool) -> None:
    class Local(MisbehavingTask):
        def __init__(self, anything: int) -> None:
            self.anything = anything

    result = asyncio.run(pool.verify(Local(1), Prompt("p", text="x"), "ok", []))
    assert result.status == "infra_error" and "has no scorer recipe" in result.info["error"]


def _leased(uid: int) -> bool:
    """Someone holds `uid`'s host-wide lease (its lock file is locked)."""
    fd = os.open(LOCK_DIR / str(uid), os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_workers_run_as_leased_uids_of_their_own_and_are_gone_after_close() -> None:
    held = allocate_uid()  # a sandbox's uid, in use while the workers start: never theirs
    try:
        with VerifierPool(timeout_s=5.0, workers=2) as closing:
            assert asyncio.run(closing.verify(MisbehavingTask(), Prompt("p", text="x"), "ok", [])).reward == 1.0
            wait_until(lambda: all(s._ready.is_set() for s in closing.slots), what="both workers started")
            workers = [slot._worker for slot in closing.slots if slot._worker is not None]
            pids = [worker.proc.pid for worker in workers]
            uids = [worker.uid for worker in workers]
            assert len(pids) == 2
            if held is not None:  # a root host: each worker holds a lease of the host-wide set, none shared
                assert len(set(uids)) == 2 and held.uid not in uids, (uids, held.uid)
                assert all(uid is not None and _leased(uid) and uid_processes(uid) for uid in uids)
    finally:
        if held is not None:
            held.release(gone=True)
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()]
    for uid in uids:
        if uid is not None:  # given back: free for the next sandbox or worker once its processes are gone
            assert not _leased(uid)
            wait_until(lambda uid=uid: not uid_processes(uid), what=f"uid {uid}'s processes gone")


NOBODY = 65534
CLONE_NEWNS = 0x00020000


def _reach_interpreter() -> None:
    """Make this process's interpreter reachable for an unprivileged uid, as a non-root user's own install is (a
    venv and its base interpreter at paths they may walk). Here the base interpreter lives under ``/root``
    (mode 0700), which no other uid may walk: in a mount namespace of this process alone, each such directory above
    the interpreter's prefixes is covered by an empty tmpfs (0755) holding only the next directory of the path,
    bound back. Nothing else changes: the files keep their owners and modes, and the rest of ``/root`` is hidden."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)
    for prefix in {Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve()}:
        for above in reversed(prefix.parents):
            if above == Path("/") or above.stat().st_mode & 0o001:
                continue
            below = prefix.relative_to(above).parts[0]
            with tempfile.TemporaryDirectory(prefix="leeway-reach-") as saved:
                subprocess.run(["mount", "--bind", str(above), saved], check=True)
                subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755,size=64k", "tmpfs", str(above)], check=True)
                (above / below).mkdir()
                subprocess.run(["mount", "--bind", f"{saved}/{below}", str(above / below)], check=True)
                subprocess.run(["umount", "-l", saved], check=True)


def _hostile_as_nobody(scratch: Path) -> dict[str, Any]:
    """In this (forked) process, dropped to an unprivileged uid: the hostile replies through its own pool."""
    _reach_interpreter()
    os.environ["MPLCONFIGDIR"] = str(scratch / "matplotlib")  # reasoning-gym imports it; root's home is not ours
    drop_to(NOBODY)
    host_file, stolen = scratch / "host-file", scratch / "stolen"
    assert host_file.read_text() == "host" and os.environ[SECRET_ENV] == "s3cret"  # the host user reads both
    seen: dict[str, Any] = {}
    task, countdown = MisbehavingTask(), get_task("reasoning_gym", dataset="countdown", size=4, eval_size=0)
    probe = (
        f"(__import__('os').environ.get('{SECRET_ENV}', 'no-env'), __import__('os').path.exists('{host_file}'), "
        f"'{{marker}}')"
    )
    steal = f"__import__('pathlib').Path('{stolen}').write_text(open('{host_file}').read() + '{{marker}}')"
    with VerifierPool(timeout_s=3.0, workers=1) as pool:

        def verify(on: Task, prompt: Prompt, text: str, marker: str | None = None) -> dict[str, Any]:
            result = asyncio.run(pool.verify(on, prompt, text.replace("{marker}", str(marker)), [], probe=marker))
            return {"reward": result.reward, "status": result.status, "info": result.info}

        seen["where"] = verify(task, Prompt("p", text="x", metadata={"host_path": str(host_file)}), "where")
        seen["probe"] = verify(task, Prompt("p", text="x"), f"eval:{probe}", "leeway_probe_nobody_1")
        seen["steal"] = verify(countdown, _first(countdown), countdown.completion_for(steal), "leeway_probe_nobody_2")
        seen["hung"] = verify(task, Prompt("p", text="x"), "hang")
        seen["kills"] = pool.kills
        seen["after"] = verify(task, Prompt("p", text="x"), "ok")
    seen["stolen"] = stolen.exists()
    return seen


@pytest.mark.skipif(os.geteuid() != 0, reason="drops from root to an unprivileged uid")
def test_hostile_replies_as_an_unprivileged_host_user(monkeypatch) -> None:
    monkeypatch.setenv(SECRET_ENV, "s3cret")
    with tempfile.TemporaryDirectory(prefix="leeway-nobody-") as scratch:  # pytest's tmp_path is root's alone
        os.chmod(scratch, 0o777)
        (Path(scratch) / "host-file").write_text("host")  # readable by the unprivileged host user, not its workers
        seen = in_forked_child(lambda: _hostile_as_nobody(Path(scratch)))
    where = seen["where"]["info"]
    assert SECRET_ENV not in where["env"] and where["sees_host_path"] is False and where["uid"] != 0, where
    probe = seen["probe"]["info"]  # evaluated in the worker: it saw neither the parent's variable nor the host file
    assert probe["evaluated_probe"] is True and probe["value"] == "('no-env', False, 'leeway_probe_nobody_1')", probe
    steal = seen["steal"]  # countdown's real scorer evaluated it where the host file is not: nothing stolen
    assert steal["info"].get("evaluated_probe") is True and steal["status"] != "infra_error", steal
    assert seen["stolen"] is False
    assert (seen["hung"]["reward"], seen["hung"]["info"].get("error"), seen["kills"]) == (0.0, "scorer_timeout", 1)
    assert seen["after"]["reward"] == 1.0  # the killed worker was replaced
