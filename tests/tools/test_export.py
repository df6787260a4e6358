"""`leeway export`: a published version rebuilt from the store (full snapshot + deltas) as a Hugging Face checkpoint.

One real trainer run on the session stack (tiny-llama, fp32, 4 steps, `weights.full_every=4`: full snapshots at
versions 0 and 4, deltas between; checkpoints at steps 2 and 4; `trainer.export_every=3`) backs the module:
- version 2, between the two snapshots, exported by the real command, loads in plain transformers
  (`AutoModelForCausalLM`, `AutoTokenizer`) and decodes as Leeway's torch engine holding version 2 does (greedy
  replies equal, sampled log-probs within fp32 tolerance); its tensors equal the trainer's checkpoint of version 2
  bit for bit; it is sharded with an index when asked;
- an unknown version and a directory holding other files are refused, naming them, with nothing written;
- a corrupted delta in the chain fails naming the version and the tensor, and leaves nothing in DIR;
- `trainer.export_every=3` left version 3 under `<run.dir>/exports/`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.cli import main as leeway
from actors.generator.runtime import build_engine, sampling_params
from actors.models import load_tokenizer
from actors.servers import open_run_store
from actors.tools.evaluate import exported_from
from actors.trainer.checkpoints import load_checkpoint
from actors.trainer.export_every import export_dir
from infra.stack import StackState
from pipeline.config import LeewayConfig
from pipeline.rl.engine_records import GenerateRequest
from pipeline.tasks import get_task
from storage.manifest import manifest_key
from storage.subscriber import WeightSubscriber
from tests.support.builders import make_group, publish_groups, run_trainer, trainer_cfg

EXPORTED = 2
"""A delta version between the full snapshots 0 and 4, with a trainer checkpoint of its own (step 2)."""
PROMPTS = ["1234>", "98>", "5>"]
LOGPROB_ATOL = 1e-5


@pytest.fixture(scope="module")
def trained(stack: StackState, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LeewayConfig, Path]]:
    """The run (see the module docstring) and its config file, as `leeway export` reads it."""
    tmp = tmp_path_factory.mktemp("export")
    cfg = trainer_cfg(
        stack,
        tmp,
        "trainer.max_steps=4",
        "weights.full_every=4",
        "trainer.checkpoint_every=2",
        "trainer.export_every=3",
        "engine.sampling.max_new_tokens=6",
    )
    groups = [make_group(f"g{i}", version=i // 2) for i in range(8)]  # step s trains g(2s-2), g(2s-1) at V s-1
    asyncio.run(publish_groups(cfg, groups))
    asyncio.run(run_trainer(cfg))
    path = tmp / "config.yaml"
    path.write_text(cfg.to_yaml())
    yield cfg, path


def _export(config: Path, out: Path, *extra: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = leeway(["export", str(config), "--to", str(out), *extra])
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


def _manifest(cfg: LeewayConfig, version: int) -> dict[str, Any]:
    store = open_run_store(cfg)
    try:
        return json.loads(store.get(manifest_key(cfg.run.name, version)))
    finally:
        store.close()


def _engine_at(cfg: LeewayConfig, version: int) -> Any:
    tokenizer = load_tokenizer(cfg, get_task(cfg.task.name, **cfg.task.args))
    engine = build_engine(cfg, tokenizer, "export-test")
    store = open_run_store(cfg)
    with WeightSubscriber(store, cfg.run.name) as subscriber:
        subscriber.pull(version)
        engine.load_state(subscriber.tensors, version)
    store.close()
    return engine, tokenizer


def test_a_version_between_snapshots_loads_in_transformers_and_decodes_as_the_engine(
    trained: tuple[LeewayConfig, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg, config = trained
    assert _manifest(cfg, EXPORTED)["kind"] == "delta" and _manifest(cfg, 4)["kind"] == "full"
    out = tmp_path / "policy"
    rc, text = _export(config, out, "--version", str(EXPORTED), "--max-shard-size", "40KB", capsys=capsys)
    assert rc == 0, text
    assert "applied version 2 (delta" in text, text  # progress, one line per version of the chain
    info = json.loads((out / "leeway.json").read_text())
    assert (info["run"], info["version"], info["step"], info["chain"]) == (cfg.run.name, 2, 2, [0, 1, 2])
    assert exported_from(out) == {"run": cfg.run.name, "version": 2, "step": 2}  # what `leeway eval --checkpoint` says
    assert info["dtype"] == "float32" and (out / "model.safetensors.index.json").is_file()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")], "the staging directory is gone"

    # bit for bit: the trainer's checkpoint of version 2, and the manifest's hashes
    exported: dict[str, torch.Tensor] = {}
    for shard in sorted(out.glob("model-*.safetensors")):
        exported.update(load_file(shard))
    store = open_run_store(cfg)
    state, checkpointed, _ = load_checkpoint(store, cfg.run.name, EXPORTED)
    store.close()
    assert state.version == EXPORTED
    model_tensors = {k.removeprefix("model/"): v for k, v in checkpointed.items() if k.startswith("model/")}
    assert model_tensors.keys() == exported.keys() == info["tensor_hashes"].keys()
    for name, tensor in exported.items():
        assert tensor.dtype == model_tensors[name].dtype and torch.equal(tensor, model_tensors[name]), name

    # plain transformers against Leeway's engine holding version 2
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(out)
    engine, tokenizer = _engine_at(cfg, EXPORTED)
    greedy = replace(sampling_params(cfg, tokenizer), temperature=0.0)
    sampled = sampling_params(cfg, tokenizer)
    for i, text_prompt in enumerate(PROMPTS):
        ids = tokenizer.encode(text_prompt).ids
        assert hf_tokenizer(text_prompt)["input_ids"] == ids
        (ours,) = engine.generate([GenerateRequest(ids, seed=i)], greedy)
        theirs = model.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=greedy.max_new_tokens, pad_token_id=0
        )[0, len(ids) :]
        assert ours.token_ids.tolist() == theirs.tolist()[: len(ours.token_ids)], text_prompt
        if ours.finish_reason == "stop":
            assert len(theirs) == len(ours.token_ids), "transformers stops at the same stop token"
        (drawn,) = engine.generate([GenerateRequest(ids, seed=100 + i)], sampled)
        full = torch.tensor([ids + drawn.token_ids.tolist()])
        with torch.no_grad():
            logits = model(full).logits[0, len(ids) - 1 : -1].float()
        logprobs = torch.log_softmax(logits, -1).gather(1, torch.tensor(drawn.token_ids).long()[:, None])[:, 0]
        assert torch.allclose(logprobs, torch.from_numpy(drawn.logprobs).float(), atol=LOGPROB_ATOL), text_prompt


def test_an_unknown_version_and_a_foreign_directory_are_refused(
    trained: tuple[LeewayConfig, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, config = trained
    rc, text = _export(config, tmp_path / "nope", "--version", "99", capsys=capsys)
    assert rc == 2 and "version 99" in text and "versions 0..4" in text, text
    assert not (tmp_path / "nope").exists()
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    rc, text = _export(config, foreign, capsys=capsys)
    assert rc == 2 and "notes.txt" in text and str(foreign) in text, text
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]


def test_latest_is_the_default_and_an_earlier_export_is_replaced_whole(
    trained: tuple[LeewayConfig, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, config = trained
    out = tmp_path / "policy"
    assert _export(config, out, "--version", "1", capsys=capsys)[0] == 0
    rc, text = _export(config, out, "--dtype", "bfloat16", capsys=capsys)
    assert rc == 0, text
    info = json.loads((out / "leeway.json").read_text())
    assert (info["version"], info["chain"], info["dtype"], info["published_dtype"]) == (4, [4], "bfloat16", "float32")
    assert set(info["files"]) == {p.name for p in out.iterdir()} - {"leeway.json"}
    assert next(iter(load_file(out / "model.safetensors").values())).dtype == torch.bfloat16


def test_trainer_export_every_left_its_versions_beside_the_run(trained: tuple[LeewayConfig, Path]) -> None:
    cfg, _ = trained
    exports = sorted(p.name for p in (cfg.run.run_dir / "exports").iterdir() if not p.name.startswith("."))
    assert exports == ["v00000003"]
    info = json.loads((export_dir(cfg.run.run_dir, 3) / "leeway.json").read_text())
    assert info["version"] == 3 and info["tensor_hashes"] == {
        t["name"]: t["hash"] for t in _manifest(cfg, 3)["tensors"]
    }


def test_a_corrupted_delta_fails_naming_the_version_and_tensor_and_leaves_nothing(
    trained: tuple[LeewayConfig, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Runs last: it damages version 1 of the module's run."""
    cfg, config = trained
    part = _manifest(cfg, 1)["parts"][0]
    store = open_run_store(cfg)
    data = bytearray(store.get(part["key"]))
    data[len(data) // 2] ^= 0xFF
    store.put(part["key"], bytes(data))
    store.close()
    out = tmp_path / "policy"
    rc, text = _export(config, out, "--version", str(EXPORTED), capsys=capsys)
    assert rc == 2 and "version 1" in text and part["tensors"][0] in text, text
    assert not out.exists() and list(tmp_path.iterdir()) == [], "nothing partial, no staging left behind"
