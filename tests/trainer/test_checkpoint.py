"""Checkpoint bytes: safetensors + JSON round trip, integrity checks, and bit-exact resume of the torch backend."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load as st_load
from torch import Tensor

from actors.models import build_model
from actors.trainer.backends import (
    CheckpointError,
    LossExtras,
    MicroBatch,
    TrainBatch,
    TrainSequence,
    decode_checkpoint,
    encode_checkpoint,
)
from actors.trainer.backends.torch_backend import TorchBackend

VOCAB = 32


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _backend(seed: int) -> TorchBackend:
    return TorchBackend(
        build_model("tiny-llama-2x64", vocab_size=VOCAB, seed=seed), lr=1e-2, weight_decay=0.01, micro_batch_tokens=20
    )


def _batch(seed: int) -> TrainBatch:
    rng = np.random.default_rng(seed)
    seqs = []
    for length in (7, 11, 5, 9):
        mask = (np.arange(length) >= 2).astype(np.uint8)
        seqs.append(
            TrainSequence(
                rng.integers(0, VOCAB, length).astype(np.int32),
                mask,
                np.full(length, -1.0, np.float32),
                np.zeros(length, np.int32),
                advantage=float(rng.normal()),
            )
        )
    return TrainBatch(tuple(seqs))


def _pg_loss(logp: Tensor, micro: MicroBatch, extras: LossExtras) -> tuple[Tensor, dict[str, float]]:
    loss = -(torch.where(micro.loss_mask, logp, 0.0) * micro.advantages).sum() / extras.minibatch_loss_tokens
    return loss, {}


def _draws() -> tuple[list[float], list[float], float]:
    return torch.rand(4).tolist(), np.random.rand(4).tolist(), random.random()


def test_encode_decode_round_trips_tensors_and_meta() -> None:
    tensors = {
        "model/a.weight": torch.randn(3, 4),
        "model/b": torch.arange(5, dtype=torch.int64),
        "optimizer/a.weight/exp_avg": torch.randn(3, 4).t(),
        "rng/torch_cpu": torch.get_rng_state(),
    }
    meta = {"trainer": {"version": 40, "group_ids": ["g1", "g2"], "seq": 123}, "lr": 1e-3}
    files = encode_checkpoint(tensors, meta)
    assert set(files) == {"model.safetensors", "optimizer.safetensors", "rng.safetensors", "meta.json"}
    assert set(st_load(files["model.safetensors"])) == {"a.weight", "b"}  # an ordinary HF-style weight file
    decoded, decoded_meta = decode_checkpoint(files)
    assert decoded_meta == meta and decoded.keys() == tensors.keys()
    for key, tensor in tensors.items():
        assert torch.equal(decoded[key], tensor) and decoded[key].dtype == tensor.dtype, key


def test_no_file_is_a_pickle() -> None:
    files = encode_checkpoint({"model/w": torch.ones(2)}, {"x": 1})
    json.loads(files["meta.json"])
    for name, data in files.items():
        assert not data.startswith(b"\x80"), name  # pickle protocol 2+ opcode
    root = Path(__file__).resolve().parents[2]
    sources = [p for package in ("actors", "pipeline", "storage", "infra") for p in (root / package).rglob("*.py")]
    assert len(sources) > 50, "the scan must see the source tree"
    unpickling = re.compile(r"^\s*(import|from)\s+(pickle|cloudpickle|dill)\b|(?<![.\w])torch\.(save|load)\(", re.M)
    pickling = [str(p.relative_to(root)) for p in sources if unpickling.search(p.read_text())]
    assert not pickling, pickling


@pytest.mark.parametrize("damage", ["missing", "corrupt", "format"])
def test_damaged_checkpoint_is_refused_naming_the_file(damage: str) -> None:
    files = encode_checkpoint({"model/w": torch.ones(4), "optimizer/w/step": torch.tensor(3.0)}, {})
    if damage == "missing":
        del files["optimizer.safetensors"]
    elif damage == "corrupt":
        files["model.safetensors"] = files["model.safetensors"][:-1] + b"\x01"
    else:
        header = json.loads(files["meta.json"])
        header["checkpoint_format"] = 99
        files["meta.json"] = json.dumps(header).encode()
    with pytest.raises(CheckpointError, match=r"optimizer\.safetensors|model\.safetensors|checkpoint_format"):
        decode_checkpoint(files)


def test_bad_keys_and_non_json_meta_are_refused() -> None:
    with pytest.raises(ValueError, match="group"):
        encode_checkpoint({"no_group": torch.ones(1)}, {})
    with pytest.raises(ValueError, match="NaN"):
        encode_checkpoint({}, {"loss": float("nan")})
    with pytest.raises(ValueError, match="set"):
        encode_checkpoint({}, {"ids": {"a"}})


def test_resume_reproduces_the_next_step_bit_for_bit_and_restores_rng() -> None:
    original = _backend(seed=0)
    original.train_step(_batch(1), _pg_loss)  # optimizer state exists (step 1, moments)
    files = encode_checkpoint(original.state_tensors(), {"backend": original.state_meta()})
    after_save = _draws()
    original.train_step(_batch(2), _pg_loss)
    expected = {n: p.detach().clone() for n, p in original.model.named_parameters()}

    resumed = _backend(seed=123)  # different initial weights: everything must come from the checkpoint
    tensors, meta = decode_checkpoint(files)
    resumed.load_state(tensors, meta["backend"])
    assert _draws() == after_save
    resumed.train_step(_batch(2), _pg_loss)
    for name, param in resumed.model.named_parameters():
        assert torch.equal(param, expected[name]), name
    state_a, state_b = original.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    for index, entry in state_a.items():
        for key, value in entry.items():
            assert torch.equal(state_b[index][key], value), (index, key)


def test_state_keys_are_parameter_names() -> None:
    backend = _backend(seed=0)
    backend.train_step(_batch(1), _pg_loss)
    keys = backend.state_tensors().keys()
    names = [n for n, _ in backend.model.named_parameters()]
    assert {f"model/{n}" for n in names} <= keys
    assert {f"optimizer/{n}/{s}" for n in names for s in ("step", "exp_avg", "exp_avg_sq")} <= keys
    assert "rng/torch_cpu" in keys


def test_loading_a_checkpoint_of_another_shape_is_refused() -> None:
    small = _backend(seed=0)
    big = TorchBackend(build_model("tiny-llama-1x32", vocab_size=VOCAB, seed=0), lr=1e-2)
    with pytest.raises(ValueError, match="model tensors do not match|shape"):
        big.load_state(small.state_tensors(), small.state_meta())
