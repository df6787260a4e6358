"""The shipped deployment files (`infra/Dockerfile`, `infra/docker-compose.yaml`, `infra/k8s/`) parse, and every
`leeway` command line and `LEEWAY_*` config key they use exists (checked with the real CLI parser and config
loader). No Docker or Kubernetes is needed: this guards the files against drifting from the code."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from actors.cli import build_parser
from pipeline.config import ENV_PREFIX, load_config

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"
PLACEHOLDER = "placeholder"
"""What a value taken from the environment or a Secret stands for in these checks."""


def _check_leeway_argv(argv: list[str], where: str) -> None:
    """argv after `leeway`: it parses, and its config file exists in the image (the repo) and loads."""
    try:
        args = build_parser(argv).parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: `leeway {' '.join(argv)}` is not a valid leeway command line")
    config = getattr(args, "config", None)
    if config is not None:
        assert (REPO / config).is_file(), f"{where}: config {config} is not in the repository (the image)"


def _check_env(env: dict[str, str], config: str | None, where: str) -> None:
    """Every LEEWAY_SECTION__KEY names a config key that accepts the value (placeholders for secrets)."""
    leeway_env = {k: v for k, v in env.items() if k.startswith(ENV_PREFIX) and "__" in k}
    load_config(str(REPO / config) if config else None, [], environ=leeway_env)  # raises naming the key
    assert leeway_env or config is None, f"{where}: no LEEWAY_* settings"


def _interpolate(value: str) -> str:
    """Compose `${VAR:?msg}` / `${VAR:-default}` / `$$`, and Kubernetes `$(VAR)`, with placeholders."""
    value = re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*:-([^}]*)\}", r"\1", value)
    value = re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*(:\?[^}]*)?\}", PLACEHOLDER, value)
    return re.sub(r"\$\([A-Za-z_][A-Za-z0-9_]*\)", PLACEHOLDER, value)


# ------------------------------------------------------------------------------------------ Dockerfile


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = pending + line
        pending = ""
        instruction, _, arguments = full.partition(" ")
        out.append((instruction.upper(), arguments.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


def test_dockerfile_builds_cpu_by_default_and_cuda_by_argument() -> None:
    instructions = dockerfile_instructions((INFRA / "Dockerfile").read_text())
    known = {"ARG", "FROM", "RUN", "ENV", "WORKDIR", "COPY", "USER", "ENTRYPOINT", "CMD"}
    assert {i for i, _ in instructions} <= known, instructions
    stages = {args.split()[-1] for i, args in instructions if i == "FROM" and " AS " in args}
    assert {"base-cpu", "base-cuda"} <= stages
    assert ("ARG", "BASE=cpu") in instructions
    assert any(i == "FROM" and args.startswith("base-${BASE}") for i, args in instructions)
    for instruction, args in instructions:
        if instruction == "COPY":
            for source in args.split()[:-1]:
                assert (REPO / source).exists(), f"COPY {source}: not in the repository"
    entrypoint = next(args for i, args in instructions if i == "ENTRYPOINT")
    assert yaml.safe_load(entrypoint) == ["leeway"]
    assert yaml.safe_load(next(args for i, args in instructions if i == "CMD")) == ["--help"]
    env = dict(
        item.split("=", 1) for i, args in instructions if i == "ENV" for item in shlex.split(args) if "=" in item
    )
    _check_env(env, None, "Dockerfile ENV")
    assert not any("SECRET" in k or "TOKEN" in k for k in env), "credentials baked into the image"


# -------------------------------------------------------------------------------------------- compose


def test_compose_runs_nats_s3_a_trainer_and_scalable_generators() -> None:
    compose = yaml.safe_load((INFRA / "docker-compose.yaml").read_text())
    services: dict[str, Any] = compose["services"]
    assert "--jetstream" in services["nats"]["command"]
    roles = {name: s for name, s in services.items() if s.get("image", "").startswith("leeway")}
    assert {name: s["command"][0] for name, s in roles.items()} == {"trainer": "trainer", "generator": "generator"}
    assert services["generator"]["deploy"]["replicas"] == "${LEEWAY_GENERATORS:-2}"
    for name, service in roles.items():
        assert service["build"]["dockerfile"] == "infra/Dockerfile"
        assert (INFRA / service["build"]["context"] / service["build"]["dockerfile"]).is_file()
        _check_leeway_argv(service["command"], f"compose service {name}")
        env = {k: _interpolate(str(v)) for k, v in service["environment"].items()}
        _check_env(env, service["command"][1], f"compose service {name}")
        for key in ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID"):
            assert str(service["environment"][key]).startswith("${"), f"{name}: {key} must come from the environment"
        endpoint = service["environment"]["LEEWAY_STORE__ENDPOINT"]
        assert endpoint.split("//")[1].split(":")[0] in services, f"{name}: {endpoint} is no service"
        assert "@nats:4222" in service["environment"]["LEEWAY_NATS__URL"]


# ----------------------------------------------------------------------------------------- kubernetes


def _k8s_documents() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in sorted((INFRA / "k8s").glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                yield path.name, document


def _containers(document: dict[str, Any]) -> list[dict[str, Any]]:
    spec = document.get("spec", {})
    return spec.get("template", {}).get("spec", {}).get("containers", [])


def test_kubernetes_manifests_use_real_commands_and_keys() -> None:
    documents = list(_k8s_documents())
    kustomization = yaml.safe_load((INFRA / "k8s" / "kustomization.yaml").read_text())
    assert all((INFRA / "k8s" / r).is_file() for r in kustomization["resources"])
    by_kind: dict[str, dict[str, dict[str, Any]]] = {}
    for _, document in documents:
        by_kind.setdefault(document["kind"], {})[document["metadata"]["name"]] = document
    assert by_kind["Job"]["leeway-trainer"]["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"
    assert by_kind["Deployment"]["leeway-generator"]["spec"]["replicas"] >= 1
    services = by_kind["Service"]
    assert {"leeway-nats", "leeway-s3"} <= set(services)
    workloads = [d for kind in ("StatefulSet", "Deployment", "Job") for d in by_kind.get(kind, {}).values()]
    for name, service in services.items():
        selector = service["spec"]["selector"]
        assert any(
            selector.items() <= w["spec"]["template"]["metadata"].get("labels", {}).items() for w in workloads
        ), f"Service {name} selects no pod"
    checked = 0
    for file_name, document in documents:
        for container in _containers(document):
            if not container["image"].startswith("leeway"):
                continue
            where = f"{file_name}: {document['metadata']['name']}"
            _check_leeway_argv(container["args"], where)
            env = {e["name"]: _interpolate(str(e.get("value", PLACEHOLDER))) for e in container.get("env", [])}
            _check_env(env, container["args"][1], where)
            for key in ("LEEWAY_NATS__URL", "LEEWAY_STORE__ENDPOINT"):
                host = env[key].split("@")[-1].split("//")[-1].split(":")[0]
                assert host in services, f"{where}: {key} names {host}, which is no Service"
            secrets = [s["secretRef"]["name"] for s in container.get("envFrom", [])]
            assert secrets == ["leeway-credentials"], f"{where}: credentials must come from the Secret"
            checked += 1
    assert checked == 2, "the trainer and the generators"
