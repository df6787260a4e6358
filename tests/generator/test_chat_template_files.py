"""A checkpoint's chat template is found where the installed transformers saves it: `save_pretrained` writes
``chat_template.jinja`` and no ``chat_template`` key in ``tokenizer_config.json``. A checkpoint saved that way
serves chat turns through the generator's endpoint and the real ``openai`` client, and a generator without the
checkpoint renders with the same template from the run's files in the store. Where ``model.tokenizer`` is
another directory than the checkpoint, its template is the one both roles use."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from actors.generator.runtime import build_engine, open_endpoint, sampling_params
from actors.model_files import fetch_model_files, local_config, needs_model_files, publish_model_files
from actors.models import build_policy_model, chat_template_in, load_chat_template_for, load_tokenizer
from actors.trainer.sessions import build_weight_publisher
from pipeline.config import LeewayConfig, load_config
from pipeline.tasks import task_for
from pipeline.tasks.chat_tokenizer import load_chat_template_text, load_chat_tokenizer
from storage.filestore import FileStore

TOKENIZER = load_chat_tokenizer()
TEMPLATE = load_chat_template_text()
OTHER_TEMPLATE = "{#- the checkpoint's own -#}" + TEMPLATE
"""Another template text (it renders the same), to tell which file a role read."""
MESSAGES = [{"role": "user", "content": "12>"}]


def _save_tokenizer(directory: Path, template: str, *, jinja_file: bool = True) -> None:
    """The tokenizer and its chat template as transformers saves them (``jinja_file=False``: as older releases
    did, a ``chat_template`` key in tokenizer_config.json)."""
    hf = PreTrainedTokenizerFast(tokenizer_object=TOKENIZER, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    hf.chat_template = template
    hf.save_pretrained(directory, save_jinja_files=jinja_file)


def _checkpoint(directory: Path, template: str = TEMPLATE) -> Path:
    """A random-init Llama and its tokenizer, each saved by the installed transformers' `save_pretrained`."""
    torch.manual_seed(3)
    config = LlamaConfig(
        vocab_size=TOKENIZER.get_vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        max_position_embeddings=128,
        pad_token_id=TOKENIZER.token_to_id("<pad>"),
        bos_token_id=TOKENIZER.token_to_id("<bos>"),
        eos_token_id=TOKENIZER.token_to_id("<eos>"),
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    _save_tokenizer(directory, template)
    return directory


def _cfg(checkpoint: Path, tokenizer: Path | None = None) -> LeewayConfig:
    return load_config(
        None,
        [
            "run.name=chat-files",
            f"run.dir={checkpoint.parent / 'run'}",
            f"model.name_or_path={checkpoint}",
            f"model.tokenizer={tokenizer or checkpoint}",
            "model.dtype=float32",
            "engine.sampling.max_new_tokens=4",
        ],
        environ={},
    )


def test_transformers_saves_the_template_as_chat_template_jinja(tmp_path: Path) -> None:
    """The premise: what today's transformers writes, which a reader of tokenizer_config.json alone misses."""
    checkpoint = _checkpoint(tmp_path / "ckpt")
    assert (checkpoint / "chat_template.jinja").read_text() == TEMPLATE
    assert "chat_template" not in json.loads((checkpoint / "tokenizer_config.json").read_text())
    assert chat_template_in(checkpoint) == TEMPLATE


def test_the_jinja_file_wins_over_the_config_key_and_the_processor_file_comes_last(tmp_path: Path) -> None:
    """transformers' precedence: its tokenizer loader prefers chat_template.jinja to tokenizer_config.json's key;
    chat_template.json (a processor's) is read only where neither holds one."""
    directory = tmp_path / "tok"
    directory.mkdir()
    (directory / "chat_template.json").write_text(json.dumps({"chat_template": "processor"}))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    assert chat_template_in(directory) == "processor"
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": "config key"}))
    assert chat_template_in(directory) == "config key"
    (directory / "chat_template.jinja").write_text("jinja file")
    assert chat_template_in(directory) == "jinja file"
    assert chat_template_in(tmp_path) is None


def test_a_checkpoint_saved_by_transformers_serves_a_chat_turn_through_the_endpoint(tmp_path: Path) -> None:
    cfg = _cfg(_checkpoint(tmp_path / "ckpt"))
    task = task_for(cfg)
    tokenizer = load_tokenizer(cfg, task)
    engine = build_engine(cfg, tokenizer, "gen-chat")
    engine.load_state(dict(engine.model.state_dict()), 0)  # type: ignore[attr-defined]

    async def main() -> None:
        service, endpoint, key = await open_endpoint(cfg, engine, tokenizer, task, sampling_params(cfg, tokenizer))
        client = openai.AsyncOpenAI(base_url=f"{endpoint.url}/v1", api_key=key, max_retries=0)
        try:
            assert service.template is not None and service.template.template == TEMPLATE
            r = await client.chat.completions.create(
                model=cfg.run.name, messages=MESSAGES, seed=1, extra_body={"return_token_ids": True}
            )
            assert r.model_extra["prompt_token_ids"] == service.template.render(MESSAGES)
            assert r.choices[0].model_extra["policy_versions"] == [0] * len(r.choices[0].model_extra["token_ids"])
        finally:
            await client.close()
            await endpoint.stop()

    asyncio.run(main())


def _publish_version_0(store: FileStore, cfg: LeewayConfig) -> None:
    """The trainer's version 0: a generator checks the store's config.json against its tensor shapes."""
    model = build_policy_model(cfg, load_tokenizer(cfg))
    publisher = build_weight_publisher(cfg, store, model)
    publisher.publish(0, {k: v.detach().clone() for k, v in model.state_dict().items()})
    publisher.close()


def test_a_generator_without_the_checkpoint_reads_the_template_from_the_store(tmp_path: Path) -> None:
    checkpoint = _checkpoint(tmp_path / "ckpt")
    cfg = _cfg(checkpoint)
    with FileStore(tmp_path / "store") as store:
        published = publish_model_files(store, cfg)  # the trainer
        assert published is not None and "chat_template.jinja" in published.files
        _publish_version_0(store, cfg)
        checkpoint.rename(tmp_path / "elsewhere")  # the generator's machine has no such directory
        assert needs_model_files(cfg)
        local = local_config(cfg, fetch_model_files(store, cfg, tmp_path / "generator" / "model", wait_s=5))
    template = load_chat_template_for(local, load_tokenizer(local))
    assert template is not None and template.template == TEMPLATE


def test_a_tokenizer_directory_apart_from_the_checkpoint_gives_both_roles_its_template(tmp_path: Path) -> None:
    """The checkpoint's own template (another one, in chat_template.jinja) is not what the trainer renders with:
    the store carries model.tokenizer's (in its tokenizer_config.json), and not the checkpoint's jinja file, which
    would win in the generator's copy."""
    checkpoint = _checkpoint(tmp_path / "ckpt", template=OTHER_TEMPLATE)
    tokenizer_dir = tmp_path / "tokenizer"
    _save_tokenizer(tokenizer_dir, TEMPLATE, jinja_file=False)
    assert not (tokenizer_dir / "chat_template.jinja").exists()
    cfg = _cfg(checkpoint, tokenizer_dir)
    trainer_template = load_chat_template_for(cfg, load_tokenizer(cfg))
    assert trainer_template is not None and trainer_template.template == TEMPLATE
    with FileStore(tmp_path / "store") as store:
        publish_model_files(store, cfg)
        _publish_version_0(store, cfg)
        checkpoint.rename(tmp_path / "elsewhere")
        local = local_config(cfg, fetch_model_files(store, cfg, tmp_path / "generator" / "model", wait_s=5))
    generator_template = load_chat_template_for(local, load_tokenizer(local))
    assert generator_template is not None and generator_template.template == TEMPLATE
