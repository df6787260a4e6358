"""Checkpoints carried by the store: a trainer started on a local checkpoint directory publishes the model's files,
and a generator that cannot see that directory builds the model from them alone; its version-0 weights equal the
trainer's bit for bit (Llama with GQA and tied embeddings, Qwen2, Qwen3, each with a tokenizer and a chat
template). A generator whose spec is not the run's, and a trainer that brings other files to a run, are refused
naming the field or the file; so is a hostile model manifest in a real store (code files, paths, files over their
caps, an auto_map to the checkpoint's own code, config dimensions the published weights do not hold), before
anything is built, and a terminal's "y" never runs a checkpoint's code."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen2Config, Qwen3Config

from actors import model_files
from actors.generator.runtime import build_engine
from actors.model_files import (
    MAX_CONFIG_BYTES,
    MAX_MODEL_FILE_BYTES,
    ModelFiles,
    ModelFilesError,
    fetch_model_files,
    local_config,
    model_prefix,
    needs_model_files,
    publish_model_files,
)
from actors.models import build_policy_model, load_chat_template_for, load_tokenizer
from actors.trainer.sessions import build_weight_publisher
from infra.stack import StackState
from pipeline.config import LeewayConfig, load_config
from pipeline.tasks import get_task
from pipeline.tasks.char_tokenizer import load_char_tokenizer
from pipeline.tasks.chat_tokenizer import load_chat_template_text
from storage.filestore import FileStore
from storage.manifest import Manifest, manifest_key
from storage.subscriber import WeightSubscriber
from tests.support.builders import trainer_cfg
from tests.support.runs import leeway_argv
from tests.support.stores import s3_store

TOKENIZER = load_char_tokenizer()
SHAPE = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}


def _config(family: str) -> PretrainedConfig:
    ids = {"vocab_size": TOKENIZER.get_vocab_size(), "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    common = {**SHAPE, **ids, "intermediate_size": 64, "max_position_embeddings": 128}
    if family == "llama":
        return LlamaConfig(**common, tie_word_embeddings=True)
    if family == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=False)
    return Qwen3Config(**common, head_dim=8, tie_word_embeddings=True)


def _checkpoint(directory: Path, family: str) -> Path:
    """A random-init checkpoint saved the Hugging Face way, with its tokenizer and a chat template."""
    torch.manual_seed(11)
    AutoModelForCausalLM.from_config(_config(family)).save_pretrained(directory)
    TOKENIZER.save(str(directory / "tokenizer.json"))
    config = {"chat_template": load_chat_template_text(), "eos_token": "<eos>", "bos_token": "<bos>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def _cfg(checkpoint: Path, *overrides: str) -> LeewayConfig:
    return load_config(
        None,
        [
            "run.name=files",
            f"model.name_or_path={checkpoint}",
            f"model.tokenizer={checkpoint}",
            "model.dtype=float32",
            *overrides,
        ],
        environ={},
    )


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_a_generator_without_the_checkpoint_builds_from_the_store_and_holds_version_0_bit_for_bit(
    tmp_path: Path, family: str
) -> None:
    checkpoint = _checkpoint(tmp_path / "ckpt", family)
    cfg = _cfg(checkpoint)
    task = get_task(cfg.task.name, **cfg.task.args)
    with FileStore(tmp_path / "store") as store:
        published = publish_model_files(store, cfg)  # the trainer
        assert published is not None and "config.json" in published.files and "tokenizer.json" in published.files
        trainer_model = build_policy_model(cfg, load_tokenizer(cfg, task))
        publisher = build_weight_publisher(cfg, store, trainer_model)
        publisher.publish(0, {k: v.detach().clone() for k, v in trainer_model.state_dict().items()})
        publisher.close()
        checkpoint.rename(tmp_path / "elsewhere")  # the generator's machine has no such directory
        assert needs_model_files(cfg)
        fetched = fetch_model_files(store, cfg, tmp_path / "generator-home" / "model", wait_s=5)
        local = local_config(cfg, fetched)
        tokenizer = load_tokenizer(local, task)
        assert tokenizer.to_str() == TOKENIZER.to_str()
        template = load_chat_template_for(local, tokenizer, task)
        assert template is not None and template.template == load_chat_template_text()
        engine = build_engine(local, tokenizer, "gen", fetched)
        subscriber = WeightSubscriber(store, cfg.run.name)
        engine.load_state(subscriber.tensors if subscriber.pull(0) == 0 else {}, 0)
    expected = AutoModelForCausalLM.from_pretrained(tmp_path / "elsewhere", local_files_only=True).state_dict()
    held = engine.model.state_dict()  # type: ignore[attr-defined]
    assert held.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(held[name], tensor), name
    assert type(engine.model).__name__ == type(trainer_model).__name__  # type: ignore[attr-defined]


def test_a_generator_with_another_spec_and_a_trainer_with_other_files_are_refused(tmp_path: Path) -> None:
    checkpoint = _checkpoint(tmp_path / "ckpt", "llama")
    with FileStore(tmp_path / "store") as store:
        publish_model_files(store, _cfg(checkpoint))
        assert publish_model_files(store, _cfg(checkpoint)) is not None  # the same trainer again: nothing new
        with pytest.raises(ModelFilesError, match=r"model.revision = 'v2', but run 'files' trains None"):
            fetch_model_files(store, _cfg(checkpoint, "model.revision=v2"), tmp_path / "g", wait_s=5)
        other = _checkpoint(tmp_path / "other", "qwen2")
        with pytest.raises(ModelFilesError, match="model.name_or_path"):
            publish_model_files(store, _cfg(other))
        (checkpoint / "config.json").write_text((other / "config.json").read_text())  # same path, another model
        with pytest.raises(ModelFilesError, match=r"files/model/config.json: the run's copy differs"):
            publish_model_files(store, _cfg(checkpoint))
    with FileStore(tmp_path / "empty") as empty, pytest.raises(ModelFilesError, match="no model files under"):
        fetch_model_files(empty, _cfg(tmp_path / "nowhere"), tmp_path / "g2", wait_s=0.2, poll_s=0.05)


def test_a_trainer_on_a_checkpoint_and_a_generator_without_it_train_together(stack: StackState, tmp_path: Path) -> None:
    checkpoint = _checkpoint(tmp_path / "ckpt", "llama")
    cfg = trainer_cfg(
        stack,
        tmp_path,
        f"model.name_or_path={checkpoint}",
        f"model.tokenizer={checkpoint}",
        "trainer.max_steps=3",
        "logging.level=INFO",
    )
    config_path = tmp_path / "config.yaml"
    config_path.write_text(cfg.to_yaml())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    logs = {name: tmp_path / f"{name}.log" for name in ("trainer", "generator")}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with open(logs["trainer"], "ab") as log:
            procs.append(
                subprocess.Popen(
                    leeway_argv("trainer", str(config_path)), stdout=log, stderr=subprocess.STDOUT, env=env
                )
            )
        store = s3_store(stack, "")
        deadline = time.monotonic() + 180
        while not (
            store.exists(f"{cfg.run.name}/model/manifest.json") and store.exists(f"{cfg.run.name}/weights/LATEST")
        ):
            assert procs[0].poll() is None, logs["trainer"].read_text()
            assert time.monotonic() < deadline, logs["trainer"].read_text()
            time.sleep(0.2)
        checkpoint.rename(tmp_path / "elsewhere")  # the trainer has loaded it; the generator's machine never had it
        home = tmp_path / "generator-home"
        home.mkdir()
        generator_env = dict(env, HOME=str(home), HF_HOME=str(home / "hf"), HF_HUB_OFFLINE="1")
        with open(logs["generator"], "ab") as log:
            argv = leeway_argv("generator", str(config_path), "--set", "generator.id=gen-far")
            procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=generator_env))
        assert procs[0].wait(timeout=300) == 0, logs["trainer"].read_text()
        generator_log = logs["generator"].read_text()
        assert "built the model from the run's files" in generator_log, generator_log
        assert "published the model's files" in logs["trainer"].read_text()
        records = [json.loads(line) for line in (Path(cfg.run.dir) / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if "step" in r][-1] == 3
        store.close()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=60)


HUB_CHECK = """
import json, sys
from safetensors.torch import save_file
from actors.model_files import publish_model_files
from actors.models import build_policy_model, load_chat_template_for, load_tokenizer
from pipeline.config import load_config
from storage.filestore import FileStore
repo, revision, store_dir = sys.argv[1:4]
cfg = load_config(None, ["run.name=hub", f"model.name_or_path={repo}", f"model.revision={revision}",
                         f"model.tokenizer={repo}", "model.dtype=float32"], environ={})
tokenizer = load_tokenizer(cfg)
template = load_chat_template_for(cfg, tokenizer)
model = build_policy_model(cfg, tokenizer)
with FileStore(store_dir) as store:
    files = publish_model_files(store, cfg)
save_file({k: v.clone().contiguous() for k, v in model.state_dict().items()}, store_dir + "/held.safetensors")
print(json.dumps({"vocab": tokenizer.get_vocab_size(), "template": template is not None,
                  "files": sorted(files.files), "type": type(model).__name__}))
"""


def test_a_hub_id_at_a_pinned_revision_loads_model_tokenizer_and_template_from_the_hf_cache_offline(
    tmp_path: Path,
) -> None:
    """The Hub path is the standard one (`from_pretrained` / `snapshot_download`), read here from an HF cache laid
    out as the Hub client lays it out, with HF_HUB_OFFLINE: nothing is downloaded."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    cache = tmp_path / "hf" / "hub" / "models--leeway-test--tiny-qwen3"
    _checkpoint(cache / "snapshots" / revision, "qwen3")
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text(revision)
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", HUB_CHECK, "leeway-test/tiny-qwen3", revision, str(tmp_path / "store")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["vocab"] == TOKENIZER.get_vocab_size() and result["template"]
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(result["files"])
    assert result["type"] == "Qwen3ForCausalLM"
    held = load_file(tmp_path / "store" / "held.safetensors")
    expected = AutoModelForCausalLM.from_pretrained(cache / "snapshots" / revision).state_dict()
    assert held.keys() == expected.keys() and all(torch.equal(held[k], v) for k, v in expected.items())
    missing = subprocess.run(  # another revision is not in the cache: the error names the field
        [sys.executable, "-c", HUB_CHECK, "leeway-test/tiny-qwen3", "f" * 40, str(tmp_path / "store2")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert missing.returncode != 0 and "model.tokenizer = 'leeway-test/tiny-qwen3'" in missing.stderr


# ---- a hostile model manifest: the store's files are untrusted ------------------------------------------------

EVIL_CODE = "import pathlib, sys\npathlib.Path(sys.argv[1]).write_text('ran')\n"
AUTO_MAP = {"AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilModel"}


@pytest.fixture(scope="module")
def published_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A run's store as its trainer leaves it (model files, then version 0 of a Llama checkpoint); each test
    copies it before making it hostile."""
    root = tmp_path_factory.mktemp("published")
    checkpoint = _checkpoint(root / "ckpt", "llama")
    cfg = _cfg(checkpoint)
    with FileStore(root / "store") as store:
        publish_model_files(store, cfg)
        model = build_policy_model(cfg, load_tokenizer(cfg, get_task(cfg.task.name, **cfg.task.args)))
        publisher = build_weight_publisher(cfg, store, model)
        publisher.publish(0, {k: v.detach().clone() for k, v in model.state_dict().items()})
        publisher.close()
    return checkpoint, root / "store"


HOSTILE = {
    "code-file": ({"configuration_evil.py": EVIL_CODE.encode()}, r"'configuration_evil.py', which is not one of"),
    "modeling-file": ({"modeling_evil.py": EVIL_CODE.encode()}, r"'modeling_evil.py', which is not one of"),
    "parent-path": ({"../weights/LATEST": b"{}"}, r"'\.\./weights/LATEST', which is not one of"),
    "absolute-path": ({"/etc/passwd": b""}, r"'/etc/passwd', which is not one of"),
    "sub-directory": ({"sub/tokenizer.json": b"{}"}, r"'sub/tokenizer.json', which is not one of"),
    "auto-map-and-its-code": (
        {"config.json": {"model_type": "leeway_evil", "auto_map": AUTO_MAP}, "configuration_evil.py": b"x"},
        r"'configuration_evil.py', which is not one of",
    ),
    "auto-map": ({"config.json": {"model_type": "leeway_evil", "auto_map": AUTO_MAP}}, r"model_type.*auto_map"),
    "huge-config": ({"config.json": {"padding": " " * MAX_CONFIG_BYTES}}, r"config.json: \d+ bytes, over the cap"),
    "huge-tokenizer": ({"tokenizer.json": b"x" * (MAX_MODEL_FILE_BYTES + 1)}, r"tokenizer.json: \d+ bytes, over"),
    "huge-vocab": ({"config.json": {"vocab_size": 2**34}}, r"vocab_size = 17179869184, but the run's weights hold"),
    "huge-hidden": ({"config.json": {"hidden_size": 2**16}}, r"hidden_size = 65536, but"),
    "many-layers": ({"config.json": {"num_hidden_layers": 4096}}, r"num_hidden_layers = 4096, but"),
    "wide-mlp": ({"config.json": {"intermediate_size": 2**30}}, r"intermediate_size = 1073741824 give model\.layers"),
    "many-experts": ({"config.json": {"model_type": "qwen3_moe", "num_experts": 10**6}}, r"num_experts = 1000000"),
    "not-json": ({"config.json": b"{"}, r"config.json: not JSON"),
}
"""Each case: the files it writes beside the trainer's (a dict for config.json: keys changed in the trainer's
config), and the error it must be refused with."""


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_model_manifest_is_refused_before_anything_is_built(
    tmp_path: Path, published_run: tuple[Path, Path], case: str
) -> None:
    """Names outside the known files (code, paths), files over their cap, an auto_map to the checkpoint's own
    code, and config dimensions the weights do not hold (a `config.json` that once made a generator allocate
    768 GiB before any hash was checked) are each refused naming the file, cap or field; nothing is written."""
    checkpoint, template = published_run
    shutil.copytree(template, tmp_path / "store")
    cfg = _cfg(checkpoint)
    files, expected = HOSTILE[case]
    with FileStore(tmp_path / "store") as store:
        prefix = model_prefix(cfg.run.name)
        manifest = ModelFiles.parse(store.get(prefix + "manifest.json"), "manifest.json")
        digests = dict(manifest.files)
        for name, content in files.items():
            if isinstance(content, dict):  # the trainer's config.json with these keys changed
                content = json.dumps({**json.loads(store.get(prefix + "config.json")), **content}).encode()
            digests[name] = hashlib.sha256(content).hexdigest()
            if ".." not in name and not name.startswith("/"):
                store.put(prefix + name, content)
        store.put(prefix + "manifest.json", ModelFiles(manifest.spec, digests).to_json())
        into = tmp_path / "generator" / "model"
        with pytest.raises(ModelFilesError, match=expected):
            fetch_model_files(store, cfg, into, wait_s=5)
    assert not into.exists()


def test_the_model_files_are_capped_together(
    tmp_path: Path, published_run: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint, template = published_run
    shutil.copytree(template, tmp_path / "store")
    monkeypatch.setattr(model_files, "MAX_MODEL_FILES_BYTES", 1000)  # the trainer's files are a few KiB together
    with FileStore(tmp_path / "store") as store, pytest.raises(ModelFilesError, match="over the cap of 1000 bytes"):
        fetch_model_files(store, _cfg(checkpoint), tmp_path / "g", wait_s=5)


def test_a_weight_manifest_claiming_tensors_the_store_does_not_hold_is_refused_with_its_matching_config(
    tmp_path: Path, published_run: tuple[Path, Path]
) -> None:
    """The config is checked against the weight manifest's shapes, so a hostile pair (a manifest and a config that
    agree on a vocabulary of 2^34) would pass that check; the shapes must be backed by the full snapshot's bytes in
    the store, and a few KiB of parts do not back 2^34 x hidden_size floats."""
    checkpoint, template = published_run
    shutil.copytree(template, tmp_path / "store")
    cfg = _cfg(checkpoint)
    vocab = 2**34
    with FileStore(tmp_path / "store") as store:
        key = manifest_key(cfg.run.name, 0)
        weights = Manifest.from_json(store.get(key), key=key)
        embedding = next(t for t in weights.tensors if t.name.endswith("embed_tokens.weight"))
        grown = tuple(
            dataclasses.replace(t, shape=(vocab, *t.shape[1:])) if t.shape[0] == embedding.shape[0] else t
            for t in weights.tensors
        )
        store.put(key, dataclasses.replace(weights, tensors=grown).to_json())
        prefix = model_prefix(cfg.run.name)
        config = json.dumps({**json.loads(store.get(prefix + "config.json")), "vocab_size": vocab}).encode()
        store.put(prefix + "config.json", config)
        manifest = ModelFiles.parse(store.get(prefix + "manifest.json"), "manifest.json")
        digests = {**manifest.files, "config.json": hashlib.sha256(config).hexdigest()}
        store.put(prefix + "manifest.json", ModelFiles(manifest.spec, digests).to_json())
        into = tmp_path / "generator" / "model"
        stored = sum(store.size(part.key) for part in weights.parts)
        with pytest.raises(
            ModelFilesError,
            match=rf"v0+/manifest.json: its tensors claim \d+ bytes, but its parts in the store hold {stored}",
        ):
            fetch_model_files(store, cfg, into, wait_s=5)
        assert not into.exists()
        store.put(key, weights.to_json())  # the honest manifest: the same config is then refused by its shapes
        with pytest.raises(ModelFilesError, match=rf"vocab_size = {vocab}, but the run's weights hold"):
            fetch_model_files(store, cfg, into, wait_s=5)


BUILD_FROM_EVIL = """
import sys
from pathlib import Path
from actors.models import build_model
try:
    build_model("evil", vocab_size=8, seed=0, config_dir=Path(sys.argv[1]))
except ValueError as exc:
    print("refused:", exc)
"""


def test_a_config_with_auto_map_never_runs_its_code_even_when_a_terminal_answers_yes(tmp_path: Path) -> None:
    """transformers asks on stdin whether to run a checkpoint's own code; Leeway never lets it ask."""
    directory = tmp_path / "model"
    directory.mkdir()
    sentinel = tmp_path / "the-code-ran"
    (directory / "config.json").write_text(json.dumps({"model_type": "leeway_evil", "auto_map": AUTO_MAP}))
    for module in ("configuration_evil.py", "modeling_evil.py"):
        (directory / module).write_text(EVIL_CODE.replace("sys.argv[1]", repr(str(sentinel))))
    done = subprocess.run(
        [sys.executable, "-c", BUILD_FROM_EVIL, str(directory)],
        input="y\ny\ny\n",
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert not sentinel.exists(), done.stdout + done.stderr
    assert "refused:" in done.stdout and "auto_map" in done.stdout, done.stdout + done.stderr
