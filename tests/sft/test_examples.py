"""SFT examples: text rows are the generator's prompt ids then the completion and the stop token, with the loss
on exactly what the model writes; chats train on each assistant turn through its end-of-turn token (never on the
newline after it, nor on system or user text); bad rows are refused naming file and row; a task's reference answers
are one epoch of its train split that its own verifier scores full marks; `within_limits` counts what it drops."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from actors.sft.examples import (
    ExampleError,
    Renderer,
    SftExample,
    example,
    examples_from_file,
    examples_from_task,
    within_limits,
)
from pipeline.chat.template import ChatTemplate
from pipeline.rl.prompt_ids import prompt_token_ids
from pipeline.tasks import Prompt, get_task
from pipeline.tasks.char_tokenizer import BOS_ID, EOS_ID, alphabet_tokenizer, load_char_tokenizer
from tests.support.tokenizers import chatml_tokenizer

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "1+2?"},
    {"role": "assistant", "content": "3"},
    {"role": "user", "content": "and 4+5?"},
    {"role": "assistant", "content": "nine: 9"},
]


def _chat_renderer() -> Renderer:
    tokenizer = chatml_tokenizer()
    return Renderer(tokenizer, ChatTemplate(tokenizer, CHATML, eos_token="<|im_end|>"))


def _write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _masked_spans(tokenizer: Tokenizer, ex: SftExample) -> list[str]:
    """The decoded runs of consecutive masked positions, in order."""
    spans, current = [], []
    for token, masked in zip(ex.tokens.tolist(), ex.loss_mask.tolist(), strict=True):
        if masked:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current, skip_special_tokens=False))
            current = []
    if current:
        spans.append(tokenizer.decode(current, skip_special_tokens=False))
    return spans


# ---- text rows ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokenizer", [load_char_tokenizer(), alphabet_tokenizer("text")], ids=["char", "text"])
def test_a_text_row_is_the_generator_prompt_then_the_completion_and_stop_with_the_loss_on_those(
    tmp_path: Path, tokenizer: Tokenizer
) -> None:
    path = _write_jsonl(
        tmp_path / "rows.jsonl", [{"prompt": "12+3=", "completion": "15"}, {"prompt": "9", "completion": "0"}]
    )
    renderer = Renderer(tokenizer, None)
    examples = examples_from_file(path, renderer)
    assert [e.example_id for e in examples] == ["rows-0", "rows-1"]
    ex = examples[0]
    prompt = prompt_token_ids(Prompt(prompt_id="p", text="12+3="), tokenizer)
    assert prompt[0] == BOS_ID and len(prompt) == 1 + len("12+3=")
    completion = tokenizer.encode("15", add_special_tokens=False).ids
    assert len(completion) == 2
    assert ex.tokens.tolist() == [*prompt, *completion, EOS_ID]
    assert ex.loss_mask.tolist() == [False] * len(prompt) + [True] * 3
    assert ex.tokens.dtype == np.int64 and ex.loss_mask.dtype == np.bool_
    assert ex.num_loss_tokens == 3 and ex.num_tokens == len(prompt) + 3
    assert tokenizer.decode(ex.tokens[ex.loss_mask].tolist(), skip_special_tokens=False) == "15<eos>"


def test_an_id_column_names_the_example(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "rows.jsonl", [{"id": "first", "prompt": "1", "completion": "2"}])
    assert [e.example_id for e in examples_from_file(path, Renderer(load_char_tokenizer(), None))] == ["first"]


def test_max_examples_takes_the_first_rows(tmp_path: Path) -> None:
    rows = [{"prompt": str(i), "completion": str(i + 1)} for i in range(5)]
    path = _write_jsonl(tmp_path / "rows.jsonl", rows)
    examples = examples_from_file(path, Renderer(load_char_tokenizer(), None), max_examples=2)
    assert [e.example_id for e in examples] == ["rows-0", "rows-1"]


def test_a_parquet_file_reads_like_jsonl(tmp_path: Path) -> None:
    rows = [{"prompt": "12+3=", "completion": "15"}, {"prompt": "2+2=", "completion": "4"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    renderer = Renderer(load_char_tokenizer(), None)
    from_parquet = examples_from_file(tmp_path / "rows.parquet", renderer)
    from_jsonl = examples_from_file(_write_jsonl(tmp_path / "rows.jsonl", rows), renderer)
    assert len(from_parquet) == 2
    for a, b in zip(from_parquet, from_jsonl, strict=True):
        assert a.tokens.tolist() == b.tokens.tolist() and a.loss_mask.tolist() == b.loss_mask.tolist()


def test_a_parquet_file_of_chats_with_an_id_column(tmp_path: Path) -> None:
    pq.write_table(pa.Table.from_pylist([{"id": "c0", "messages": CHAT}]), tmp_path / "chats.parquet")
    renderer = _chat_renderer()
    (ex,) = examples_from_file(tmp_path / "chats.parquet", renderer)
    assert ex.example_id == "c0"
    assert ex.tokens.tolist() == renderer.template.render(CHAT, generation=False)
    assert _masked_spans(renderer.tokenizer, ex) == ["3<|im_end|>", "nine: 9<|im_end|>"]


# ---- chats ----------------------------------------------------------------------------------------------


def test_a_chat_trains_each_assistant_turn_through_its_end_of_turn_token_and_nothing_else(tmp_path: Path) -> None:
    renderer = _chat_renderer()
    tokenizer = renderer.tokenizer
    path = _write_jsonl(tmp_path / "chats.jsonl", [{"messages": CHAT}])
    (ex,) = examples_from_file(path, renderer)
    assert renderer.stop_id == tokenizer.token_to_id("<|im_end|>")
    assert ex.tokens.tolist() == renderer.template.render(CHAT, generation=False)
    assert _masked_spans(tokenizer, ex) == ["3<|im_end|>", "nine: 9<|im_end|>"]
    newline = tokenizer.token_to_id("\n")
    ends = np.flatnonzero(ex.tokens == renderer.stop_id)
    assert len(ends) == len(CHAT)  # every turn ends with <|im_end|>, then the template's newline
    for end in ends:
        assert ex.tokens[end + 1] == newline and not ex.loss_mask[end + 1]
    masked_text = tokenizer.decode(ex.tokens[ex.loss_mask].tolist(), skip_special_tokens=False)
    for text in ("be brief", "1+2?", "and 4+5?", "system", "user", "assistant", "<|im_start|>"):
        assert text not in masked_text
    assert not ex.loss_mask[0]


def test_a_prompt_given_as_messages_with_a_completion_string_trains_on_the_reply_only(tmp_path: Path) -> None:
    renderer = _chat_renderer()
    prompt = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+2?"}]
    path = _write_jsonl(tmp_path / "rows.jsonl", [{"prompt": prompt, "completion": "3"}])
    (ex,) = examples_from_file(path, renderer)
    whole = [*prompt, {"role": "assistant", "content": "3"}]
    assert ex.tokens.tolist() == renderer.template.render(whole, generation=False)
    generation_prompt = renderer.template.render(prompt, generation=True)
    assert ex.tokens[: len(generation_prompt)].tolist() == generation_prompt
    assert not ex.loss_mask[: len(generation_prompt)].any()
    assert _masked_spans(renderer.tokenizer, ex) == ["3<|im_end|>"]


# ---- bad input ------------------------------------------------------------------------------------------


def test_a_line_that_is_not_json_is_refused_naming_the_file_and_line(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "1", "completion": "2"}, "{not json"])
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not valid JSON"):
        examples_from_file(path, Renderer(load_char_tokenizer(), None))


def test_a_row_without_a_completion_is_refused_naming_the_file_and_row(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "1", "completion": "2"}, {"prompt": "3"}])
    with pytest.raises(ExampleError, match=r"rows\.jsonl: row 1: needs 'messages', or both 'prompt' and 'completion'"):
        examples_from_file(path, Renderer(load_char_tokenizer(), None))


def test_messages_without_a_chat_template_are_refused(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "chats.jsonl", [{"messages": CHAT}])
    with pytest.raises(ExampleError, match=r"chats\.jsonl: row 0: a chat \(messages\) needs a chat template"):
        examples_from_file(path, Renderer(chatml_tokenizer(), None))


def test_messages_and_a_prompt_in_one_row_are_refused(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "rows.jsonl", [{"messages": CHAT, "prompt": "1", "completion": "2"}])
    with pytest.raises(ExampleError, match=r"row 0: has 'messages' and 'prompt'/'completion'"):
        examples_from_file(path, _chat_renderer())


def test_a_missing_file_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.jsonl"
    with pytest.raises(ValueError, match=r"sft\.data .*nowhere\.jsonl: no such file"):
        examples_from_file(path, Renderer(load_char_tokenizer(), None))


def test_an_empty_file_is_refused(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(ExampleError, match=r"empty\.jsonl: no examples"):
        examples_from_file(path, Renderer(load_char_tokenizer(), None))


# ---- a task's reference answers -------------------------------------------------------------------------


def test_from_task_is_one_epoch_of_train_prompts_whose_completions_the_verifier_scores_full_marks() -> None:
    task = get_task(
        "reasoning_gym",
        dataset="chain_sum",
        size=50,
        eval_size=20,
        seed=0,
        answer_format="raw",
        tokenizer="numeric",
        config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
    )
    tokenizer = task.tokenizer
    renderer = Renderer(tokenizer, None)
    skipped: Counter[str] = Counter()
    examples = examples_from_task(task, renderer, task_name="reasoning_gym", skipped=skipped)
    assert len(examples) == 50 and skipped == Counter()
    ids = [e.example_id for e in examples]
    assert len(set(ids)) == 50
    eval_ids = {p.prompt_id for p in task.eval_prompts()}
    assert eval_ids and not eval_ids & set(ids)
    by_id = {}
    for prompt in task.prompts():
        if prompt.prompt_id in by_id:
            break
        by_id[prompt.prompt_id] = prompt
    assert set(by_id) == set(ids)
    for ex in examples:
        prompt = by_id[ex.example_id]
        expected_prompt = prompt_token_ids(prompt, tokenizer)
        assert ex.tokens[: len(expected_prompt)].tolist() == expected_prompt
        assert not ex.loss_mask[: len(expected_prompt)].any() and ex.loss_mask[len(expected_prompt) :].all()
        reply = ex.tokens[ex.loss_mask]
        assert reply[-1] == renderer.stop_id
        text = tokenizer.decode(reply[:-1].tolist(), skip_special_tokens=False)
        assert task.verify(prompt, text, reply[:-1]).reward == task.max_reward, (prompt.text, text)


def test_from_task_with_max_examples_stops_there() -> None:
    task = get_task(
        "reasoning_gym", dataset="chain_sum", size=50, eval_size=0, answer_format="raw", tokenizer="numeric"
    )
    examples = examples_from_task(task, Renderer(task.tokenizer, None), task_name="reasoning_gym", max_examples=7)
    assert len(examples) == 7


# ---- limits ---------------------------------------------------------------------------------------------


def test_within_limits_drops_too_long_out_of_vocabulary_and_unlearnable_examples_and_counts_them() -> None:
    fine = example("fine", [1, 5, 6, 2], [False, False, True, True])
    longest_fine = example("edge", [1, 5, 6, 7, 2], [False, False, True, True, True])
    too_long = example("long", [1, 5, 6, 7, 8, 2], [False, False, True, True, True, True])
    past_vocab = example("vocab", [1, 5, 20, 2], [False, False, True, True])
    negative = example("negative", [1, -1, 6, 2], [False, False, True, True])
    nothing = example("nothing", [1, 5, 6, 2], [False] * 4)
    skipped: Counter[str] = Counter({"no_reference": 1})
    kept = within_limits(
        [fine, too_long, past_vocab, longest_fine, negative, nothing], vocab_size=20, max_tokens=5, skipped=skipped
    )
    assert [e.example_id for e in kept] == ["fine", "edge"]
    assert skipped == Counter({"too_long": 1, "invalid_token_ids": 2, "nothing_to_learn": 1, "no_reference": 1})
