"""`leeway sft` end to end through the real command: a tiny model trained on reasoning-gym's reference answers
becomes a Hugging Face checkpoint that plain `transformers` loads and that decodes greedily exactly as Leeway's
engine does; `leeway eval --checkpoint` scores it as a transformers greedy loop does; an existing result is never
overwritten without --resume or --fresh; --fresh deletes only a directory `leeway sft` created (never the working
directory, one without its marker, or a link); --resume continues the saved state past a raised `sft.max_steps`; and
`sft.data` and `sft.from_task` are exactly one."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.generator.runtime import build_engine
from actors.models import load_tokenizer, stop_token_ids
from actors.sft.runtime import SFT_MARKER
from pipeline.config import LeewayConfig, load_config
from pipeline.rl.engine_records import GenerateRequest, SamplingParams
from pipeline.rl.prompt_ids import checked_prompt_ids
from pipeline.tasks import Prompt, Task, task_for

REPO = Path(__file__).resolve().parents[2]
STEPS = 150
EVAL_PROMPTS = 20
MAX_NEW_TOKENS = 5
COMMAND_TIMEOUT_S = 300
"""Generous bound on one tiny `leeway sft` / `leeway eval` (seconds on 2 cores); each ends as soon as it is done."""
CHECKPOINT_FILES = (
    "model.safetensors",
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "eval.json",
    "sft.jsonl",
)


def _config(root: Path) -> dict:
    return {
        "run": {"name": "sft-test", "seed": 0, "dir": str(root / "run")},
        "model": {"name_or_path": "tiny-llama-2x64", "dtype": "float32"},
        "engine": {"torch_threads": 1, "sampling": {"temperature": 1.0, "max_new_tokens": MAX_NEW_TOKENS}},
        "trainer": {"torch_threads": 1},
        "task": {
            "name": "reasoning_gym",
            "args": {
                "dataset": "chain_sum",
                "size": 40,
                "eval_size": 30,
                "seed": 0,
                "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
                "answer_format": "raw",
                "tokenizer": "numeric",
            },
        },
        "sft": {
            "from_task": True,
            "base_model": "tiny-llama-1x32",
            "output_dir": str(root / "out"),
            "max_steps": STEPS,
            "batch_examples": 8,
            "lr": 0.02,
            "log_every": 1,
            "checkpoint_every": 100,
        },
        "eval": {"samples_per_prompt": 1, "prompts": EVAL_PROMPTS},
        "logging": {"level": "INFO"},
    }


def _leeway(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "actors.cli", *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))},
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
    )


def _digests(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass(frozen=True)
class SftRun:
    root: Path
    config: Path
    out: Path
    stdout: str

    def cfg(self, *overrides: str) -> LeewayConfig:
        return load_config(self.config, list(overrides), environ={})


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SftRun]:
    root = tmp_path_factory.mktemp("sft")
    config = root / "sft.yaml"
    config.write_text(yaml.safe_dump(_config(root)))
    proc = _leeway("sft", str(config))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    yield SftRun(root, config, root / "out", proc.stdout)


def _eval_prompts(task: Task) -> list[Prompt]:
    prompts = task.eval_prompts()
    assert prompts
    return prompts[:EVAL_PROMPTS]


def _transformers_greedy(out: Path, prompt_ids: list[int]) -> list[int]:
    """The reply of plain `transformers` greedy decoding from the checkpoint directory, through its first stop."""
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        generated = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=MAX_NEW_TOKENS,
        )[0, len(prompt_ids) :].tolist()
    stops = model.generation_config.eos_token_id
    stops = set(stops if isinstance(stops, list) else [stops])
    for i, token in enumerate(generated):
        if token in stops:
            return generated[: i + 1]
    return generated


# ---- the result -----------------------------------------------------------------------------------------


def test_leeway_sft_writes_a_checkpoint_with_its_eval_and_metrics(sft_run: SftRun) -> None:
    for name in CHECKPOINT_FILES:
        assert (sft_run.out / name).is_file(), name
    summary = json.loads(sft_run.stdout.strip().splitlines()[-1])
    assert summary["steps"] == STEPS and summary["examples"] == 40 and summary["skipped"] == {}
    assert 0.0 <= summary["eval"]["pass@1"] <= 1.0
    assert summary["eval"]["prompts"] == EVAL_PROMPTS and summary["eval"]["samples_per_prompt"] == 1
    assert json.loads((sft_run.out / "eval.json").read_text())["pass@1"] == summary["eval"]["pass@1"]
    records = _records(sft_run.out / "sft.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[-1]["loss"] == summary["final_loss"]
    assert records[-1]["loss"] < 0.6 * records[0]["loss"]  # it learned something
    config = json.loads((sft_run.out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["hidden_size"] == 32  # sft.base_model, not model.name_or_path


def test_the_checkpoint_loads_in_transformers_and_decodes_greedily_as_leeway_s_engine(sft_run: SftRun) -> None:
    torch.set_num_threads(1)
    cfg = sft_run.cfg(f"model.name_or_path={sft_run.out}")
    task = task_for(cfg)
    tokenizer = load_tokenizer(cfg, task)
    hf_tokenizer = AutoTokenizer.from_pretrained(sft_run.out)
    engine = build_engine(cfg, tokenizer, "eval")
    sampling = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0, stop_token_ids=stop_token_ids(tokenizer))
    replies = []
    for i, prompt in enumerate(_eval_prompts(task)[:6]):
        ids = checked_prompt_ids(
            prompt, tokenizer, vocab_size=engine.vocab_size, max_context_tokens=engine.max_context_tokens
        )
        assert hf_tokenizer(prompt.text)["input_ids"] == ids
        (result,) = engine.generate([GenerateRequest(ids, seed=i, request_id=f"p{i}")], sampling)
        leeway_reply = result.token_ids.tolist()
        assert leeway_reply == _transformers_greedy(sft_run.out, ids), prompt.text
        replies.append(leeway_reply)
    assert hf_tokenizer.eos_token == "<eos>"
    assert len({tuple(r) for r in replies}) > 1  # replies that depend on the prompt: the comparison means something


def test_leeway_eval_of_the_checkpoint_scores_what_transformers_greedy_scores(sft_run: SftRun) -> None:
    proc = _leeway("eval", str(sft_run.config), "--checkpoint", str(sft_run.out), "--set", "eval.temperature=0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["temperature"] == 0.0 and result["prompts"] == EVAL_PROMPTS

    task = task_for(sft_run.cfg())
    hf_tokenizer = AutoTokenizer.from_pretrained(sft_run.out)
    stop = hf_tokenizer.convert_tokens_to_ids("<eos>")
    right = []
    for prompt in _eval_prompts(task):
        ids = hf_tokenizer(prompt.text)["input_ids"]
        reply = _transformers_greedy(sft_run.out, ids)
        if reply and reply[-1] == stop:
            reply = reply[:-1]
        text = hf_tokenizer.decode(reply, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        right.append(task.verify(prompt, text, reply).reward >= task.max_reward)
    assert any(right) and not all(right)  # the trained model gets some right: the two scores can disagree
    assert result["pass@1"] == pytest.approx(sum(right) / len(right), abs=1e-9)


# ---- reruns ---------------------------------------------------------------------------------------------


def test_a_second_run_without_resume_or_fresh_is_refused_and_changes_nothing(sft_run: SftRun) -> None:
    before = _digests(sft_run.out)
    proc = _leeway("sft", str(sft_run.config), "--no-eval")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    message = proc.stdout + proc.stderr
    assert "--resume" in message and "--fresh" in message and str(sft_run.out) in message
    assert _digests(sft_run.out) == before


def test_resume_with_more_steps_continues_the_saved_state(sft_run: SftRun) -> None:
    copy = sft_run.root / "resumed"
    shutil.copytree(sft_run.out, copy)
    weights_before = (copy / "model.safetensors").read_bytes()
    proc = _leeway(
        "sft",
        str(sft_run.config),
        "--resume",
        "--no-eval",
        "--set",
        f"sft.output_dir={copy}",
        "--set",
        f"sft.max_steps={STEPS + 2}",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"resumed from {copy / 'state' / f'step-{STEPS:08d}'}" in proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == STEPS + 2 and "eval" not in summary
    assert [r["step"] for r in _records(copy / "sft.jsonl")] == list(range(1, STEPS + 3))
    progress = json.loads((copy / "state" / f"step-{STEPS + 2:08d}" / "progress.json").read_text())
    assert progress["step"] == STEPS + 2
    assert (copy / "model.safetensors").read_bytes() != weights_before


@pytest.mark.parametrize("case", ["working-directory", "no-marker", "link"])
def test_fresh_refuses_what_leeway_sft_did_not_create_and_deletes_nothing(tmp_path: Path, case: str) -> None:
    """`sft.output_dir: "."` once emptied the project directory: --fresh now has `leeway run --fresh`'s guards."""
    project = tmp_path / "project"  # the working directory: someone's project, with files
    (project / "src").mkdir(parents=True)
    (project / "pyproject.toml").write_text("[project]\nname = 'mine'\n")
    (project / "src" / "work.py").write_text("YEARS = 'of work'\n")
    results = tmp_path / "results"  # a directory of results `leeway sft` never wrote
    results.mkdir()
    (results / "model.safetensors").write_bytes(b"someone else's weights")
    ours = tmp_path / "ours"  # one holding the marker, reached through a link
    ours.mkdir()
    (ours / SFT_MARKER).write_text("")
    (ours / "sft.jsonl").write_text("{}\n")
    (tmp_path / "link").symlink_to(ours, target_is_directory=True)
    output_dir, expected = {
        "working-directory": (".", "it is the working directory"),
        "no-marker": (str(results), SFT_MARKER),
        "link": (str(tmp_path / "link"), "a link"),
    }[case]
    settings = _config(tmp_path)
    settings["sft"] = {**settings["sft"], "output_dir": output_dir, "max_steps": 1}
    config = tmp_path / "sft.yaml"
    config.write_text(yaml.safe_dump(settings))
    before = {path: _digests(path) for path in (project, results, ours)}
    proc = _leeway("sft", str(config), "--fresh", "--no-eval", cwd=project)
    message = proc.stdout + proc.stderr
    assert proc.returncode == 2, message
    assert "--fresh" in message and expected in message and "sft.output_dir" in message, message
    assert {path: _digests(path) for path in (project, results, ours)} == before


def test_fresh_deletes_and_redoes_a_result_leeway_sft_created(tmp_path: Path) -> None:
    config = tmp_path / "sft.yaml"
    config.write_text(yaml.safe_dump(_config(tmp_path)))
    out = tmp_path / "out"
    short = ("--no-eval", "--set", "sft.checkpoint_every=1")
    first = _leeway("sft", str(config), *short, "--set", "sft.max_steps=2")
    assert first.returncode == 0, first.stdout + first.stderr
    assert (out / SFT_MARKER).is_file() and (out / "state" / f"step-{2:08d}").is_dir()
    again = _leeway("sft", str(config), "--fresh", *short, "--set", "sft.max_steps=1")
    assert again.returncode == 0, again.stdout + again.stderr
    assert [r["step"] for r in _records(out / "sft.jsonl")] == [1]
    assert (out / SFT_MARKER).is_file() and not (out / "state" / f"step-{2:08d}").exists()


# ---- backends -------------------------------------------------------------------------------------------

BACKEND_STEPS = 4
BACKEND_TOLERANCE = 1e-5


def _short_sft(sft_run: SftRun, name: str, *args: str) -> tuple[dict[str, torch.Tensor], list[dict]]:
    out = sft_run.root / name
    proc = _leeway(
        "sft",
        str(sft_run.config),
        "--no-eval",
        "--set",
        f"sft.output_dir={out}",
        "--set",
        f"sft.max_steps={BACKEND_STEPS}",
        *args,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return load_file(out / "model.safetensors"), _records(out / "sft.jsonl")


@pytest.fixture(scope="module")
def one_torch_process(sft_run: SftRun) -> tuple[dict[str, torch.Tensor], list[dict]]:
    return _short_sft(sft_run, "one-torch-process")


@pytest.mark.parametrize(
    "variant",
    [("--nproc", "2"), ("--set", "trainer.backend=megatron")],
    ids=["fsdp2-two-ranks", "megatron"],
)
def test_two_fsdp2_ranks_and_the_megatron_backend_take_the_steps_one_torch_process_takes(
    sft_run: SftRun, one_torch_process: tuple[dict[str, torch.Tensor], list[dict]], variant: tuple[str, str]
) -> None:
    """The same examples per step, the same mean loss per assistant token, the same weights after the steps."""
    base_weights, base_records = one_torch_process
    weights, records = _short_sft(sft_run, f"variant-{variant[-1]}", *variant)
    assert [r["step"] for r in records] == [r["step"] for r in base_records] == list(range(1, BACKEND_STEPS + 1))
    assert base_records[-1]["loss"] < base_records[0]["loss"]  # the steps trained: agreeing means something
    for got, want in zip(records, base_records, strict=True):
        assert got["loss_tokens"] == want["loss_tokens"]
        assert got["loss"] == pytest.approx(want["loss"], rel=BACKEND_TOLERANCE, abs=BACKEND_TOLERANCE)
    assert weights.keys() == base_weights.keys()
    for key, tensor in base_weights.items():
        torch.testing.assert_close(weights[key], tensor, atol=BACKEND_TOLERANCE, rtol=0, msg=key)


# ---- config ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("both", [True, False], ids=["both", "neither"])
def test_sft_data_and_from_task_are_exactly_one(tmp_path: Path, both: bool) -> None:
    settings = _config(tmp_path)
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "completion": "2"}) + "\n")
    settings["sft"] = {**settings["sft"], "from_task": both, "data": str(data) if both else None}
    config = tmp_path / "sft.yaml"
    config.write_text(yaml.safe_dump(settings))
    proc = _leeway("sft", str(config))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    message = proc.stdout + proc.stderr
    assert "sft.data" in message and "sft.from_task" in message
    assert not (tmp_path / "out").exists()
