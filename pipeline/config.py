"""Leeway's configuration: one pydantic model per section of a run's YAML file.

Every process of a run (trainer, generators, `leeway run`, replay, benchmarks) loads the same file,
so the models here are the contract between processes launched independently. Loading order and
precedence: the YAML file, then `LEEWAY_<SECTION>__<KEY>=value` environment variables, then
`--set section.key=value` flags, each overriding the one before.

Values that name parts which are planned but not built (`UNBUILT_VALUES`, `UNBUILT_KEYS`) fail at load
time with a message that says so and names what exists instead, rather than at start-up of a role; so do
keys that were removed (`REMOVED_KEYS`), with the reason. Settings the chosen `trainer.backend` never
reads are checked at load too (`backend_conflicts`): refused where ignoring them would give the user
something other than what the value asks for, logged as a warning where it would not.

This module must import without torch or transformers: the CLI parses and validates a config before it
decides which heavy pieces to load.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from pipeline.config_checks import (
    SettingConflicts,
    heartbeat_conflict,
    lease_conflict,
    stop_grace_conflict,
    window_warning,
)
from pipeline.config_sections import (
    AdvantagesConfig,
    CorrectionConfig,
    EngineConfig,
    EvalConfig,
    FleetConfig,
    GeneratorConfig,
    LoggingConfig,
    MegatronConfig,
    ModelConfig,
    MoeConfig,
    NatsConfig,
    OutageConfig,
    RolloutConfig,
    RunConfig,
    SandboxConfig,
    Section,
    SftConfig,
    StalenessConfig,
    StoreConfig,
    StreamConfig,
    TaskConfig,
    TrainerConfig,
    WeightsConfig,
)

log = logging.getLogger(__name__)

ENV_PREFIX = "LEEWAY_"
STOP_GRACE_MARGIN_S = 30.0
"""Added to `outages.final_checkpoint_s` for the default stop grace: the step in flight and the exit itself."""


class ConfigError(ValueError):
    """A config file, override or value that cannot be used; the message names file, key and value."""


UNBUILT_VALUES: dict[tuple[str, Any], str] = {
    ("engine.kind", "sglang"): "the engine that exists is 'torch' (set engine.device: cuda for a GPU)",
}
"""(dotted key, value) that selects a planned part that has not landed -> what exists instead."""

UNBUILT_KEYS: dict[str, str] = {
    "engine.sglang_url": "there is no SGLang engine to point at; remove the key (the torch engine runs in-process)",
}
"""Dotted keys of planned parts that have not landed -> what to do instead; any value is rejected."""

REMOVED_KEYS: dict[str, str] = {
    "logging.metrics_jsonl": (
        "`<run.dir>/metrics.jsonl` is always written: the live view of `leeway run`, `leeway fleet status`, "
        "the roll-back of `--resume` and the guard against reusing a run directory all read it; remove the key"
    ),
}
"""Dotted keys that no longer exist -> why, and what to do; any value is rejected (not as an unknown key,
which would read as a typo)."""


class BackendConflicts(ValueError):
    """Settings the chosen `trainer.backend` would ignore although their value asks for something.

    `conflicts` holds (dotted key, value, why) per setting, so that `build_config` can report each
    on its own line with the override that set it.
    """

    def __init__(self, conflicts: list[tuple[str, Any, str]]) -> None:
        self.conflicts = conflicts
        super().__init__("; ".join(f"{key} = {value!r}: {why}" for key, value, why in conflicts))


class LeewayConfig(Section):
    """The whole resolved config of one run."""

    run: RunConfig = Field(default_factory=RunConfig)
    nats: NatsConfig = Field(default_factory=NatsConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    generator: GeneratorConfig = Field(default_factory=GeneratorConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    moe: MoeConfig = Field(default_factory=MoeConfig)
    staleness: StalenessConfig = Field(default_factory=StalenessConfig)
    correction: CorrectionConfig = Field(default_factory=CorrectionConfig)
    advantages: AdvantagesConfig = Field(default_factory=AdvantagesConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    sft: SftConfig = Field(default_factory=SftConfig)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    stream: StreamConfig = Field(default_factory=StreamConfig)
    outages: OutageConfig = Field(default_factory=OutageConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    fleet: FleetConfig = Field(default_factory=FleetConfig)

    @model_validator(mode="after")
    def _backend_reads_its_settings(self) -> LeewayConfig:
        """Refuse what `trainer.backend` would ignore against the user's intent; warn about the rest."""
        refused, ignored = backend_conflicts(self)
        if refused:
            raise BackendConflicts(refused)
        for key, value, why in ignored:
            log.warning("%s = %r has no effect: %s", key, value, why)
        return self

    @model_validator(mode="after")
    def _cross_checks(self) -> LeewayConfig:
        """Settings of several sections (`pipeline/config_checks.py`): refuse a contradiction, warn on a risk."""
        t, st = self.trainer, self.stream
        if conflict := heartbeat_conflict(self.generator.heartbeat_s, st.prompt_ack_wait_s):
            raise SettingConflicts([conflict])
        if conflict := stop_grace_conflict(self.run.stop_grace_s, self.outages.final_checkpoint_s):
            raise SettingConflicts([conflict])
        if conflict := lease_conflict(t.lease_heartbeat_s, t.lease_ttl_s):
            raise SettingConflicts([conflict])
        if warning := window_warning(self.staleness.max_staleness, t.batch_groups, st.max_inline_bytes, st.max_bytes):
            log.warning("%s", warning)
        return self

    @property
    def stop_grace_s(self) -> float:
        """SIGTERM-to-SIGKILL grace of the roles: `run.stop_grace_s`, or the final checkpoint's budget + 30 s."""
        if self.run.stop_grace_s is not None:
            return self.run.stop_grace_s
        return self.outages.final_checkpoint_s + STOP_GRACE_MARGIN_S

    @property
    def uses_embedded_stack(self) -> bool:
        """True unless the config names external servers for both NATS and S3."""
        external_store = self.store.url.startswith("file://") or self.store.endpoint is not None
        return not (self.nats.url is not None and external_store)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def backend_conflicts(config: LeewayConfig) -> tuple[list[tuple[str, Any, str]], list[tuple[str, Any, str]]]:
    """(refused, ignored): settings `config.trainer.backend` never reads, as (dotted key, value, why).

    Refused: the value asks for something the backend will not do (liger kernels required, a bounded
    LM-head memory, tensor or pipeline parallelism). Ignored: a non-default value whose absence changes
    nothing the user asked for (the backend does that anyway, or the setting only trades speed and
    memory for the same numbers). Default values are never reported: `to_yaml` writes every key, and
    the roles `leeway run` starts load that file.
    """
    refused: list[tuple[str, Any, str]] = []
    ignored: list[tuple[str, Any, str]] = []
    trainer = config.trainer
    if trainer.backend == "megatron":
        if trainer.fused_kernels == "on":
            refused.append(
                (
                    "trainer.fused_kernels",
                    "on",
                    "trainer.backend 'megatron' never applies liger kernels, and 'on' asks to fail without them; "
                    "set auto or off",
                )
            )
        elif trainer.fused_kernels == "off":
            ignored.append(("trainer.fused_kernels", "off", "trainer.backend 'megatron' applies no liger kernels"))
        if trainer.lm_head_chunk_tokens:
            refused.append(
                (
                    "trainer.lm_head_chunk_tokens",
                    trainer.lm_head_chunk_tokens,
                    "trainer.backend 'megatron' computes the vocabulary-parallel logits of a micro-batch whole, "
                    "so the LM-head memory would not be bounded; set 0 or null (or lower trainer.micro_batch_tokens)",
                )
            )
        elif trainer.lm_head_chunk_tokens == 0:
            ignored.append(("trainer.lm_head_chunk_tokens", 0, "trainer.backend 'megatron' never chunks the LM head"))
        if not trainer.packing:
            ignored.append(("trainer.packing", False, "trainer.backend 'megatron' always right-pads micro-batches"))
    else:
        defaults = MegatronConfig()
        for name in MegatronConfig.model_fields:
            value = getattr(config.megatron, name)
            if value != getattr(defaults, name):
                refused.append(
                    (
                        f"megatron.{name}",
                        value,
                        f"trainer.backend {trainer.backend!r} has no megatron-core parallelism or layer spec; "
                        "set trainer.backend: megatron, or remove the key",
                    )
                )
    return refused, ignored


def _parse_scalar(text: str) -> Any:
    """Parse an override value the way YAML would (`3`, `1e-3`, `true`, `null`, `[1, 2]`)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any, origin: str) -> None:
    parts = dotted.split(".")
    if not dotted or any(not p for p in parts):
        raise ConfigError(f"{origin}: bad key {dotted!r}; expected section.key such as trainer.lr")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{origin}: {dotted!r} goes through {part!r}, which is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_set_overrides(items: Iterable[str]) -> list[tuple[str, Any]]:
    """`["trainer.lr=1e-4"]` -> `[("trainer.lr", 0.0001)]`; a malformed item raises ConfigError."""
    out = []
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE such as trainer.lr=1e-4")
        out.append((key.strip(), _parse_scalar(raw)))
    return out


def env_overrides(environ: Mapping[str, str]) -> list[tuple[str, Any]]:
    """`LEEWAY_TRAINER__LR=1e-4` -> `("trainer.lr", 0.0001)`. Only variables with a `__` are config keys."""
    out = []
    for name, raw in sorted(environ.items()):
        if name.startswith(ENV_PREFIX) and "__" in name:
            dotted = name[len(ENV_PREFIX) :].lower().replace("__", ".")
            out.append((dotted, _parse_scalar(raw)))
    return out


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level, got {type(data).__name__}")
    return data


def _source(key: str, sources: Mapping[str, str]) -> str:
    """` (from --set trainer.lr)` when an override set `key` (or a section above it), else `` (the file)."""
    return next((f" (from {src})" for dotted, src in sources.items() if f"{key}.".startswith(f"{dotted}.")), "")


def _describe(error: Mapping[str, Any], sources: Mapping[str, str]) -> str:
    cause = (error.get("ctx") or {}).get("error")
    # a check across sections: one line per key, each with its source
    if isinstance(cause, (BackendConflicts, SettingConflicts)):
        return "\n  ".join(f"{k} = {v!r}: {why}{_source(k, sources)}" for k, v, why in cause.conflicts)
    key = ".".join(str(p) for p in error["loc"])
    source = _source(key, sources)
    if error["type"] == "extra_forbidden":
        return f"{key}: unknown key{source}"
    message = str(error["msg"]).removeprefix("Value error, ")
    if not key:
        return f"{message}{source}"
    return f"{key} = {error.get('input')!r}: {message}{source}"


def _lookup(tree: Mapping[str, Any], dotted: str) -> tuple[bool, Any]:
    """(True, value) when the tree holds `dotted`, else (False, None)."""
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _unbuilt_errors(tree: Mapping[str, Any], sources: Mapping[str, str]) -> list[str]:
    """One line per key of `tree` that selects a part which is not built yet (see `UNBUILT_VALUES`) or
    that was removed (`REMOVED_KEYS`)."""
    lines = []
    for (dotted, value), instead in UNBUILT_VALUES.items():
        present, found = _lookup(tree, dotted)
        if present and found == value:
            lines.append(f"{dotted} = {value!r}: not built yet; {instead}{_source(dotted, sources)}")
    for dotted, instead in UNBUILT_KEYS.items():
        present, found = _lookup(tree, dotted)
        if present:
            lines.append(f"{dotted} = {found!r}: not built yet; {instead}{_source(dotted, sources)}")
    for dotted, why in REMOVED_KEYS.items():
        present, found = _lookup(tree, dotted)
        if present:
            lines.append(f"{dotted} = {found!r}: removed; {why}{_source(dotted, sources)}")
    return lines


def build_config(
    tree: dict[str, Any], origin: str = "<config>", sources: Mapping[str, str] | None = None
) -> LeewayConfig:
    """Validate a config tree; `sources` maps overridden dotted keys to where they came from, for errors.

    Unbuilt parts and removed keys are reported before anything else: their keys would otherwise read as
    typos.
    """
    unbuilt = _unbuilt_errors(tree, sources or {})
    if unbuilt:
        raise ConfigError(f"{origin}: invalid config:\n  " + "\n  ".join(unbuilt))
    try:
        return LeewayConfig.model_validate(tree)
    except ValidationError as exc:
        lines = "\n  ".join(_describe(e, sources or {}) for e in exc.errors())
        raise ConfigError(f"{origin}: invalid config:\n  {lines}") from None


def load_config(
    path: str | Path | None,
    overrides: Iterable[str] = (),
    environ: Mapping[str, str] | None = None,
) -> LeewayConfig:
    """Load a YAML config (or the defaults when path is None) with env and `--set` overrides applied.

    Errors name the file (or `--set` / the env variable), the dotted key, the value and what was expected.
    """
    origin = str(path) if path is not None else "<defaults>"
    tree = _read_yaml(Path(path)) if path is not None else {}
    env = os.environ if environ is None else environ
    sources: dict[str, str] = {}
    for dotted, value in env_overrides(env):
        sources[dotted] = f"environment variable {ENV_PREFIX}{dotted.upper().replace('.', '__')}"
        _set_dotted(tree, dotted, value, sources[dotted])
    for dotted, value in parse_set_overrides(overrides):
        sources[dotted] = f"--set {dotted}"
        _set_dotted(tree, dotted, value, sources[dotted])
    return build_config(tree, origin, sources)
