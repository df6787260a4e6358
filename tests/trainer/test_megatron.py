"""The megatron backend: HF <-> Megatron conversion, agreement with the torch backend, TP=2 over gloo.

Backends run in rank processes started here (``python tests/trainer/test_megatron.py MODE OUT_DIR`` with the
launch environment), never in the pytest process: megatron-core keeps its process groups in module
globals. Ranks write their results as safetensors and JSON under ``OUT_DIR``; the tests compare them.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor
from transformers import Qwen2Config, Qwen2ForCausalLM

from actors.models import build_model
from actors.trainer.backends import LossExtras, MicroBatch, TrainBatch, TrainingBackend, TrainSequence

REPO = Path(__file__).resolve().parents[2]
VOCAB = 33
"""Odd on purpose: under TP=2 the vocabulary is padded and the padded logits must carry no mass."""
TEMPERATURE = 0.7
LR = 1e-3
DEVICE_ENV = "LEEWAY_TEST_DEVICE"
"""The rank's device (default cpu); the gpu-marked test sets cuda."""
RANK_TIMEOUT_S = 300
"""A rank that has not finished by then is hung (a collective waiting forever); the test fails."""


def _qwen2(seed: int = 0, *, tied: bool = True, layers: int = 2) -> Qwen2ForCausalLM:
    """A tiny Qwen2: grouped KV heads (4 query heads, 2 KV heads), q/k/v biases, tied embeddings."""
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
        for name, param in model.named_parameters():
            if name.endswith("bias"):  # HF initialises biases to zero: make the conversion carry real values
                torch.nn.init.normal_(param, std=0.02)
    return model.eval()


def _llama_gqa() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        intermediate_size=160,
        tie_word_embeddings=False,
    )
    torch.manual_seed(1)
    return LlamaForCausalLM(config).eval()


# ---- conversion (pure, in-process) -------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "llama-gqa", "qwen2", "qwen2-untied", "gpt2"])
@pytest.mark.parametrize("tp_size", [1, 2])
def test_hf_to_megatron_to_hf_is_bit_exact_through_tp_shards(family: str, tp_size: int) -> None:
    from actors.trainer.backends.megatron.convert import (
        ModelShape,
        hf_to_megatron,
        megatron_to_hf,
        shard,
        unshard_all,
    )

    model = {
        "llama": lambda: build_model("tiny-llama-2x64", vocab_size=VOCAB, seed=0),
        "llama-gqa": _llama_gqa,
        "qwen2": _qwen2,
        "qwen2-untied": lambda: _qwen2(tied=False),
        "gpt2": lambda: build_model("tiny-gpt2-2x64", vocab_size=VOCAB, seed=0),
    }[family]()
    hf = model.state_dict()
    shape = ModelShape.from_hf_config(model.config)
    full = hf_to_megatron(shape, hf)
    shards = [shard(shape, full, rank, tp_size) for rank in range(tp_size)]
    if tp_size > 1:  # each rank holds whole query groups and its own halves of gate and up
        qkv = shards[0]["decoder.layers.0.self_attention.linear_qkv.weight"]
        assert qkv.shape[0] == full["decoder.layers.0.self_attention.linear_qkv.weight"].shape[0] // tp_size
        assert shards[0]["embedding.word_embeddings.weight"].shape[0] == shape.padded_vocab(tp_size) // tp_size
    back = megatron_to_hf(shape, unshard_all(shape, shards), list(hf))
    assert list(back) == list(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_fused_qkv_uses_megatrons_per_group_layout() -> None:
    """Rows of one query group: its query heads, then its key, then its value (megatron-core's layout)."""
    from actors.trainer.backends.megatron.convert import ModelShape, hf_to_megatron

    model = _qwen2()
    shape = ModelShape.from_hf_config(model.config)
    qkv = hf_to_megatron(shape, model.state_dict())["decoder.layers.0.self_attention.linear_qkv.weight"]
    attn = model.model.layers[0].self_attn
    d = shape.head_dim  # group 1 = query heads 2, 3, then key head 1, then value head 1
    group1 = qkv[4 * d : 8 * d]
    assert torch.equal(group1[: 2 * d], attn.q_proj.weight[2 * d : 4 * d])
    assert torch.equal(group1[2 * d : 3 * d], attn.k_proj.weight[d : 2 * d])
    assert torch.equal(group1[3 * d :], attn.v_proj.weight[d : 2 * d])


def test_a_tp_size_that_splits_a_kv_head_is_refused_naming_the_key() -> None:
    from actors.trainer.backends.megatron.convert import ModelShape, hf_to_megatron, shard

    model = _qwen2()  # 2 KV heads
    shape = ModelShape.from_hf_config(model.config)
    with pytest.raises(ValueError, match="megatron.tensor_parallel_size=4"):
        shard(shape, hf_to_megatron(shape, model.state_dict()), 0, 4)


def test_an_unsupported_family_is_refused_by_name() -> None:
    from transformers import MistralConfig

    from actors.trainer.backends.megatron.convert import ModelShape

    with pytest.raises(ValueError, match="'mistral'"):
        ModelShape.from_hf_config(MistralConfig())


# ---- rank processes ------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run_ranks(mode: str, out: Path, world_size: int, **extra_env: str) -> None:
    """Start ``world_size`` rank processes of this file and wait for all; a failure shows every rank's log."""
    port = _free_port()
    procs = []
    for rank in range(world_size):
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            **extra_env,
        }
        log = open(out / f"{mode}-rank{rank}.log", "w")
        procs.append(
            (subprocess.Popen([sys.executable, __file__, mode, str(out)], env=env, stdout=log, stderr=log), log)
        )
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=RANK_TIMEOUT_S))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
        log.close()
    if any(codes):
        logs = "\n".join((out / f"{mode}-rank{r}.log").read_text()[-3000:] for r in range(world_size))
        raise AssertionError(f"{mode} ranks exited {codes}:\n{logs}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process (TP=1): torch and megatron backends from the same HF weights, and a checkpoint."""
    out = tmp_path_factory.mktemp("megatron")
    _run_ranks("reference", out, world_size=1)
    return out


@pytest.mark.parametrize("family", ["gpt2", "qwen2"])
def test_megatron_logprobs_and_one_step_match_the_torch_backend(reference: Path, family: str) -> None:
    got = load_file(reference / f"{family}.safetensors")
    assert (got["logp_megatron"] - got["logp_torch"]).abs().max() <= 1e-4
    assert got["logp_torch"].abs().sum() > 0
    moved = 0.0
    for key in [k for k in got if k.startswith("after_torch/")]:
        name = key.removeprefix("after_torch/")
        torch_delta = got[key] - got[f"before/{name}"]
        megatron_delta = got[f"after_megatron/{name}"] - got[f"before/{name}"]
        assert (torch_delta - megatron_delta).abs().max() <= 1e-5, name
        moved += float(torch_delta.abs().sum())
    assert moved > 0
    stats = json.loads((reference / f"{family}.json").read_text())
    assert stats["torch"]["grad_norm"] == pytest.approx(stats["megatron"]["grad_norm"], rel=1e-5)
    assert stats["torch"]["entropy"] == pytest.approx(stats["megatron"]["entropy"], rel=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_megatron_matches_the_torch_backend_in_fp32(tmp_path: Path) -> None:
    """The same comparison on a GPU (Transformer Engine's spec where TE is installed), fp32, no autocast."""
    _run_ranks("reference", tmp_path, world_size=1, **{DEVICE_ENV: "cuda"})
    for family in ("gpt2", "qwen2"):
        test_megatron_logprobs_and_one_step_match_the_torch_backend(tmp_path, family)


def test_megatron_resume_from_its_checkpoint_is_bit_exact(reference: Path) -> None:
    got = load_file(reference / "resume.safetensors")
    names = [k.removeprefix("continued/") for k in got if k.startswith("continued/")]
    assert names
    for name in names:
        assert torch.equal(got[f"continued/{name}"], got[f"resumed/{name}"]), name


# ---- TP=2 / PP=2 against one process: what the split must preserve, at the precision fp32 allows ---------------
#
# Splitting a layer (TP) or the layers (PP) changes only the order of fp32 sums, so results agree up to
# rounding, and how far depends on the CPU's kernels (AVX2 and AVX-512 sum in other orders). A sum of n terms
# rounds by about sqrt(n) * u relative (u = EPS32 / 2, the unit roundoff; random-walk estimate); the widest
# reduction here is 40 tokens x 256 (GPT-2's MLP) = 10240 terms: sqrt(10240) * u = 6e-6. So:
# - log-probs (|logp| < 10, hence 10 x REL_TOL absolute) and the step's loss, grad norm and entropy agree
#   within REL_TOL = 1e-5 (measured: ~1e-7);
# - the weights after an AdamW step are NOT compared with one bound: the first step moves each weight by
#   lr * g / (|g| + adam_eps) (bias-corrected m = g, v = g^2), so a near-zero gradient (a key bias, which
#   softmax ignores; a padded vocabulary row) moves it by rounding noise amplified up to lr (2.6e-6 on an
#   AVX2 EPYC against a 1e-6 bound). The update's sensitivity is lr * adam_eps / (|g| + adam_eps)^2 per unit
#   of gradient error, so each element gets the bound that a worst-case gradient rounding (GRAD_ROUNDING)
#   allows at its own |g|, read back from the reference's update: large-gradient elements (most of them,
#   checked) are held to a few ulps, rounding-dominated ones only to the 2 * lr of a sign flip;
# - a later step (the resumed one) is checked on what it must preserve: its loss, grad norm and entropy,
#   and the log-probs after it, which weights with near-zero gradients leave alone.
EPS32 = torch.finfo(torch.float32).eps
REL_TOL = 1e-5
ADAM_EPS = 1e-8
"""The backend's AdamW epsilon (its default)."""
GRAD_ROUNDING = 40 * 256 * EPS32 * 4.0
"""Worst-case rounding of one gradient element: n * EPS32 (n = tokens x widest layer) times the gradient
scale, the grad norm before the clip (~3 here) rounded up to 4."""


def _update_bound(before: Tensor, after_ref: Tensor) -> Tensor:
    """Per element: how far a rounding-level gradient difference may move the first AdamW update, plus two
    ulps of the stored weights (the update is read back as after - before)."""
    ratio = ((after_ref - before).abs() / LR).clamp(max=1.0)  # |g| / (|g| + eps)
    ulps = 2 * EPS32 * torch.maximum(before.abs(), after_ref.abs())
    slack = (ulps / LR).clamp(min=1e-12)  # the ratio is known to that precision: |g| is at least ...
    grad = ADAM_EPS * (ratio - slack).clamp(min=0.0) / (1.0 - ratio + slack)
    moved = LR * ADAM_EPS * GRAD_ROUNDING / (grad + ADAM_EPS) ** 2
    return moved.clamp(max=2 * LR) + 2 * ulps


def _assert_first_step_matches(one: dict[str, Tensor], two: dict[str, Tensor]) -> None:
    tight = total = 0
    for key in [k for k in one if k.startswith("after_megatron/")]:
        name = key.removeprefix("after_megatron/")
        bound = _update_bound(one[f"before/{name}"], one[key])
        diff = (two[key] - one[key]).abs()
        worst = int((diff - bound).argmax())
        assert bool((diff <= bound).all()), (
            f"{name}: element {worst} differs by {float(diff.flatten()[worst]):.3g} > {float(bound.flatten()[worst]):.3g}"
        )
        tight += int((bound <= 1e-6).sum())
        total += bound.numel()
    assert tight >= 0.5 * total, f"only {tight} of {total} weights held to 1e-6: the comparison would say little"


def _assert_same_stats(got: dict[str, float], want: dict[str, float]) -> None:
    for key in ("loss", "grad_norm", "entropy"):
        assert got[key] == pytest.approx(want[key], rel=REL_TOL), key


def test_tensor_parallel_2_over_two_processes_equals_tp_1(reference: Path) -> None:
    _run_ranks("tp2", reference, world_size=2)
    one = load_file(reference / "qwen2.safetensors")
    two = load_file(reference / "tp2.safetensors")
    assert (two["logp_megatron"] - one["logp_megatron"]).abs().max() <= REL_TOL * 10
    _assert_same_stats(
        json.loads((reference / "tp2.json").read_text())["step"],
        json.loads((reference / "qwen2.json").read_text())["megatron"],
    )
    _assert_first_step_matches(one, two)
    # the TP=1 checkpoint resumed on two ranks continues as the TP=1 backend did: the same step, the same
    # log-probs after it
    resume = load_file(reference / "resume.safetensors")
    assert (two["continued_logp"] - resume["continued_logp"]).abs().max() <= REL_TOL * 10
    continued = json.loads((reference / "resume.json").read_text())
    _assert_same_stats(json.loads((reference / "tp2.json").read_text())["continued"], continued)


def test_pipeline_parallel_2_over_two_processes_equals_one_stage(reference: Path) -> None:
    _run_ranks("pp2", reference, world_size=2)
    one = load_file(reference / "gpt2.safetensors")
    two = load_file(reference / "pp2.safetensors")
    assert (two["logp_megatron"] - one["logp_megatron"]).abs().max() <= REL_TOL * 10
    _assert_same_stats(
        json.loads((reference / "pp2.json").read_text()), json.loads((reference / "gpt2.json").read_text())["megatron"]
    )
    _assert_first_step_matches(one, two)


# ---- the rank side ---------------------------------------------------------------------------------------------


def _batch(seed: int = 0) -> TrainBatch:
    rng = np.random.default_rng(seed)
    seqs = []
    for index, length in enumerate([9, 14, 6, 11]):
        mask = np.zeros(length, np.uint8)
        mask[3:] = 1
        seqs.append(
            TrainSequence(
                tokens=rng.integers(0, VOCAB, length).astype(np.int32),
                loss_mask=mask,
                behaviour_logprobs=np.where(mask == 1, -1.0, 0.0).astype(np.float32),
                versions=np.where(mask == 1, 0, -1).astype(np.int32),
                advantage=1.0 if index % 2 else -0.5,
            )
        )
    return TrainBatch(tuple(seqs))


def _loss(logp: Tensor, micro: MicroBatch, extras: LossExtras) -> tuple[Tensor, dict[str, float]]:
    """Advantage-weighted log-likelihood over the minibatch's loss tokens (the loss_fn contract)."""
    weighted = torch.where(micro.loss_mask, logp * micro.advantages, 0.0)
    return -weighted.sum() / extras.minibatch_loss_tokens, {"tokens": float(micro.loss_mask.sum())}


def _megatron(model: torch.nn.Module, tp_size: int = 1, pp_size: int = 1) -> TrainingBackend:
    from actors.trainer.backends.megatron import MegatronBackend

    return MegatronBackend(model, tensor_parallel_size=tp_size, pipeline_parallel_size=pp_size, **_options())


def _options() -> dict[str, object]:
    """What both backends are built with: fp32 (no autocast) on the rank's device."""
    device = os.environ.get(DEVICE_ENV, "cpu")
    return {
        "lr": LR,
        "grad_clip": 1.0,
        "micro_batch_tokens": 40,
        "temperature": TEMPERATURE,
        "device": device,
        "autocast": False,
    }


def _flat_logprobs(backend: TrainingBackend, batch: TrainBatch) -> Tensor:
    return torch.from_numpy(np.concatenate(backend.logprobs(batch)))


def _rank_reference(out: Path) -> None:
    from actors.trainer.backends.checkpoint import decode_checkpoint, encode_checkpoint
    from actors.trainer.backends.torch_backend import TorchBackend

    batch = _batch()
    for family, model in [("gpt2", build_model("tiny-gpt2-2x64", vocab_size=VOCAB, seed=0)), ("qwen2", _qwen2())]:
        torch_backend = TorchBackend(copy.deepcopy(model), packing=False, **_options())  # type: ignore[arg-type]
        megatron = _megatron(model)
        tensors = {f"before/{k}": v.clone() for k, v in model.state_dict().items()}
        tensors["logp_torch"] = _flat_logprobs(torch_backend, batch)
        tensors["logp_megatron"] = _flat_logprobs(megatron, batch)
        stats = {}
        for name, backend in (("torch", torch_backend), ("megatron", megatron)):
            stats[name] = _stats(backend.train_step(batch, _loss))
            tensors.update({f"after_{name}/{k}": v for k, v in backend.export_weights(torch.float32).items()})
        save_file({k: v.contiguous() for k, v in tensors.items()}, out / f"{family}.safetensors")
        (out / f"{family}.json").write_text(json.dumps(stats))
    # qwen2's megatron backend has taken one step: checkpoint it, step on, and step on from the checkpoint
    files = encode_checkpoint(megatron.state_tensors(), {"backend": megatron.state_meta()})
    for name, data in files.items():
        (out / f"ckpt-{name}").write_bytes(data)
    step = megatron.train_step(_batch(1), _loss)
    resumed = _megatron(_qwen2(seed=5))
    saved, meta = decode_checkpoint(files)
    resumed.load_state(saved, meta["backend"])
    resumed.train_step(_batch(1), _loss)
    result = {f"continued/{k}": v for k, v in megatron.export_weights(torch.float32).items()}
    result.update({f"resumed/{k}": v for k, v in resumed.export_weights(torch.float32).items()})
    result["continued_logp"] = _flat_logprobs(megatron, batch)
    save_file(result, out / "resume.safetensors")
    (out / "resume.json").write_text(json.dumps(_stats(step)))


def _stats(result: Any) -> dict[str, float]:
    """What a step reports that TP and PP must preserve."""
    return {"loss": result.loss, "grad_norm": result.grad_norm, "entropy": result.entropy_mean}


def _rank_tp2(out: Path) -> None:
    from actors.trainer.backends.checkpoint import decode_checkpoint

    batch = _batch()
    megatron = _megatron(_qwen2(), tp_size=2)
    tensors = {"logp_megatron": _flat_logprobs(megatron, batch)}
    stats = {"step": _stats(megatron.train_step(batch, _loss))}
    tensors.update({f"after_megatron/{k}": v for k, v in megatron.export_weights(torch.float32).items()})
    files = {p.name.removeprefix("ckpt-"): p.read_bytes() for p in out.glob("ckpt-*")}
    saved, meta = decode_checkpoint(files)
    megatron.load_state(saved, meta["backend"])
    stats["continued"] = _stats(megatron.train_step(_batch(1), _loss))
    tensors["continued_logp"] = _flat_logprobs(megatron, batch)
    if int(os.environ["RANK"]) == 0:
        save_file(tensors, out / "tp2.safetensors")
        (out / "tp2.json").write_text(json.dumps(stats))


def _rank_pp2(out: Path) -> None:
    """GPT-2 (2 layers, untied) over two pipeline stages: log-probs, one step, the exported weights."""
    batch = _batch()
    megatron = _megatron(build_model("tiny-gpt2-2x64", vocab_size=VOCAB, seed=0), pp_size=2)
    tensors = {"logp_megatron": _flat_logprobs(megatron, batch)}
    result = megatron.train_step(batch, _loss)
    tensors.update({f"after_megatron/{k}": v for k, v in megatron.export_weights(torch.float32).items()})
    if int(os.environ["RANK"]) == 0:
        save_file(tensors, out / "pp2.safetensors")
        (out / "pp2.json").write_text(json.dumps(_stats(result)))


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode, out_dir = sys.argv[1], Path(sys.argv[2])
    {"reference": _rank_reference, "tp2": _rank_tp2, "pp2": _rank_pp2}[mode](out_dir)
    from actors.trainer.distributed import leave_rank_group

    torch.distributed.barrier()  # no rank tears its groups down under a peer still in the last collective
    leave_rank_group()
