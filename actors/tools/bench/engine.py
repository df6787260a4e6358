"""`leeway bench engine`: a Leeway engine against Hugging Face `generate` (and, for vLLM, against plain vLLM), same
model, prompts and lengths.

    config (--config, --model, --device, --dtype, --engine torch|vllm, --set)
      ├─► build_engine (as a generator builds it), the model's weights loaded as version 0
      │       ─► Engine.generate(requests, params); Engine.update_weights (a version applied, timed)
      ├─► build_policy_model (same spec and seed: the same weights)
      │       ├─► HF generate, dynamic cache
      │       └─► HF generate, cache_implementation="static" (compiled by transformers; CUDA only)
      └─► --engine vllm: plain vLLM, ``LLM.generate`` on the same token prompts and sampling (what Leeway's
          guarantees are measured against: ``engine_vs_vllm`` should be >= 0.9)

    warm-up: one call of each contender (two for the compiled one), then timed rounds; each round times
    every contender once, in turn, so load from other processes hits them alike. Rounds: --repeats, or
    by default at least MIN_ROUNDS and MIN_MEASURED_S of timed calls (tiny CPU calls take milliseconds).

Every contender decodes the same ``requests`` random prompts of ``prompt_tokens`` ids (seeded RNG, all
the same length, so nobody pads) for exactly ``new_tokens`` tokens: stop tokens are switched off, and
the tokens each call really produced are counted. ``update_ms`` is the median time of `Engine.update_weights` with
every tensor of the model (what a generator does with each pulled version: for vLLM, staging and the workers'
checked reload). Sampling is the config's (temperature, top-k, top-p;
HF's default top-k of 50 is switched off unless the config sets one). A rate is produced tokens over the
wall time of the whole call (prefill included), the median over rounds. ``ttft_ms`` is the engine's time
to first token: one call with a budget of one token for the whole batch (prefill and the first sample),
median over rounds. ``params`` counts the model's parameters. The headline numbers are ratios measured
in the same run (`engine_vs_hf`, and `engine_vs_hf_static` on CUDA; null where a baseline did not run).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from actors.cli_args import add_set_argument, positive_int

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedModel

    from actors.generator.engines.base import Engine
    from pipeline.config import LeewayConfig
    from pipeline.tasks import Task

DEFAULT_CONFIG = "configs/demo.yaml"
CUDA_DTYPE = "bfloat16"
"""Weights dtype on CUDA unless --dtype says otherwise (the GPU baselines of issue 11 are bf16)."""
MIN_ROUNDS = 5
MIN_MEASURED_S = 5.0
"""Default rounds: at least MIN_ROUNDS, and more until the timed calls add up to this many seconds."""
MAX_ROUNDS = 500
STATIC_WARMUPS = 2
"""Warm-up calls of the compiled static-cache baseline: the first compiles, the second records its graphs."""
PROMPT_SEED = 1234
ENGINE_ID = "bench-engine"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default=DEFAULT_CONFIG,
        help="config the engine is built from, and the source of every default below (default: the CPU demo)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="model spec: a preset such as tiny-llama-4x256, the GPU shape llama-1.4b, or a local checkpoint "
        "directory (default: the config's model.name_or_path, the demo's tiny-gpt2-2x64)",
    )
    parser.add_argument(
        "--device", default=None, help="torch device of both contenders, e.g. cpu or cuda (default: engine.device)"
    )
    parser.add_argument(
        "--dtype",
        default=None,
        help=f"weights dtype, e.g. float32 or bfloat16 (default: {CUDA_DTYPE} on CUDA, else the config's model.dtype)",
    )
    parser.add_argument(
        "--requests",
        type=positive_int,
        default=None,
        help="sequences decoded together in one call (default: the demo's batch, "
        "generator.concurrency x advantages.group_size)",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=positive_int,
        default=None,
        help="random prompt ids per request (default: the length of the task's first prompt, <bos> included)",
    )
    parser.add_argument(
        "--new-tokens",
        type=positive_int,
        default=None,
        help="tokens every request generates; stop tokens are off (default: engine.sampling.max_new_tokens)",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=None,
        help=f"timed rounds, rates and TTFT are medians over them (default: at least {MIN_ROUNDS}, and more until "
        f"{MIN_MEASURED_S:g} s of calls were timed)",
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch CPU threads for both contenders (default: the config's engine.torch_threads)",
    )
    parser.add_argument(
        "--engine",
        choices=("torch", "vllm"),
        default=None,
        help="the engine measured (default: the config's engine.kind); vllm adds plain vLLM as a baseline",
    )
    parser.add_argument("--seed", type=int, default=PROMPT_SEED, help="seed of the random prompts")
    add_set_argument(parser, help="config override, e.g. --set engine.sampling.top_k=20 (repeatable)")


@dataclass(frozen=True)
class Workload:
    """What every contender decodes: ``prompts`` is ``[requests, prompt_tokens]`` int64."""

    prompts: np.ndarray
    new_tokens: int
    temperature: float
    top_k: int
    top_p: float

    @property
    def num_requests(self) -> int:
        return int(self.prompts.shape[0])

    @property
    def prompt_tokens(self) -> int:
        return int(self.prompts.shape[1])


@dataclass(frozen=True)
class Measurement:
    """One timed call: wall seconds and the tokens it really produced (all rows together)."""

    seconds: float
    tokens: int


def random_prompts(
    num_requests: int, prompt_tokens: int, vocab_size: int, seed: int, *, pad_token_id: int
) -> np.ndarray:
    """Prompt ids drawn uniformly from the vocabulary by a seeded RNG: the same for every contender and run.

    The pad id is replaced by its neighbour, so no prompt looks padded (HF warns about those, and a model
    may treat them specially)."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, vocab_size, size=(num_requests, prompt_tokens), dtype=np.int64)
    prompts[prompts == pad_token_id] = (pad_token_id + 1) % vocab_size
    return prompts


def tokens_per_s(measurements: list[Measurement]) -> float:
    """Median over rounds of produced tokens per wall second."""
    return statistics.median(m.tokens / m.seconds for m in measurements)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def enough_rounds(rounds: int, measured_s: float, repeats: int | None) -> bool:
    """``repeats`` rounds when given; else at least MIN_ROUNDS and MIN_MEASURED_S timed (MAX_ROUNDS at most)."""
    if repeats is not None:
        return rounds >= repeats
    return rounds >= MAX_ROUNDS or (rounds >= MIN_ROUNDS and measured_s >= MIN_MEASURED_S)


def timed(call: Callable[[], int], device: torch.device) -> Measurement:
    """Time `call` (which returns the tokens it produced) to the moment its device work is done."""
    _synchronize(device)
    started = time.perf_counter()
    tokens = call()
    _synchronize(device)
    return Measurement(time.perf_counter() - started, tokens)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------- contenders


def engine_call(engine: Engine, workload: Workload, *, new_tokens: int | None = None) -> Callable[[], int]:
    """One `Engine.generate` of the whole workload (no stop tokens); returns the tokens produced."""
    from actors.generator.engines.base import GenerateRequest, SamplingParams

    params = SamplingParams(
        max_new_tokens=new_tokens or workload.new_tokens,
        temperature=workload.temperature,
        top_k=workload.top_k,
        top_p=workload.top_p,
        stop_token_ids=(),
    )
    requests = [
        GenerateRequest(input_ids=row, seed=index, request_id=f"bench-{index}")
        for index, row in enumerate(workload.prompts)
    ]

    def call() -> int:
        return sum(len(result.token_ids) for result in engine.generate(requests, params))

    return call


def hf_call(model: PreTrainedModel, workload: Workload, *, pad_token_id: int, static: bool) -> Callable[[], int]:
    """One HF `generate` of the whole workload with EOS switched off; returns the tokens produced.

    Without an EOS id no row stops early and nothing is padded, so the new columns are all real tokens.
    """
    from transformers import GenerationConfig

    model.generation_config.eos_token_id = None
    # HF warns "input_ids may be padded" whenever a sampled token equals config.pad_token_id; nothing is padded
    model.config.pad_token_id = None
    config = GenerationConfig(
        do_sample=workload.temperature > 0,
        temperature=workload.temperature if workload.temperature > 0 else None,
        top_k=workload.top_k,
        top_p=workload.top_p,
        max_new_tokens=workload.new_tokens,
        eos_token_id=None,
        pad_token_id=pad_token_id,
        cache_implementation="static" if static else None,
    )
    device = next(model.parameters()).device
    input_ids = torch.as_tensor(workload.prompts, device=device)
    attention_mask = torch.ones_like(input_ids)

    def call() -> int:
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
        return int(out.shape[0]) * (int(out.shape[1]) - workload.prompt_tokens)

    return call


# --------------------------------------------------------------------------------------------- run


def _progress(message: str) -> None:
    print(f"[bench engine] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Setup:
    """The resolved config (flags applied as overrides), its task and tokenizer, and where to run."""

    cfg: LeewayConfig
    task: Task
    tokenizer: Tokenizer
    device: torch.device
    overrides: tuple[str, ...]
    """What `cfg` was loaded with on top of the config file (the user's --set, then the flags')."""


def load_setup(args: argparse.Namespace) -> Setup:
    from actors.models import load_tokenizer
    from pipeline.config import load_config
    from pipeline.tasks import task_for

    base = load_config(args.config, args.overrides)
    device_name = args.device or base.engine.device
    device = torch.device(device_name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device_name}: torch sees no CUDA device here")
    dtype = args.dtype or (CUDA_DTYPE if device.type == "cuda" else base.model.dtype)
    if not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ValueError(f"--dtype {dtype!r} is not a torch dtype (e.g. float32, bfloat16)")
    overrides = [*args.overrides, f"engine.device={device_name}", f"model.dtype={dtype}"]
    if args.engine is not None:
        overrides.append(f"engine.kind={args.engine}")
    if args.model is not None:
        overrides.append(f"model.name_or_path={args.model}")
    cfg = load_config(args.config, overrides)
    task = task_for(cfg)
    return Setup(cfg, task, load_tokenizer(cfg, task), device, tuple(overrides))


def engine_config(args: argparse.Namespace, setup: Setup, workload: Workload) -> LeewayConfig:
    """The config the engine is built from: its KV cache sized to the workload, as HF's static cache is.

    ``engine.max_slots`` becomes the number of requests (all decode at once, as in HF) and
    ``engine.max_len`` prompt plus new tokens, unless the config file or --set fixed them.
    """
    from pipeline.config import load_config

    fields, fixed = type(setup.cfg.engine).model_fields, setup.cfg.engine.model_fields_set
    sizes = {"max_slots": workload.num_requests, "max_len": workload.prompt_tokens + workload.new_tokens}
    extra = [f"engine.{key}={value}" for key, value in sizes.items() if key in fields and key not in fixed]
    return load_config(args.config, [*setup.overrides, *extra]) if extra else setup.cfg


def make_workload(args: argparse.Namespace, setup: Setup, *, vocab_size: int, pad_token_id: int) -> Workload:
    """The flags' sizes, or the demo's: its batch, its first prompt's length, its reply budget."""
    from pipeline.rl.prompt_ids import prompt_token_ids

    cfg = setup.cfg
    prompt_tokens = args.prompt_tokens or len(prompt_token_ids(next(iter(setup.task.prompts())), setup.tokenizer))
    num_requests = args.requests or cfg.generator.concurrency * cfg.advantages.group_size
    sampling = cfg.engine.sampling
    return Workload(
        prompts=random_prompts(num_requests, prompt_tokens, vocab_size, args.seed, pad_token_id=pad_token_id),
        new_tokens=args.new_tokens or sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    from actors.generator.runtime import build_engine
    from actors.models import build_policy_model, pad_token_id

    setup = load_setup(args)
    cfg, device = setup.cfg, setup.device
    torch.set_num_threads(args.threads or cfg.engine.torch_threads)
    _progress(f"building {cfg.model.name_or_path} ({cfg.model.dtype}) on {device} twice: HF model and engine")
    model = build_policy_model(cfg, setup.tokenizer, dtype=getattr(torch, cfg.model.dtype)).to(device)
    pad = pad_token_id(setup.tokenizer)
    vocab_size = int(model.get_input_embeddings().weight.shape[0])
    workload = make_workload(args, setup, vocab_size=vocab_size, pad_token_id=pad)
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions is not None and workload.prompt_tokens + workload.new_tokens > positions:
        raise ValueError(
            f"--prompt-tokens {workload.prompt_tokens} + --new-tokens {workload.new_tokens} exceed the "
            f"{positions} positions of model {cfg.model.name_or_path!r}"
        )
    built = engine_config(args, setup, workload)
    engine = build_engine(built, setup.tokenizer, ENGINE_ID)
    plain = None
    try:
        state = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in model.state_dict().items()}
        engine.load_state(state, 0)
        contenders: dict[str, tuple[Callable[[], int], int]] = {
            "engine": (engine_call(engine, workload), 1),
            "hf_generate": (hf_call(model, workload, pad_token_id=pad, static=False), 1),
        }
        if device.type == "cuda":
            contenders["hf_static"] = (hf_call(model, workload, pad_token_id=pad, static=True), STATIC_WARMUPS)
        if built.engine.kind == "vllm":
            _progress("starting plain vLLM (LLM) on the same model")
            plain = plain_vllm(built, setup.tokenizer)
            contenders["vllm_plain"] = (plain_vllm_call(plain, workload), 1)
        rates, ttft_s = measure(contenders, engine_call(engine, workload, new_tokens=1), device, args.repeats, workload)
        update_ms = 1000.0 * update_seconds(engine, state)
    finally:
        engine.close()
        if plain is not None:
            plain.llm_engine.engine_core.shutdown()
    return {
        "engine": built.engine.kind,
        "device": str(device),
        "model": cfg.model.name_or_path,
        "params": sum(p.numel() for p in model.parameters()),
        "requests": workload.num_requests,
        "prompt_tokens": workload.prompt_tokens,
        "new_tokens": workload.new_tokens,
        "engine_tokens_per_s": rates["engine"],
        "hf_generate_tokens_per_s": rates["hf_generate"],
        "hf_static_tokens_per_s": rates.get("hf_static"),
        "engine_vs_hf": ratio(rates["engine"], rates["hf_generate"]),
        "engine_vs_hf_static": ratio(rates["engine"], rates.get("hf_static")),
        "vllm_plain_tokens_per_s": rates.get("vllm_plain"),
        "engine_vs_vllm": ratio(rates["engine"], rates.get("vllm_plain")),
        "ttft_ms": 1000.0 * ttft_s,
        "update_ms": update_ms,
    }


UPDATE_ROUNDS = 3


def update_seconds(engine: Engine, state: dict[str, torch.Tensor]) -> float:
    """Median wall time of applying a new version holding every tensor (versions 1, 2, ...)."""
    times = []
    for version in range(1, UPDATE_ROUNDS + 1):
        started = time.perf_counter()
        engine.update_weights(state, version)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def plain_vllm(cfg: LeewayConfig, tokenizer: Tokenizer) -> Any:
    """vLLM's own offline ``LLM`` on the same model shape and settings, random weights (rates do not depend on
    their values: stop tokens are off)."""
    import tempfile
    from pathlib import Path

    from vllm import LLM

    from actors.models import checkpoint_dir, write_model_config

    model_dir = checkpoint_dir(cfg)
    if model_dir is None:
        model_dir = Path(tempfile.mkdtemp(prefix="leeway-bench-vllm-"))
        write_model_config(cfg, tokenizer, model_dir)
    v = cfg.engine.vllm
    return LLM(
        model=str(model_dir),
        dtype=cfg.model.dtype,
        load_format="dummy",
        skip_tokenizer_init=True,
        trust_remote_code=False,
        max_model_len=cfg.engine.max_len,
        max_num_seqs=v.max_num_seqs or cfg.engine.max_slots,
        enforce_eager=v.enforce_eager,
        enable_prefix_caching=True,
        logprobs_mode="processed_logprobs",
        kv_cache_memory_bytes=int(v.kv_cache_gib * 2**30),
        enable_chunked_prefill=False,  # as the adapter on CPU: seeded requests and partial prefills do not mix there
        max_num_batched_tokens=max(2048, cfg.engine.max_len or 0),
    )


def plain_vllm_call(llm: Any, workload: Workload) -> Callable[[], int]:
    """One ``LLM.generate`` of the whole workload, asking what an RL caller asks (the sampled token's log-prob)."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in row]) for row in workload.prompts]
    params = [
        VllmSamplingParams(
            max_tokens=workload.new_tokens,
            temperature=workload.temperature,
            top_k=workload.top_k,
            top_p=workload.top_p,
            seed=index,
            logprobs=0,
            ignore_eos=True,
            detokenize=False,
        )
        for index in range(len(prompts))
    ]

    def call() -> int:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(out.outputs[0].token_ids) for out in outputs)

    return call


def measure(
    contenders: dict[str, tuple[Callable[[], int], int]],
    first_token: Callable[[], int],
    device: torch.device,
    repeats: int | None,
    workload: Workload,
) -> tuple[dict[str, float], float]:
    """Warm every contender up, then time interleaved rounds (`enough_rounds`): median tokens/s, median TTFT s."""
    for name, (call, warmups) in contenders.items():
        _progress(f"warming up {name} ({warmups} call(s))")
        for _ in range(warmups):
            call()
    first_token()
    measured: dict[str, list[Measurement]] = {name: [] for name in contenders}
    ttft: list[float] = []
    measured_s = 0.0
    while not enough_rounds(len(ttft), measured_s, repeats):
        for name, (call, _) in contenders.items():
            measured[name].append(timed(call, device))
        ttft.append(timed(first_token, device).seconds)
        measured_s += ttft[-1] + sum(runs[-1].seconds for runs in measured.values())
        rates = ", ".join(f"{name} {tokens_per_s(runs[-1:]):,.0f} tok/s" for name, runs in measured.items())
        if len(ttft) <= MIN_ROUNDS or len(ttft) % 25 == 0:
            _progress(f"round {len(ttft)}: {rates}")
    _progress(f"{len(ttft)} rounds, {measured_s:.1f} s timed")
    expected = workload.num_requests * workload.new_tokens
    for name, runs in measured.items():
        short = [m.tokens for m in runs if m.tokens != expected]
        if short:
            _progress(f"warning: {name} produced {short} tokens in some calls, expected {expected}")
    return {name: tokens_per_s(runs) for name, runs in measured.items()}, statistics.median(ttft)
