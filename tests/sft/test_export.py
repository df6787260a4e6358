"""`write_checkpoint`: a directory plain `transformers` loads with the weights bit for bit, the tokenizer with its
chat template and end-of-turn token, and a generation config that stops where the engine stops; nothing half
written is left behind, other files there are kept, and weights of another model are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.models import build_model, stop_token_ids
from actors.sft.export import write_checkpoint
from pipeline.chat.template import ChatTemplate
from pipeline.tasks.char_tokenizer import BOS_ID, EOS_ID, PAD_ID, load_char_tokenizer
from tests.support.tokenizers import chatml_tokenizer

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT = [{"role": "user", "content": "1+2?"}, {"role": "assistant", "content": "3"}]


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same_weights(directory: Path, weights: dict[str, torch.Tensor]) -> None:
    loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).state_dict()
    for name, tensor in weights.items():
        assert torch.equal(loaded[name], tensor), name


def test_a_chat_checkpoint_loads_in_transformers_with_its_template_and_stops(tmp_path: Path) -> None:
    tokenizer = chatml_tokenizer()
    template = ChatTemplate(tokenizer, CHATML, eos_token="<|im_end|>")
    model = build_model("tiny-llama-1x32", vocab_size=tokenizer.get_vocab_size(), seed=3)
    weights = _weights(model)
    out = tmp_path / "ck"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    names = write_checkpoint(out, weights, model.config, tokenizer, template)
    for name in (
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert name in names and (out / name).is_file()
    assert (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == sorted([*names, "notes.txt"])  # no staging directory left
    _assert_same_weights(out, weights)
    hf = AutoTokenizer.from_pretrained(out)
    assert hf.eos_token == "<|im_end|>"
    rendered = hf.apply_chat_template(CHAT, tokenize=False)
    assert hf(rendered, add_special_tokens=False)["input_ids"] == template.render(CHAT, generation=False)
    stops = json.loads((out / "generation_config.json").read_text())["eos_token_id"]
    stops = stops if isinstance(stops, list) else [stops]
    assert template.eos_id in stops and set(stops) >= set(stop_token_ids(tokenizer))


@pytest.mark.parametrize("preset", ["tiny-llama-1x32", "tiny-gpt2-1x32"])
def test_a_text_checkpoint_round_trips_its_weights_and_special_tokens(tmp_path: Path, preset: str) -> None:
    tokenizer = load_char_tokenizer()
    model = build_model(
        preset,
        vocab_size=tokenizer.get_vocab_size(),
        seed=0,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    weights = _weights(model)
    write_checkpoint(tmp_path, weights, model.config, tokenizer, None)
    _assert_same_weights(tmp_path, weights)
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == EOS_ID and generation["bos_token_id"] == BOS_ID
    assert generation["pad_token_id"] == PAD_ID
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert (hf.bos_token, hf.eos_token, hf.pad_token, hf.unk_token) == ("<bos>", "<eos>", "<pad>", "<unk>")
    assert hf("12+3=")["input_ids"] == tokenizer.encode("12+3=").ids


def test_weights_of_another_model_are_refused_and_nothing_is_written(tmp_path: Path) -> None:
    tokenizer = load_char_tokenizer()
    model = build_model("tiny-llama-1x32", vocab_size=tokenizer.get_vocab_size(), seed=0)
    weights = _weights(model)
    weights.pop("model.norm.weight")
    weights["model.extra.weight"] = torch.zeros(2)
    with pytest.raises(ValueError, match=r"missing \['model\.norm\.weight'\].*unexpected \['model\.extra\.weight'\]"):
        write_checkpoint(tmp_path / "ck", weights, model.config, tokenizer, None)
    assert list((tmp_path / "ck").iterdir()) == []
