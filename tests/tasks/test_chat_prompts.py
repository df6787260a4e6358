"""Chat prompts end to end before the engine: prompt files with `messages` (JSONL and Parquet), the run's system
prompt, rendering with the model's chat template and its generation prompt, and a chat prompt for a model
without a template refused with its own dead-letter reason."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actors.trainer.prompt_feed import PromptFeed
from pipeline.config import load_config
from pipeline.rl.prompt_ids import UnrunnablePrompt, checked_prompt_ids, prompt_token_ids
from pipeline.tasks import Prompt, get_task, load_prompts, with_system_prompt
from tests.support.endpoints import TOKENIZER, chat_template

CHAT = [{"role": "user", "content": "12>"}]


def test_prompt_files_take_messages_or_a_prompt_in_jsonl_and_parquet(tmp_path: Path) -> None:
    rows = [
        {
            "id": "c-0",
            "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "12>"}],
            "answer": "21",
        },
        {"id": "t-0", "prompt": "34>", "answer": "43"},
    ]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    parquet = tmp_path / "p.parquet"
    pq.write_table(
        pa.Table.from_pylist([{**r, "messages": r.get("messages"), "prompt": r.get("prompt")} for r in rows]), parquet
    )
    for path in (jsonl, parquet):
        chat, text = load_prompts(path)
        assert chat.messages == tuple(rows[0]["messages"]) and chat.text is None and chat.answer == "21"
        assert text.text == "34>" and text.messages is None
    both = tmp_path / "both.jsonl"
    both.write_text(json.dumps({"prompt": "x", "messages": CHAT}) + "\n")
    with pytest.raises(ValueError, match="row 0 has both 'prompt' and 'messages'"):
        load_prompts(both)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "narrator", "content": "x"}]}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl: row 0: .*messages\[0\].role 'narrator'"):
        load_prompts(bad)


def test_a_chat_prompt_is_rendered_with_the_template_and_its_generation_prompt() -> None:
    template = chat_template()
    prompt = Prompt("c-1", messages=CHAT)
    ids = checked_prompt_ids(
        prompt, TOKENIZER, vocab_size=TOKENIZER.get_vocab_size(), max_context_tokens=128, template=template
    )
    assert ids == template.render(CHAT)
    assert TOKENIZER.decode(ids, skip_special_tokens=False).replace(" ", "").endswith("<|assistant|>")
    # plain text prompts are what they were: the text with <bos>
    assert prompt_token_ids(Prompt("t-1", text="12>"), TOKENIZER, template) == TOKENIZER.encode("12>").ids
    with pytest.raises(UnrunnablePrompt, match="has no chat template") as refused:
        checked_prompt_ids(prompt, TOKENIZER, vocab_size=None, max_context_tokens=None)
    assert refused.value.reason == "no_chat_template"
    with pytest.raises(UnrunnablePrompt) as too_long:
        checked_prompt_ids(prompt, TOKENIZER, vocab_size=None, max_context_tokens=len(ids), template=template)
    assert too_long.value.reason == "prompt_too_long"


def test_the_run_s_system_prompt_opens_chats_without_one_and_leaves_text_alone(tmp_path: Path) -> None:
    own = Prompt("c-2", messages=[{"role": "system", "content": "mine"}, *CHAT])
    assert with_system_prompt(own, "run's") == own
    assert with_system_prompt(Prompt("t-2", text="x"), "run's") == Prompt("t-2", text="x")
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "c", "messages": CHAT, "answer": "21"}) + "\n")
    cfg = load_config(None, [f"task.prompts_file={path}", "task.system_prompt=Reverse the digits."])
    (first,) = PromptFeed(cfg, get_task("reverse_digits"), 0).take(1)
    assert first.messages == ({"role": "system", "content": "Reverse the digits."}, *CHAT)


def test_reasoning_gym_as_chats_scores_and_passes_its_self_check() -> None:
    task = get_task("reasoning_gym", dataset="chain_sum", size=20, eval_size=5, seed=2, chat=True)
    prompt = next(task.prompts())
    assert prompt.text is None and prompt.messages is not None
    assert [m["role"] for m in prompt.messages] == ["system", "user"] and "<answer>" in prompt.messages[0]["content"]
    # a system prompt the run put first does not make the item unknown to the verifier
    with_run_system = with_system_prompt(
        get_task("reasoning_gym", dataset="chain_sum", size=20, seed=2, chat=True, answer_format="raw")
        .prompts()
        .__next__(),
        "Be brief.",
    )
    raw = get_task("reasoning_gym", dataset="chain_sum", size=20, seed=2, chat=True, answer_format="raw")
    assert raw.verify(with_run_system, with_run_system.answer or "", []).reward == 1.0
    assert task.verify(prompt, task.reference_completion(prompt) or "", []).reward == 1.0
    assert all(p.messages for p in itertools.islice(task.prompts(), 20))
