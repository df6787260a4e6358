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
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pipeline.config_checks import MAX_STALENESS_LIMIT, SettingConflicts, heartbeat_conflict, window_warning
from pipeline.wire.names import validate_run_name

log = logging.getLogger(__name__)

ENV_PREFIX = "LEEWAY_"
MiB = 1024 * 1024


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


class Section(BaseModel):
    """Base of every section: unknown keys are errors, docstrings under fields are the reference."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class RunConfig(Section):
    name: str = "demo"
    """Run name; derives NATS subjects, stream names and the object-store prefix. Letters, digits, '-', '_'."""
    dir: str | None = None
    """Local directory for metrics, reports and logs. Default: `runs/<name>`."""
    seed: int = 0
    """Seed for prompts, sampling and initialisation."""

    @field_validator("name")
    @classmethod
    def _valid_name(cls, value: str) -> str:
        return validate_run_name(value)

    @property
    def run_dir(self) -> Path:
        return Path(self.dir) if self.dir else Path("runs") / self.name


class NatsConfig(Section):
    url: str | None = None
    """NATS server URL (e.g. nats://host:4222). None: use the embedded stack started by `leeway stack up`."""
    creds_file: str | None = None
    """Path to a NATS credentials file; never put credentials in the URL of a committed config."""
    connect_timeout_s: float = Field(5.0, gt=0)
    """Timeout of one connection attempt."""
    stack_dir: str = ".leeway/stack"
    """Where the embedded stack keeps its data and state file (used when url is None)."""


class StoreConfig(Section):
    url: str = "s3://leeway/"
    """Object store root: `s3://bucket/prefix` or `file:///absolute/path`."""
    endpoint: str | None = None
    """S3 endpoint URL. None with an s3:// url: the embedded stack's gateway if one is up, else AWS's default."""
    region: str = "us-east-1"
    """S3 region."""
    max_concurrency: int = Field(8, ge=1, le=256)
    """Parallel transfers for multipart uploads and ranged downloads."""
    multipart_threshold_bytes: int = Field(64 * MiB, ge=5 * MiB)
    """Objects at least this large upload in parts and download by ranges."""
    part_size_bytes: int = Field(16 * MiB, ge=5 * MiB)
    """Size of one multipart part / ranged GET."""
    max_retries: int = Field(5, ge=0, le=20)
    """Retries (with backoff) on 5xx responses and timeouts."""
    connect_timeout_s: float = Field(5.0, gt=0)
    """Connection timeout of one S3 request."""
    read_timeout_s: float = Field(60.0, gt=0)
    """Read timeout of one S3 request."""


class ModelConfig(Section):
    name_or_path: str = "tiny-llama-2x64"
    """A local HF checkpoint directory, or a built-in tiny preset (random init) such as `tiny-llama-2x64`."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """The dtype the engine serves and the weight store publishes."""
    tokenizer: str | None = None
    """A tokenizer.json or HF tokenizer directory. None: the task's own tokenizer."""


class SamplingConfig(Section):
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; behaviour log-probs are recorded under the tempered distribution."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass (1.0 = off)."""
    top_k: int = Field(0, ge=0)
    """Top-k sampling (0 = off)."""
    max_new_tokens: int = Field(16, ge=1)
    """Length limit of one generated turn."""


class EngineConfig(Section):
    kind: Literal["torch"] = "torch"
    """Inference engine: `torch` (in-process on `engine.device`, its own forward over a slot KV cache:
    `actors/generator/engines/`), the only one built so far."""
    device: str = "cpu"
    """Torch device for the torch engine (`cpu`, `cuda`, `cuda:1`)."""
    torch_threads: int = Field(1, ge=1)
    """torch.set_num_threads for a generator process."""
    max_slots: int = Field(64, ge=1)
    """Sequences the torch engine decodes at once (KV-cache slots); more requests wait for a free slot."""
    max_len: int | None = Field(None, ge=2)
    """Prompt + reply tokens per sequence; the KV cache holds max_slots x max_len positions. None: the
    model's max_position_embeddings, at most 4096. A longer prompt finishes with reason prompt_too_long."""
    cuda_graphs: bool = True
    """Capture the torch engine's decode step in CUDA graphs (CUDA devices only; CPU decodes eagerly)."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """Sampling parameters for every rollout."""


class GeneratorConfig(Section):
    concurrency: int = Field(2, ge=1)
    """Rollouts (each a group of advantages.group_size samples) a generator runs at once."""
    poll_interval_s: float = Field(2.0, gt=0)
    """How often a generator polls LATEST when no KV announcement arrives."""
    update_mode: Literal["in_flight", "between_rollouts"] = "in_flight"
    """Apply new weights between two decode steps of running rollouts, or only between rollouts."""
    verifier_timeout_s: float = Field(10.0, gt=0)
    """A verifier that takes longer yields infra_error with a null reward."""
    heartbeat_s: float = Field(10.0, gt=0)
    """Interval of in-progress acks on held prompts during long rollouts; must be below stream.prompt_ack_wait_s."""
    id: str | None = None
    """Generator id recorded on trajectories. None: hostname-pid."""


class TrainerConfig(Section):
    batch_groups: int = Field(16, ge=1)
    """Trainable groups per optimizer step."""
    max_steps: int = Field(300, ge=1)
    """Stop once this many trainer steps (one batch each) are taken; a resume continues the checkpoint's count,
    a replay counts its own. Not versions: each resume also publishes one, so versions run ahead of steps."""
    lr: float = Field(1e-3, gt=0)
    """AdamW learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    adam_eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    grad_clip: float = Field(1.0, gt=0)
    """Global gradient-norm clip."""
    micro_batch_tokens: int = Field(8192, ge=1)
    """Token budget of one packed micro-batch."""
    minibatches: int = Field(1, ge=1)
    """Optimizer updates per trainer step, each on its share of the batch (decoupled_ppo uses several)."""
    gradient_checkpointing: bool = False
    """Trade compute for memory in the backend."""
    packing: bool = True
    """Concatenate whole sequences into one row per micro-batch (document mask, no padding); false: right-pad.
    Torch backend only: megatron always right-pads."""
    fused_kernels: Literal["auto", "on", "off"] = "auto"
    """liger-kernel RoPE/RMSNorm/SwiGLU (the `gpu` extra). auto: on for CUDA when installed; on: required.
    Torch backend only (`on` is refused under megatron)."""
    lm_head_chunk_tokens: int | None = Field(None, ge=0)
    """Chunked LM head: log-probs from this many tokens' logits at a time. None: 4096 on CUDA, off on CPU; 0: off.
    Torch backend only (a positive value is refused under megatron)."""
    checkpoint_every: int = Field(50, ge=1)
    """Write a resumable checkpoint every this many trainer steps (and at the end of a session)."""
    torch_threads: int = Field(1, ge=1)
    """torch.set_num_threads for the trainer process."""
    device: str = "cpu"
    """Torch device the trainer's backend trains on (`cpu`, `cuda`, `cuda:1`)."""
    backend: Literal["torch", "megatron"] = "torch"
    """Training backend: `torch` (HF model, AdamW, FSDP2 over ranks) or `megatron` (megatron-core, the `megatron` extra)."""
    queue_wait_timeout_s: float = Field(600.0, gt=0)
    """Give up (and say why) when no trainable group arrives for this long."""
    nproc: int = Field(1, ge=1)
    """Trainer ranks `leeway trainer` (and `leeway run`) start on this machine (`--nproc` overrides); 1: one process."""
    dist_timeout_s: float = Field(300.0, gt=0)
    """Collective timeout of the trainer ranks, on top of queue_wait_timeout_s (rank 0 may wait that long for groups)."""


class MegatronConfig(Section):
    """Read only under `trainer.backend: megatron`; a non-default value under `torch` is refused."""

    tensor_parallel_size: int = Field(1, ge=1)
    """Ranks that split each layer (megatron-core TP); must divide the KV heads. Data parallel = world / (TP x PP)."""
    pipeline_parallel_size: int = Field(1, ge=1)
    """Ranks that split the layers into stages (must divide the layers; untied embeddings when > 1)."""
    use_transformer_engine: Literal["auto"] | bool = "auto"
    """Transformer Engine layer spec: auto = on a CUDA device where TE is installed; false = megatron-core's local spec."""


class StalenessConfig(Section):
    max_staleness: int = Field(2, ge=0, le=MAX_STALENESS_LIMIT)
    """K: tokens more than K versions behind the trainer never reach the loss; 0 = synchronous; at most 64."""
    policy: Literal["drop_trajectory", "mask_tokens"] = "drop_trajectory"
    """What happens to tokens over the cap: drop the whole trajectory, or mask only the stale tokens."""
    abort_in_flight: bool = False
    """Abort rollouts that cross the cap mid-way instead of finishing them (the trainer decides)."""
    cap_in_replay: bool = True
    """Apply the cap during replay (staleness counted against the replaying trainer's version)."""


class CorrectionConfig(Section):
    method: Literal["tis", "mis", "decoupled_ppo", "none"] = "tis"
    """Importance correction for off-policy tokens."""
    clip_c: float = Field(2.0, gt=1)
    """C: truncation bound of the importance weight (tis, decoupled_ppo) or mask band [1/C, C] (mis)."""
    level: Literal["token", "sequence"] = "token"
    """Per-token ratios, or one geometric-mean ratio per sequence."""
    ppo_eps_low: float = Field(0.2, gt=0, lt=1)
    """decoupled_ppo: lower clip epsilon."""
    ppo_eps_high: float = Field(0.28, gt=0)
    """decoupled_ppo: upper clip epsilon."""
    staleness_decay: float | None = Field(None, gt=0, le=1)
    """Optional weight gamma**staleness per token; None = off."""


class AdvantagesConfig(Section):
    estimator: Literal["grpo", "rloo"] = "grpo"
    """Group baseline: GRPO (mean of the group's valid samples) or RLOO (leave-one-out)."""
    group_size: int = Field(8, ge=2)
    """Samples per prompt."""
    std_normalize: bool = False
    """Divide advantages by the group's reward std."""
    loss_norm: Literal["constant", "token_mean"] = "constant"
    """Loss divisor: a constant token budget (Dr. GRPO) or the minibatch's loss tokens (MIS-rejected ones included)."""
    constant_tokens: int | None = Field(None, ge=1)
    """Divisor for loss_norm=constant. None: batch_groups * group_size * max_new_tokens."""


class TaskConfig(Section):
    name: str = "reverse_digits"
    """Built-in task name or `module:function` returning a Task."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the task factory (e.g. num_digits)."""
    prompts_file: str | None = None
    """A JSONL or Parquet file of prompts (overrides the task's own prompt source). Checked when the
    trainer loads it: a row over `stream.max_msg_bytes` as a queued prompt, or whose tokens fill the
    model's context, refuses the file with an error naming the row."""


class WeightsConfig(Section):
    full_every: int = Field(50, ge=1)
    """A full snapshot every this many versions (version 0 is always full); deltas in between."""
    keep_versions: int = Field(10, ge=1)
    """Versions kept in the store (plus the chains they need); retention runs every keep_versions/2 publishes."""
    grace_s: float = Field(120.0, ge=0)
    """Never delete a version a reader may still be pulling: younger than LATEST by less than this."""
    part_bytes: int = Field(16 * MiB, ge=1024)
    """Target size of one delta/snapshot part."""
    parallelism: int = Field(4, ge=1)
    """Parallel uploads/downloads and codec threads."""
    announce: bool = True
    """Announce new versions on the NATS KV bucket as well as LATEST."""


class StreamConfig(Section):
    max_age_s: float = Field(7 * 24 * 3600.0, gt=0)
    """Trajectories are kept (for replay) this long."""
    max_bytes: int = Field(10 * 1024 * MiB, ge=MiB)
    """Size limit of the trajectory stream; oldest messages go first."""
    max_inline_bytes: int = Field(1 * MiB, ge=1024)
    """Larger encoded groups go to the object store and the message carries a pointer."""
    max_msg_bytes: int = Field(2 * MiB, ge=1024)
    """Largest message the stream accepts (the embedded server allows 8 MiB); larger groups are claim-checked."""
    fetch_batch: int = Field(16, ge=1)
    """Messages per consumer fetch."""
    fetch_max_bytes: int = Field(16 * MiB, ge=MiB)
    """fetch_batch is lowered so that batch x max message size stays below this."""
    publish_ack_timeout_s: float = Field(5.0, gt=0)
    """Bound on every wait for a publish ack; after it the message is re-published with the same id."""
    publish_retries: int = Field(20, ge=0)
    """Publish attempts before giving up (with backoff, while the server is away)."""
    prompt_ack_wait_s: float = Field(60.0, gt=0)
    """A prompt not acked or heartbeated for this long is redelivered to another generator."""
    prompt_max_deliver: int = Field(5, ge=1)
    """Deliveries of one prompt before it is dead-lettered."""
    replicas: int = Field(1, ge=1, le=5)
    """JetStream replicas (clusters)."""


class LoggingConfig(Section):
    """`<run.dir>/metrics.jsonl`, one object per trainer step, is always written; TensorBoard and W&B get
    the same records."""

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Log level."""
    tensorboard: bool = False
    """Also write TensorBoard scalars under `<run.dir>/tb` (needs the tensorboard package)."""
    wandb_project: str | None = None
    """Also log to this W&B project (needs wandb and its credentials in the environment)."""


class FleetConfig(Section):
    address: str | None = None
    """Ray cluster (host:port) of `leeway fleet`; `--address` beats it. None: RAY_ADDRESS, else a local cluster."""
    max_restarts: int = Field(3, ge=0)
    """How often Ray restarts a role whose process died (a generator; the trainer with trainer_restart: resume)."""
    trainer_restart: Literal["stop", "resume"] = "stop"
    """When the trainer dies: stop the fleet's generators, or restart it with `--resume` (up to max_restarts)."""


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
    staleness: StalenessConfig = Field(default_factory=StalenessConfig)
    correction: CorrectionConfig = Field(default_factory=CorrectionConfig)
    advantages: AdvantagesConfig = Field(default_factory=AdvantagesConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    stream: StreamConfig = Field(default_factory=StreamConfig)
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
        if warning := window_warning(self.staleness.max_staleness, t.batch_groups, st.max_inline_bytes, st.max_bytes):
            log.warning("%s", warning)
        return self

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
