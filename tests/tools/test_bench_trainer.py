"""`leeway bench trainer` on the CPU at tiny sizes: keys, arithmetic and flags (speed is the bench's business)."""

from __future__ import annotations

import argparse

import pytest
import torch

from actors.cli import build_parser
from actors.models import build_model
from actors.tools.bench import trainer as bench
from pipeline.config import ConfigError

KEYS = {
    "device",
    "model",
    "params",
    "world_size",
    "tokens_per_step",
    "padding_fraction",
    "step_s",
    "tokens_per_s",
    "mfu",
    "plain_tokens_per_s",
    "plain_mfu",
    "trainer_vs_plain",
    "max_memory_gib",
}
VOCAB = 14
TINY = ["--model", "tiny-llama-1x32", "--sequences", "5", "--min-tokens", "4", "--max-tokens", "20"]
TINY += ["--steps", "1", "--warmup", "0", "--micro-batch-tokens", "32"]


def _args(*argv: str) -> argparse.Namespace:
    return build_parser(["bench", "trainer"]).parse_args(["bench", "trainer", *argv])


@pytest.mark.parametrize("packing", ["true", "false"])
def test_bench_trainer_reports_every_key_on_cpu(packing: str) -> None:
    before = torch.get_num_threads()
    try:
        result = bench.run(_args(*TINY, "--set", f"trainer.packing={packing}"))
    finally:
        torch.set_num_threads(before)
    assert set(result) == KEYS
    assert result["device"] == "cpu" and result["model"] == "tiny-llama-1x32" and result["world_size"] == 1
    assert result["mfu"] is None and result["plain_mfu"] is None
    lengths = bench._lengths(_args(*TINY), torch.device("cpu"), context=128)
    assert result["tokens_per_step"] == sum(lengths) and all(4 <= n <= 20 for n in lengths)
    assert result["tokens_per_s"] == pytest.approx(result["tokens_per_step"] / result["step_s"])
    assert result["trainer_vs_plain"] == pytest.approx(result["tokens_per_s"] / result["plain_tokens_per_s"])
    assert 0.0 <= result["padding_fraction"] < 1.0 and result["max_memory_gib"] > 0
    # the matmul parameters: everything but the (untied) input embedding table
    model = build_model("tiny-llama-1x32", vocab_size=VOCAB, seed=0)
    embedding = model.get_input_embeddings().weight.numel()
    assert bench.matmul_params(model) == sum(p.numel() for p in model.parameters()) - embedding > 0
    assert result["params"] > 0


def test_mfu_uses_the_peak_of_the_device_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert bench.peak_flops(torch.device("cuda")) == 989e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GH200 480GB")
    assert bench.peak_flops(torch.device("cuda")) == 989e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert bench.peak_flops(torch.device("cuda")) is None
    assert bench.peak_flops(torch.device("cpu")) is None


def test_plain_loop_packs_consecutive_sequences_and_counts_its_padding() -> None:
    lengths = [4, 8, 2, 10, 3]
    packs = bench.plain_micro_batches(lengths, 16)
    assert packs == [[0, 1], [2], [3], [4]]
    padded = 2 * 8 + 2 + 10 + 3
    assert bench.padding_fraction(lengths, packs) == pytest.approx(1 - sum(lengths) / padded)


def test_cpu_defaults_are_tiny_and_cuda_defaults_are_the_issues_batch() -> None:
    args = _args()
    cpu = bench._lengths(args, torch.device("cpu"), context=128)
    assert len(cpu) == 32 and all(bench.CPU_SIZES["min_tokens"] <= n <= bench.CPU_SIZES["max_tokens"] for n in cpu)
    cuda = bench._lengths(args, torch.device("cuda"), context=4096)
    assert len(cuda) == 32 and all(512 <= n <= 2048 for n in cuda)
    assert max(bench._lengths(args, torch.device("cuda"), context=1000)) <= 1000  # never past the context
    with pytest.raises(ValueError, match="--min-tokens"):
        bench._lengths(_args("--min-tokens", "50", "--max-tokens", "10"), torch.device("cpu"), context=128)


def test_backend_flag_goes_through_the_config() -> None:
    with pytest.raises(ConfigError, match="trainer.backend"):
        bench.run(_args(*TINY, "--backend", "no-such-backend"))
