"""Where a fleet's roles go and what they are called: pure decisions, no Ray calls.

A fleet of run R lives in the Ray namespace `leeway-R`; each role is a named detached actor there
(`trainer-0` .. `trainer-{N-1}`, `gen-0`, `gen-1`, ...), so a later `leeway fleet` invocation finds
every role of the run, and nothing of any other run, by listing that namespace. Trainer ranks share
one packed placement group; generators are spread over the nodes. A generator's actor name is also
its `generator.id`, so the ids recorded on trajectories name the actor that produced them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from infra.ports import is_loopback
from pipeline.config import LeewayConfig

TRAINER_PREFIX = "trainer-"
GENERATOR_PREFIX = "gen-"
_GENERATOR_NAME_RE = re.compile(r"^gen-(\d+)$")
_TRAINER_NAME_RE = re.compile(r"^trainer-(\d+)$")


def namespace(run_name: str) -> str:
    """The Ray namespace holding every role of one run (run names are already namespace-safe)."""
    return f"leeway-{run_name}"


def placement_group_name(run_name: str) -> str:
    return f"leeway-{run_name}-trainer"


def trainer_names(num_ranks: int) -> list[str]:
    return [f"{TRAINER_PREFIX}{rank}" for rank in range(num_ranks)]


def generator_index(name: str) -> int | None:
    """The index of a generator actor name (`gen-3` -> 3), None for any other name."""
    match = _GENERATOR_NAME_RE.match(name)
    return int(match.group(1)) if match else None


def is_trainer(name: str) -> bool:
    return _TRAINER_NAME_RE.match(name) is not None


def role_sort_key(name: str) -> tuple[int, int, str]:
    """Trainer ranks first, then generators by index, then anything else by name."""
    if is_trainer(name):
        return (0, int(name[len(TRAINER_PREFIX) :]), name)
    index = generator_index(name)
    return (1, index, name) if index is not None else (2, 0, name)


@dataclass(frozen=True)
class ScalePlan:
    """Generators to start and to drain so that `target` run; the newest are removed first."""

    start: tuple[str, ...]
    drain: tuple[str, ...]


def plan_scale(running: Iterable[str], target: int) -> ScalePlan:
    """New names continue after the highest index ever used, so a drained generator's id is never reused
    while its last groups may still be in flight. Raises ValueError for a negative target."""
    if target < 0:
        raise ValueError(f"--generators must be 0 or more, got {target}")
    indices = sorted(i for i in (generator_index(n) for n in running) if i is not None)
    if target >= len(indices):
        first = indices[-1] + 1 if indices else 0
        return ScalePlan(
            start=tuple(f"{GENERATOR_PREFIX}{i}" for i in range(first, first + target - len(indices))), drain=()
        )
    keep = len(indices) - (len(indices) - target)
    return ScalePlan(start=(), drain=tuple(f"{GENERATOR_PREFIX}{i}" for i in reversed(indices[keep:])))


def wants_cuda(device: str) -> bool:
    return device.startswith("cuda")


def trainer_bundles(cfg: LeewayConfig, num_ranks: int) -> list[dict[str, float]]:
    """One bundle per rank actor: a CPU, and on CUDA a GPU per process it runs. A single rank actor runs
    `leeway trainer`, which starts `trainer.nproc` local ranks itself; several rank actors are one process each."""
    bundle: dict[str, float] = {"CPU": 1.0}
    if wants_cuda(cfg.trainer.device):
        bundle["GPU"] = float(cfg.trainer.nproc if num_ranks == 1 else 1)
    return [dict(bundle) for _ in range(num_ranks)]


def trainer_layout_refusal(cfg: LeewayConfig, num_ranks: int) -> str | None:
    """Why these trainer ranks cannot be placed as configured, or None.

    Ray restarts one actor at a time, and a restarted rank would not find the others' group (rank 0 picks
    a new port), so `trainer_restart: resume` takes a single rank actor: use `trainer.nproc` for several
    ranks on one node, which `leeway trainer` restarts together.
    """
    if num_ranks < 1:
        return f"--trainer-ranks must be at least 1, got {num_ranks}"
    if num_ranks > 1 and cfg.fleet.trainer_restart == "resume":
        return (
            f"fleet.trainer_restart: resume restarts a single trainer actor; with --trainer-ranks {num_ranks} use "
            "fleet.trainer_restart: stop, or --trainer-ranks 1 with trainer.nproc for ranks on one node"
        )
    return None


def generator_resources(cfg: LeewayConfig) -> dict[str, float]:
    """Ray resources of one generator actor: a CPU, and a GPU when its engine runs on CUDA."""
    return {"num_cpus": 1.0, "num_gpus": 1.0 if wants_cuda(cfg.engine.device) else 0.0}


def rank_env(rank: int, world_size: int, master_addr: str, master_port: int | str) -> dict[str, str]:
    """The torch.distributed launcher contract (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`) for
    one trainer rank; a single rank gets none, exactly like `leeway trainer` started by hand."""
    if world_size == 1:
        return {}
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": "0",
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


def embedded_stack_refusal(cfg: LeewayConfig, node_addresses: Sequence[str]) -> str | None:
    """Why this fleet cannot use the embedded stack, or None when it can (or needs none).

    The embedded servers listen on 127.0.0.1 of the head node, so they serve a fleet only when every
    alive node is this machine: a one-node cluster (`fleet up` runs on its head), or simulated nodes on loopback.
    """
    if not cfg.uses_embedded_stack:
        return None
    remote = sorted({a for a in node_addresses if not is_loopback(a)})
    if not remote or len(set(node_addresses)) == 1:
        return None
    return (
        f"the Ray cluster has nodes at {', '.join(remote)}: they cannot reach the embedded stack on 127.0.0.1; "
        "set nats.url and store.endpoint (or store.url: file:// on a shared filesystem) to servers every node reaches"
    )


def merge_versions(
    roles: Sequence[Mapping[str, object]], trainer_record: Mapping[str, object] | None
) -> list[dict[str, object]]:
    """Fill in each role's policy version and last report from the trainer's newest metrics record.

    The trainer's record is the one place that knows every generator's version (from their reports);
    a role the trainer has not heard from yet keeps `version: None`.
    """
    reports = (trainer_record or {}).get("generators") or {}
    assert isinstance(reports, Mapping)
    out = []
    for role in roles:
        merged = dict(role)
        name = str(role.get("name"))
        if is_trainer(name) and trainer_record:
            merged["version"] = trainer_record.get("version")
            merged["last_report"] = {
                k: trainer_record.get(k) for k in ("step", "time_s", "reward/unfiltered_mean") if k in trainer_record
            }
        elif name in reports and isinstance(reports[name], Mapping):
            report = reports[name]
            merged["version"] = report.get("version")
            merged["last_report"] = {
                k: report.get(k) for k in ("time_s", "tokens_per_s", "rollouts_in_flight") if k in report
            }
        else:
            merged.setdefault("version", None)
            merged.setdefault("last_report", None)
        out.append(merged)
    return sorted(out, key=lambda r: role_sort_key(str(r.get("name"))))
