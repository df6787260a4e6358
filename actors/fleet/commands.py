"""`leeway fleet up|scale|status|down`: a run's roles placed on a Ray cluster, found again by namespace.

```
  fleet up ──► Ray cluster (--address, fleet.address, RAY_ADDRESS, or a local one started here)
     │           ├─ placement group leeway-<run>-trainer (PACK): trainer-0 .. trainer-{N-1}
     │           └─ SPREAD: gen-0 .. gen-{M-1}                          (RoleActor, namespace leeway-<run>)
     └─► <run.dir>/fleet.json: the address, and what `up` started itself (local cluster, embedded stack)
  fleet scale ─► start gen-K.. / drain the newest generators          fleet status ─► each actor's status
  fleet down ──► drain generators, stop trainer ranks, kill the actors, remove the placement group,
                 stop the local cluster and embedded stack `up` started (and nothing else)
```

Every command after `up` finds the fleet through the run's namespace, so it may run from another
shell or machine that reaches the cluster. Nothing but small status dicts crosses Ray. The local
cluster binds to 127.0.0.1 without a dashboard; token authentication stays as Ray sets it (on).
Ray is the `fleet` extra (`pip install 'leeway[fleet]'`), imported only inside the functions that use it: without
it every command answers one line saying so, and nothing else of Leeway needs it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from actors.cli_args import WithConfig, add_config_arguments
from actors.fleet import placement
from infra.ports import is_loopback
from pipeline.config import LeewayConfig

START_TIMEOUT_S = 300.0
"""How long `up`/`scale` wait for roles to be placed and started (a busy cluster may queue them)."""
STATUS_TIMEOUT_S = 30.0
"""How long one role may take to answer `status`."""
DRAIN_MARGIN_S = 30.0
"""How much longer than a role's own SIGTERM grace (`run.stop_grace_s`) `scale`/`down` wait for it to drain."""
LOCAL_CLUSTER_TIMEOUT_S = 120.0
"""How long a local cluster started by `up` may take to accept connections."""
LOCAL_CLUSTER_STOP_S = 10.0
"""SIGTERM grace of the local cluster's `ray start --block` before its process group is killed (the roles
are stopped already; its servers hold nothing the run needs)."""
WAIT_POLL_S = 2.0
"""How often `up --wait` asks the trainer whether it ended."""
LOCAL_ROLE_SLOTS = 32
"""CPUs a local cluster advertises at least: each role asks Ray for one CPU, but on one machine the roles share
the cores as under `leeway run` (each pins its own torch threads), so Ray's count must not cap the fleet."""
STATE_FILE = "fleet.json"
LOCAL_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
"""Makes Ray's head, raylets and GCS listen on 127.0.0.1 (and refuse other nodes): a local cluster stays private."""


class FleetError(RuntimeError):
    """A fleet command cannot go on; the message says why and what to do."""


@dataclass
class FleetState:
    """What `up` recorded in `<run.dir>/fleet.json`, so `down` stops exactly what `up` started."""

    address: str
    namespace: str
    local_cluster: dict[str, Any] | None = None
    """`infra.process.ProcessInfo` of the `ray start --head --block` that `up` started, if it did."""
    stack_dir: str | None = None
    """The embedded stack `up` started, if it did."""

    @classmethod
    def load(cls, run_dir: Path) -> FleetState | None:
        path = run_dir / STATE_FILE
        if not path.is_file():
            return None
        try:
            return cls(**json.loads(path.read_text()))
        except (ValueError, TypeError) as exc:
            raise FleetError(
                f"{path}: not a fleet state file ({exc}); delete it if no fleet of this run is up"
            ) from None

    def save(self, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / STATE_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")


def _is_loopback_address(address: str) -> bool:
    """True when a Ray address `host:port` (`[::1]:port` for IPv6) names this machine only."""
    return is_loopback(address.rsplit(":", 1)[0].removeprefix("[").removesuffix("]"))


def resolve_address(arg: str | None, cfg: LeewayConfig, state: FleetState | None) -> str | None:
    """`--address`, then `fleet.address`, then RAY_ADDRESS, then the cluster `up` recorded; None: none named."""
    return arg or cfg.fleet.address or os.environ.get("RAY_ADDRESS") or (state.address if state else None)


# ------------------------------------------------------------------------------------------ cluster


def _local_cluster_alive(state: FleetState | None) -> bool:
    from infra.process import ProcessInfo, is_running

    return bool(state and state.local_cluster and is_running(ProcessInfo.from_json(state.local_cluster)))


def start_local_cluster(run_dir: Path) -> tuple[str, dict[str, Any]]:
    """`ray start --head --block` on 127.0.0.1 without a dashboard, free of this process (it outlives `up`)."""
    from infra.ports import free_port
    from infra.process import log_tail, spawn

    port = free_port()
    ray_cli = Path(sys.executable).parent / "ray"
    argv = [
        str(ray_cli) if ray_cli.exists() else "ray",
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        f"--port={port}",
        "--include-dashboard=false",
        "--disable-usage-stats",
        f"--num-cpus={max(os.cpu_count() or 1, LOCAL_ROLE_SLOTS)}",
    ]
    os.environ.update(LOCAL_ENV)  # inherited by `ray start`; this driver binds to 127.0.0.1 too
    _, info = spawn("ray-head", argv, run_dir / "logs" / "ray-head.log", ports={"gcs": port})
    deadline = time.monotonic() + LOCAL_CLUSTER_TIMEOUT_S
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1.0):
            break
        if time.monotonic() > deadline:
            raise FleetError(f"the local Ray head did not answer on port {port}:\n{log_tail(info.log_path)}")
        time.sleep(0.2)
    return f"127.0.0.1:{port}", info.to_json()


def connect(address: str, cfg: LeewayConfig) -> None:
    """Join the cluster as a driver in the run's namespace. For a cluster on 127.0.0.1, Ray must bind this
    driver to loopback too, and it reads that setting when it is imported: so import it only here."""
    if _is_loopback_address(address):
        for key, value in LOCAL_ENV.items():
            os.environ.setdefault(key, value)
    import ray

    ray.init(
        address=address,
        namespace=placement.namespace(cfg.run.name),
        log_to_driver=False,
        logging_level="WARNING",
        include_dashboard=False,
    )


@contextlib.contextmanager
def connected(address_arg: str | None, cfg: LeewayConfig) -> Iterator[FleetState | None]:
    """Connect to the run's cluster for one command (disconnecting at the end); `address_arg` is `--address`."""
    state = FleetState.load(cfg.run.run_dir.resolve())
    address = resolve_address(address_arg, cfg, state)
    if address is None:
        raise FleetError(
            f"no Ray cluster for run {cfg.run.name}: pass --address, set fleet.address or RAY_ADDRESS, "
            f"or start the fleet with `leeway fleet up` (no {cfg.run.run_dir / STATE_FILE})"
        )
    connect(address, cfg)
    try:
        yield state
    finally:
        import ray

        ray.shutdown()


def role_names() -> list[str]:
    import ray

    names = ray.util.list_named_actors()
    return sorted(
        (n for n in names if placement.is_trainer(n) or placement.generator_index(n) is not None),
        key=placement.role_sort_key,
    )


def _handle(name: str) -> Any:
    import ray

    return ray.get_actor(name)


# --------------------------------------------------------------------------------------------- up


def _resolved_for_fleet(cfg: LeewayConfig, run_dir: Path) -> LeewayConfig:
    """The config every role gets: absolute run.dir and stack_dir (roles run in other directories)."""
    cfg = cfg.model_copy(deep=True)
    cfg.run.dir = str(run_dir)
    cfg.nats.stack_dir = str(Path(cfg.nats.stack_dir).resolve())
    return cfg


def _ensure_stack(cfg: LeewayConfig, run_dir: Path) -> str | None:
    """Use a healthy stack at nats.stack_dir, or start one in `<run.dir>/stack` (returned: `down` stops it)."""
    import ray

    from actors.servers import running_stack_healthy, stack_bucket
    from infra.stack import start_stack

    nodes = [str(n["NodeManagerAddress"]) for n in ray.nodes() if n.get("Alive")]
    refusal = placement.embedded_stack_refusal(cfg, nodes)
    if refusal is not None:
        raise FleetError(refusal)
    if not cfg.uses_embedded_stack or running_stack_healthy(cfg.nats.stack_dir):
        return None
    stack_dir = (run_dir / "stack").resolve()
    start_stack(stack_dir, bucket=stack_bucket(cfg))
    cfg.nats.stack_dir = str(stack_dir)
    return str(stack_dir)


def _create(spec: Any, cfg: LeewayConfig, *, strategy: Any, resources: dict[str, float], max_restarts: int) -> Any:
    from actors.fleet.roles import role_actor_class

    return (
        role_actor_class()
        .options(
            name=spec.name,
            lifetime="detached",
            max_restarts=max_restarts,
            scheduling_strategy=strategy,
            **resources,
        )
        .remote(spec.to_json())
    )


def start_trainer(cfg: LeewayConfig, run_dir: Path, num_ranks: int) -> list[Any]:
    """N trainer ranks in one packed placement group; rank 0 picks the rendezvous the others join."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from actors.fleet.roles import AUTO, RoleSpec

    bundles = placement.trainer_bundles(cfg, num_ranks)
    group = placement_group(
        bundles, strategy="PACK", name=placement.placement_group_name(cfg.run.name), lifetime="detached"
    )
    ray.get(group.ready(), timeout=START_TIMEOUT_S)
    resume = cfg.fleet.trainer_restart == "resume"
    handles: list[Any] = []
    master: tuple[str, int | str] = (AUTO, AUTO)  # rank 0 resolves both on its node; the others join it
    for rank, name in enumerate(placement.trainer_names(num_ranks)):
        env = placement.rank_env(rank, num_ranks, *master)
        spec = RoleSpec(
            name=name,
            kind="trainer",
            config_yaml=cfg.to_yaml(),
            run_dir=str(run_dir),
            env=env,
            restart_on_failure=resume,
            resume_on_restart=resume,
            stops_fleet=rank == 0,
            stop_grace_s=cfg.stop_grace_s,
        )
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)
        resources = {"num_cpus": bundles[rank]["CPU"], "num_gpus": bundles[rank].get("GPU", 0.0)}
        handles.append(
            _create(
                spec, cfg, strategy=strategy, resources=resources, max_restarts=cfg.fleet.max_restarts if resume else 0
            )
        )
        if rank == 0 and num_ranks > 1:
            rendezvous = ray.get(handles[0].status.remote(), timeout=START_TIMEOUT_S)["rendezvous"]
            master = (str(rendezvous["MASTER_ADDR"]), int(rendezvous["MASTER_PORT"]))
    return handles


def start_generators(cfg_yaml: str, cfg: LeewayConfig, run_dir: Path, names: tuple[str, ...]) -> list[Any]:
    from actors.fleet.roles import RoleSpec

    handles = []
    for name in names:
        spec = RoleSpec(
            name=name,
            kind="generator",
            config_yaml=cfg_yaml,
            run_dir=str(run_dir),
            sets=(f"generator.id={name}",),
            stop_grace_s=cfg.stop_grace_s,
        )
        handles.append(
            _create(
                spec,
                cfg,
                strategy="SPREAD",
                resources=placement.generator_resources(cfg),
                max_restarts=cfg.fleet.max_restarts,
            )
        )
    return handles


def cmd_up(cfg: LeewayConfig, args: argparse.Namespace) -> int:
    from actors.fleet.roles import wait_started

    refusal = placement.trainer_layout_refusal(cfg, args.trainer_ranks)
    if refusal is not None or args.generators < 0:
        raise FleetError(refusal or f"--generators must be 0 or more, got {args.generators}")
    run_dir = cfg.run.run_dir.resolve()
    state = FleetState.load(run_dir)
    address = resolve_address(args.address, cfg, state if _local_cluster_alive(state) else None)
    ns = placement.namespace(cfg.run.name)
    local_cluster = state.local_cluster if state and _local_cluster_alive(state) and state.address == address else None
    if address is None:
        address, local_cluster = start_local_cluster(run_dir)
        FleetState(address, ns, local_cluster).save(run_dir)  # recorded at once: `down` stops it if `up` fails
        print(f"leeway fleet: started a local Ray cluster at {address} (127.0.0.1 only, no dashboard)")
    cfg = _resolved_for_fleet(cfg, run_dir)
    connect(address, cfg)
    import ray

    try:
        existing = role_names()
        if existing:
            raise FleetError(
                f"a fleet of run {cfg.run.name} is already up ({', '.join(existing)}): "
                "use `leeway fleet scale` or `leeway fleet down`"
            )
        FleetState(address, ns, local_cluster).save(run_dir)
        stack_dir = _ensure_stack(cfg, run_dir)
        FleetState(address, ns, local_cluster, stack_dir).save(run_dir)
        trainers = start_trainer(cfg, run_dir, args.trainer_ranks)
        gens = start_generators(cfg.to_yaml(), cfg, run_dir, placement.plan_scale([], args.generators).start)
        statuses = wait_started(trainers + gens, START_TIMEOUT_S)
        for status in statuses:
            print(f"  {status['name']:<12} node {status['node_id'][:12]} ({status['node_ip']})  pid {status['pid']}")
        print(
            f"leeway fleet: run {cfg.run.name} is up: {len(trainers)} trainer rank(s), {len(gens)} generator(s); "
            f"logs in {run_dir / 'logs'}"
        )
        if not args.wait:
            return 0
        return _wait_for_trainer(trainers[0])
    finally:
        ray.shutdown()


def _wait_for_trainer(handle: Any) -> int:
    import ray

    while True:
        try:
            status = ray.get(handle.status.remote(), timeout=STATUS_TIMEOUT_S)
        except ray.exceptions.RayActorError as exc:
            print(f"leeway fleet: the trainer actor died: {exc}", file=sys.stderr)
            return 1
        except ray.exceptions.GetTimeoutError:
            continue
        if status["state"] in ("exited", "failed", "stopped"):
            print(f"leeway fleet: the trainer {status['state']} ({status['returncode']}); log {status['log']}")
            return 0 if status["returncode"] == 0 else 1
        time.sleep(WAIT_POLL_S)


# ------------------------------------------------------------------------------------------ scale


def _drain(names: list[str], grace_s: float) -> list[dict[str, Any]]:
    """Stop these roles (all at once) and kill their actors; their final statuses. Each role gets `grace_s`
    after SIGTERM inside its actor (the trainer's final checkpoint), so the wait here is a little longer."""
    import ray

    handles = {}
    for name in names:
        with contextlib.suppress(ValueError):
            handles[name] = _handle(name)
    results: list[dict[str, Any]] = []
    refs = {name: h.stop.remote() for name, h in handles.items()}
    for name, ref in refs.items():
        try:
            results.append(ray.get(ref, timeout=grace_s + DRAIN_MARGIN_S))
        except Exception as exc:  # dead or unreachable: killing the actor kills its role too
            results.append({"name": name, "state": f"unreachable ({type(exc).__name__})"})
    for handle in handles.values():
        ray.kill(handle, no_restart=True)
    return results


def cmd_scale(cfg: LeewayConfig, args: argparse.Namespace) -> int:
    from actors.fleet.roles import wait_started

    with connected(args.address, cfg):
        import ray

        names = role_names()
        if not names:
            raise FleetError(f"no fleet of run {cfg.run.name} is up on this cluster")
        plan = placement.plan_scale(names, args.generators)
        if plan.start:
            template = ray.get(_handle(names[0]).spec.remote(), timeout=STATUS_TIMEOUT_S)
            run_dir = Path(template["run_dir"])
            started = start_generators(template["config_yaml"], cfg, run_dir, plan.start)
            wait_started(started, START_TIMEOUT_S)
            print(f"leeway fleet: started {', '.join(plan.start)}")
        if plan.drain:
            for result in _drain(list(plan.drain), cfg.stop_grace_s):
                print(f"leeway fleet: {result['name']} {result['state']} (exit {result.get('returncode')})")
        if not plan.start and not plan.drain:
            print(f"leeway fleet: {args.generators} generator(s) already run")
    return 0


# ----------------------------------------------------------------------------------------- status


def collect_status() -> list[dict[str, Any]]:
    """Every role of the connected namespace: its actor's status, Ray's restart count, version and report."""
    import ray
    from ray._private import state as ray_state  # the GCS actor table; the public state API needs the dashboard

    roles: list[dict[str, Any]] = []
    trainer_record: dict[str, Any] | None = None
    for name in role_names():
        try:
            handle = _handle(name)
        except ValueError:
            continue
        gcs = ray_state.actors(actor_id=handle._actor_id.hex()) or {}
        entry: dict[str, Any] = {"name": name, "actor_state": gcs.get("State"), "restarts": gcs.get("NumRestarts", 0)}
        try:
            entry.update(ray.get(handle.status.remote(), timeout=STATUS_TIMEOUT_S))
        except Exception as exc:
            entry.update(state=f"unreachable ({type(exc).__name__})")
        if name == "trainer-0":
            trainer_record = entry.pop("metrics", None)
        entry.pop("metrics", None)
        roles.append(entry)
    return placement.merge_versions(roles, trainer_record)


def cmd_status(cfg: LeewayConfig, args: argparse.Namespace) -> int:
    with connected(args.address, cfg):
        roles = collect_status()
    if args.json:
        print(json.dumps({"run": cfg.run.name, "namespace": placement.namespace(cfg.run.name), "roles": roles}))
        return 0
    if not roles:
        print(f"no fleet of run {cfg.run.name} is up")
        return 1
    print(f"{'role':<12} {'state':<10} {'node':<14} {'version':>7} {'restarts':>8}  last report")
    for role in roles:
        node = f"{str(role.get('node_id', '?'))[:12]}"
        print(
            f"{role['name']:<12} {str(role.get('state')):<10} {node:<14} {str(role.get('version')):>7} "
            f"{role.get('restarts', 0):>8}  {json.dumps(role.get('last_report'))}"
        )
    return 0


# ------------------------------------------------------------------------------------------- down


def cmd_down(cfg: LeewayConfig, args: argparse.Namespace) -> int:
    """Generators first (their prompts go back), then trainer rank 0 (it checkpoints and releases the other
    ranks), then the other ranks; then what `up` started itself. A local cluster that is gone already is
    not connected to: its roles died with it."""
    from infra.process import ProcessInfo, stop_processes
    from infra.stack import stop_stack

    run_dir = cfg.run.run_dir.resolve()
    state = FleetState.load(run_dir)
    stopped: list[dict[str, Any]] = []
    local_gone = state is not None and state.local_cluster is not None and not _local_cluster_alive(state)
    try:
        if local_gone and resolve_address(args.address, cfg, None) is None:
            raise FleetError("the local Ray cluster `fleet up` started is not running any more")
        with connected(args.address, cfg):
            import ray

            names = role_names()
            stopped += _drain([n for n in names if not placement.is_trainer(n)], cfg.stop_grace_s)
            stopped += _drain([n for n in names if n == placement.trainer_names(1)[0]], cfg.stop_grace_s)
            stopped += _drain([n for n in names if placement.is_trainer(n)], cfg.stop_grace_s)
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(
                    ray.util.get_placement_group(placement.placement_group_name(cfg.run.name))
                )
    except (FleetError, ConnectionError) as exc:
        if state is None:
            raise
        print(f"leeway fleet: {exc}", file=sys.stderr)
    for result in stopped:
        print(f"leeway fleet: {result['name']} {result['state']} (exit {result.get('returncode')})")
    if state is not None and state.local_cluster:
        stop_processes([ProcessInfo.from_json(state.local_cluster)], timeout_s=LOCAL_CLUSTER_STOP_S)
        print("leeway fleet: stopped the local Ray cluster")
    if state is not None and state.stack_dir:
        stop_stack(state.stack_dir, timeout_s=3.0)
        print(f"leeway fleet: stopped the embedded stack in {state.stack_dir}")
    if state is not None:
        (run_dir / STATE_FILE).unlink(missing_ok=True)
    return 0


ACTIONS = {
    "up": "start the trainer ranks and generators; returns once every role started",
    "scale": "add or drain generators while the run goes on",
    "status": "each role: node, policy version, last report, restarts",
    "down": "stop every role of the run (and the local cluster and stack `up` started), nothing else",
}
"""`leeway fleet ACTION`: what each does, as its help says."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`leeway fleet`'s description, its actions' flags and the handler."""
    parser.description = (
        "Ray places and restarts the roles (each in its own process, as `leeway trainer` and "
        "`leeway generator`); data goes only through NATS and S3. Every node must reach nats.url and "
        "store.endpoint (a single-node cluster may use the embedded stack)."
    )
    actions = parser.add_subparsers(dest="fleet_command", required=True, metavar="ACTION")
    for action, text in ACTIONS.items():
        action_parser = actions.add_parser(action, help=text, description=text)
        add_config_arguments(action_parser)
        action_parser.add_argument(
            "--address", default=None, help="Ray cluster host:port (default: fleet.address, RAY_ADDRESS, or local)"
        )
        if action == "up":
            action_parser.add_argument("--generators", type=int, default=1, help="generators to start (default 1)")
            action_parser.add_argument("--trainer-ranks", type=int, default=1, help="trainer ranks (default 1)")
            action_parser.add_argument("--wait", action="store_true", help="block until the trainer ends")
        if action == "scale":
            action_parser.add_argument("--generators", type=int, required=True, help="generators to run from now on")
        if action == "status":
            action_parser.add_argument("--json", action="store_true", help="one JSON object")
        action_parser.set_defaults(handler=WithConfig(main))


def require_ray() -> None:
    """`FleetError` naming the extra when Ray is not installed (it is imported only by the fleet's code)."""
    if importlib.util.find_spec("ray") is None:
        raise FleetError("needs Ray, which is not installed here: pip install 'leeway[fleet]'")


def main(cfg: LeewayConfig, args: argparse.Namespace) -> int:
    commands = {"up": cmd_up, "scale": cmd_scale, "status": cmd_status, "down": cmd_down}
    try:
        require_ray()
        return commands[args.fleet_command](cfg, args)
    except FleetError as exc:
        print(f"leeway fleet: {exc}", file=sys.stderr)
        return 1
