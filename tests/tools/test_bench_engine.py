"""`leeway bench engine` on CPU at tiny sizes, and the GPU check script that calls it (so neither can rot).

Only shapes, counts and arithmetic are checked here; speed is the bench's business, never a test's.
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from actors.cli import build_parser
from actors.tools.bench import engine as bench

ROOT = Path(__file__).resolve().parents[2]
GPU_CHECK = ROOT / "scripts" / "gpu_check.sh"
TINY = ["--model", "tiny-llama-1x32", "--requests", "3", "--prompt-tokens", "5", "--new-tokens", "4"]
KEYS = {
    "engine",
    "vllm_plain_tokens_per_s",
    "engine_vs_vllm",
    "update_ms",
    "device",
    "model",
    "params",
    "requests",
    "prompt_tokens",
    "new_tokens",
    "engine_tokens_per_s",
    "hf_generate_tokens_per_s",
    "hf_static_tokens_per_s",
    "engine_vs_hf",
    "engine_vs_hf_static",
    "ttft_ms",
}


def _args(*argv: str) -> argparse.Namespace:
    return build_parser(["bench", "engine"]).parse_args(["bench", "engine", "--json", *argv])


def test_bench_engine_reports_every_key_on_cpu() -> None:
    result = bench.run(_args(*TINY, "--device", "cpu", "--repeats", "2"))
    assert set(result) == KEYS
    assert result["device"] == "cpu" and result["model"] == "tiny-llama-1x32" and result["engine"] == "torch"
    assert result["vllm_plain_tokens_per_s"] is None and result["engine_vs_vllm"] is None  # plain vLLM: --engine vllm
    assert isinstance(result["update_ms"], float) and result["update_ms"] > 0
    assert (result["requests"], result["prompt_tokens"], result["new_tokens"]) == (3, 5, 4)
    assert isinstance(result["params"], int) and result["params"] > 0
    for key in ("engine_tokens_per_s", "hf_generate_tokens_per_s", "engine_vs_hf", "ttft_ms"):
        assert isinstance(result[key], float) and result[key] > 0, key
    assert result["hf_static_tokens_per_s"] is None and result["engine_vs_hf_static"] is None
    assert result["engine_vs_hf"] == pytest.approx(result["engine_tokens_per_s"] / result["hf_generate_tokens_per_s"])


@pytest.mark.gpu
def test_bench_engine_runs_the_static_cache_baseline_on_cuda() -> None:
    result = bench.run(_args(*TINY, "--device", "cuda", "--repeats", "1"))
    assert set(result) == KEYS
    assert result["device"] == "cuda"
    assert isinstance(result["hf_static_tokens_per_s"], float) and result["hf_static_tokens_per_s"] > 0
    assert result["engine_vs_hf_static"] == pytest.approx(
        result["engine_tokens_per_s"] / result["hf_static_tokens_per_s"]
    )


def test_defaults_are_the_demo_batch() -> None:
    args = _args("--device", "cpu")
    setup = bench.load_setup(args)
    workload = bench.make_workload(args, setup, vocab_size=14, pad_token_id=0)
    cfg = setup.cfg
    assert setup.cfg.model.name_or_path == "tiny-gpt2-2x64"
    assert workload.num_requests == cfg.generator.concurrency * cfg.advantages.group_size
    assert workload.prompt_tokens == 8  # <bos>, six digits, '>'
    assert workload.new_tokens == cfg.engine.sampling.max_new_tokens
    assert not (workload.prompts == 0).any(), "no prompt id is the pad id"


def test_the_engine_cache_is_sized_to_the_workload_unless_the_config_fixes_it() -> None:
    args = _args(*TINY)
    setup = bench.load_setup(args)
    workload = bench.make_workload(args, setup, vocab_size=14, pad_token_id=0)
    cfg = bench.engine_config(args, setup, workload)
    assert (cfg.engine.max_slots, cfg.engine.max_len) == (3, 5 + 4)
    args = _args(*TINY, "--set", "engine.max_slots=7")
    setup = bench.load_setup(args)
    cfg = bench.engine_config(args, setup, workload)
    assert (cfg.engine.max_slots, cfg.engine.max_len) == (7, 5 + 4)


def test_every_contender_produces_exactly_the_requested_tokens() -> None:
    from actors.generator.runtime import build_engine
    from actors.models import pad_token_id

    args = _args(*TINY, "--device", "cpu")
    setup = bench.load_setup(args)
    engine = build_engine(setup.cfg, setup.tokenizer, bench.ENGINE_ID)
    pad = pad_token_id(setup.tokenizer)
    workload = bench.make_workload(args, setup, vocab_size=engine.vocab_size, pad_token_id=pad)
    assert bench.engine_call(engine, workload)() == 3 * 4
    assert bench.engine_call(engine, workload, new_tokens=1)() == 3


def test_hf_generate_ignores_eos_even_when_the_model_always_emits_it() -> None:
    from actors.models import build_policy_model, eos_token_id, pad_token_id

    args = _args(*TINY, "--device", "cpu")
    setup = bench.load_setup(args)
    eos = eos_token_id(setup.tokenizer)
    assert eos is not None
    model = build_policy_model(setup.cfg, setup.tokenizer)
    head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        head.bias[eos] = 100.0  # EOS is every token's near-certain draw
    model.lm_head = head
    pad = pad_token_id(setup.tokenizer)
    workload = bench.make_workload(args, setup, vocab_size=model.config.vocab_size, pad_token_id=pad)
    input_ids = torch.as_tensor(workload.prompts)
    honoured = model.generate(input_ids=input_ids, do_sample=True, max_new_tokens=4, eos_token_id=eos, pad_token_id=pad)
    assert honoured.shape[1] == workload.prompt_tokens + 1, "with EOS honoured every row stops after one token"
    assert bench.hf_call(model, workload, pad_token_id=pad, static=False)() == 3 * 4


def test_too_long_a_workload_names_the_flags() -> None:
    with pytest.raises(ValueError, match="--prompt-tokens 100 \\+ --new-tokens 100"):
        bench.run(
            _args("--model", "tiny-llama-1x32", "--requests", "1", "--prompt-tokens", "100", "--new-tokens", "100")
        )


def test_rates_are_medians_and_ratios_tolerate_missing_baselines() -> None:
    runs = [bench.Measurement(1.0, 100), bench.Measurement(2.0, 100), bench.Measurement(0.5, 100)]
    assert bench.tokens_per_s(runs) == 100.0
    assert bench.ratio(300.0, 100.0) == 3.0
    assert bench.ratio(300.0, None) is None
    assert bench.enough_rounds(3, 0.0, 3) and not bench.enough_rounds(2, 100.0, 3)
    assert not bench.enough_rounds(bench.MIN_ROUNDS - 1, 1e6, None)
    assert not bench.enough_rounds(bench.MIN_ROUNDS, bench.MIN_MEASURED_S / 2, None)
    assert bench.enough_rounds(bench.MIN_ROUNDS, bench.MIN_MEASURED_S, None)
    assert bench.enough_rounds(bench.MAX_ROUNDS, 0.0, None)


# ------------------------------------------------------------------------------------- gpu_check.sh


def _cli_commands(script: str) -> list[list[str]]:
    """The argument lists of every `python3 -m actors.cli ...` in the script (continuation lines joined)."""
    joined = script.replace("\\\n", " ")
    commands = []
    for line in joined.splitlines():
        if line.lstrip().startswith("#") or "-m actors.cli" not in line:
            continue
        words = shlex.split(line.split("-m actors.cli", 1)[1], comments=True)
        commands.append(words)
    return commands


def test_gpu_check_script_is_valid_bash() -> None:
    bash = shutil.which("bash")
    assert bash is not None
    subprocess.run([bash, "-n", str(GPU_CHECK)], check=True)


def test_gpu_check_script_calls_only_commands_the_cli_has() -> None:
    script = GPU_CHECK.read_text()
    commands = _cli_commands(script)
    benches = [words[1] for words in commands if words[0] == "bench"]
    assert "engine" in benches
    assert re.search(r"python3 -m pytest\b.*-m gpu", script)
    for words in commands:
        if words[0] == "bench" and not (ROOT / "actors" / "tools" / "bench" / f"{words[1]}.py").exists():
            # a bench still to be written runs only behind a guard on its module
            assert f"-f actors/tools/bench/{words[1]}.py" in script, words
            continue
        try:
            build_parser(words).parse_args(words)
        except SystemExit as exc:
            raise AssertionError(f"gpu_check.sh: `leeway {shlex.join(words)}` does not parse") from exc
