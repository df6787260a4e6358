"""Tasks: the char and digits tokenizers, the reverse_digits reward and prompts, the registry, verifier failures, prompt files."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import PreTrainedTokenizerFast

from pipeline.tasks import Prompt, Task, VerifierResult, get_task, load_prompts
from pipeline.tasks.char_tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    TOKENIZER_PATH,
    build_char_tokenizer,
    load_char_tokenizer,
)
from pipeline.tasks.digits_tokenizer import TOKENIZER_PATH as DIGITS_TOKENIZER_PATH
from pipeline.tasks.digits_tokenizer import build_digits_tokenizer, load_digits_tokenizer
from pipeline.tasks.exact_match import ExactMatchTask
from pipeline.tasks.reverse import ReverseDigitsTask, completion_positions, score_reversal


def test_shipped_tokenizer_json_is_what_build_char_tokenizer_writes(tmp_path) -> None:
    build_char_tokenizer(tmp_path / "tok.json")
    assert json.loads((tmp_path / "tok.json").read_text()) == json.loads(TOKENIZER_PATH.read_text())


def test_char_tokenizer_round_trips_and_loads_in_transformers() -> None:
    tok = load_char_tokenizer()
    encoded = tok.encode("31415926>").ids
    assert encoded[0] == BOS_ID and len(encoded) == 10
    assert tok.decode(encoded) == "31415926>"
    assert tok.decode([*tok.encode("12", add_special_tokens=False).ids, EOS_ID], skip_special_tokens=False) == "12<eos>"
    fast = PreTrainedTokenizerFast(
        tokenizer_file=str(TOKENIZER_PATH), pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )
    assert fast.encode("31415926>") == encoded and fast.pad_token_id == PAD_ID
    assert fast.decode(encoded, skip_special_tokens=True) == "31415926>"


def test_shipped_digits_tokenizer_json_is_what_build_digits_tokenizer_writes(tmp_path) -> None:
    build_digits_tokenizer(tmp_path / "tok.json")
    assert json.loads((tmp_path / "tok.json").read_text()) == json.loads(DIGITS_TOKENIZER_PATH.read_text())


def test_digits_tokenizer_has_only_specials_digits_and_the_separator() -> None:
    tok = load_digits_tokenizer()
    assert tok.get_vocab_size() == 14
    assert [tok.token_to_id(t) for t in ("<pad>", "<bos>", "<eos>")] == [PAD_ID, BOS_ID, EOS_ID]
    encoded = tok.encode("31415926>").ids
    assert encoded[0] == BOS_ID and len(encoded) == 10 and tok.decode(encoded) == "31415926>"
    assert tok.decode([*tok.encode("12", add_special_tokens=False).ids, EOS_ID], skip_special_tokens=False) == "12<eos>"
    with pytest.raises(Exception, match="UNK"):  # no <unk>: a character outside the vocabulary cannot be encoded
        tok.encode("1+1")
    fast = PreTrainedTokenizerFast(
        tokenizer_file=str(DIGITS_TOKENIZER_PATH), pad_token="<pad>", bos_token="<bos>", eos_token="<eos>"
    )
    assert fast.encode("31415926>") == encoded


def test_reverse_task_chooses_its_tokenizer() -> None:
    assert ReverseDigitsTask().tokenizer.get_vocab_size() == load_char_tokenizer().get_vocab_size()
    task = get_task("reverse_digits", num_digits=6, tokenizer="digits")
    assert task.tokenizer.get_vocab_size() == 14
    prompt = next(task.prompts())
    assert task.tokenizer.decode(task.tokenizer.encode(prompt.text).ids) == prompt.text
    with pytest.raises(ValueError, match="tokenizer must be one of"):
        ReverseDigitsTask(tokenizer="bpe")


def test_reverse_reward_gives_partial_credit_per_position() -> None:
    assert score_reversal("12345678", "12345678")[:2] == (1.0, "ok")
    assert score_reversal("12345678", "12340000")[:2] == (0.5, "ok")
    assert score_reversal("12345678", "1234")[:2] == (0.5, "ok")  # missing digits count as wrong
    assert score_reversal("12345678", "1234567899")[:2] == (0.8, "ok")  # extra digits dilute the credit
    # the length limit (num_digits + 1) without the stop token: one extra position, reward below 1
    assert score_reversal("12345678", "123456789")[:2] == (8 / 9, "ok")


def test_reverse_reward_counts_a_stray_symbol_or_special_token_as_one_wrong_position() -> None:
    assert score_reversal("12345678", "1234>678")[:2] == (7 / 8, "ok")
    assert score_reversal("12345678", "1234<pad>678")[:2] == (7 / 8, "ok")  # <pad> is one position, not five
    assert score_reversal("12345678", "<unk>2345678<bos>") == (7 / 9, "ok", {"matches": 7})


def test_reverse_reward_is_a_format_error_without_any_digit() -> None:
    assert score_reversal("12345678", "") == (0.0, "format_error", {"reason": "completion holds no digit"})
    assert score_reversal("12345678", ">>=+")[:2] == (0.0, "format_error")
    assert score_reversal("12345678", "<pad><unk>")[:2] == (0.0, "format_error")
    assert completion_positions("1<pad>>") == ["1", "<pad>", ">"]


def test_reverse_task_verifies_against_the_reversed_digits() -> None:
    task = get_task("reverse_digits", num_digits=4, seed=1)
    prompt = next(task.prompts())
    assert prompt.text is not None and prompt.text.endswith(">") and len(prompt.text) == 5
    assert task.verify(prompt, prompt.text[:4][::-1], []) == VerifierResult(1.0, "ok", {"matches": 4})


def test_reverse_prompts_are_infinite_and_deterministic_from_the_seed() -> None:
    first = list(itertools.islice(ReverseDigitsTask(seed=3).prompts(), 2000))
    again = list(itertools.islice(ReverseDigitsTask(seed=3).prompts(), 2000))
    other = list(itertools.islice(ReverseDigitsTask(seed=4).prompts(), 2000))
    assert first == again and first != other
    assert len({p.prompt_id for p in first}) == 2000 and len({p.text for p in first}) > 1900


class _SlowTask(Task):
    def prompts(self):
        yield Prompt("p", text="x")

    def verify(self, prompt: Prompt, completion_text: str, completion_ids: Sequence[int]) -> VerifierResult:
        if completion_text == "raise":
            raise RuntimeError("sandbox down")
        time.sleep(0.5)
        return VerifierResult(1.0)


def test_get_task_resolves_builtins_and_module_functions() -> None:
    assert isinstance(get_task("reverse_digits"), ReverseDigitsTask)
    assert get_task("pipeline.tasks.reverse:ReverseDigitsTask", num_digits=3).num_digits == 3
    with pytest.raises(ValueError, match="not a pipeline.tasks.Task"):
        get_task("builtins:dict")
    with pytest.raises(ValueError, match="neither a built-in"):
        get_task("no_such_task")
    with pytest.raises(ValueError, match="cannot import"):
        get_task("tests.tasks.test_tasks:missing")


def test_prompt_files_load_from_jsonl_and_parquet(tmp_path) -> None:
    rows = [{"prompt": "2+2=", "answer": "4", "tags": ["math"]}, {"prompt": "1+1=", "answer": 2, "level": 1}]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    pq.write_table(
        pa.Table.from_pylist([{"prompt": r["prompt"], "answer": str(r["answer"])} for r in rows]),
        tmp_path / "p.parquet",
    )
    from_jsonl, from_parquet = load_prompts(tmp_path / "p.jsonl"), load_prompts(tmp_path / "p.parquet")
    assert [p.text for p in from_jsonl] == [p.text for p in from_parquet] == ["2+2=", "1+1="]
    assert from_jsonl[1].answer == "2" and from_jsonl[1].metadata == {"level": 1} and from_jsonl[0].tags == ("math",)
    task = ExactMatchTask(str(tmp_path / "p.jsonl"))
    assert task.verify(from_jsonl[0], " 4\n", []).reward == 1.0
    assert len(list(itertools.islice(task.prompts(), 5))) == 5
    (tmp_path / "bad.jsonl").write_text('{"answer": "1"}\n')
    with pytest.raises(ValueError, match="row 0"):
        load_prompts(tmp_path / "bad.jsonl")
    (tmp_path / "bad_id.jsonl").write_text('{"prompt": "x"}\n{"id": "a b", "prompt": "y"}\n')
    with pytest.raises(ValueError, match="row 1: prompt_id 'a b'"):  # an id must fit object keys and Nats-Msg-Id
        load_prompts(tmp_path / "bad_id.jsonl")


def test_order_copy_asks_for_the_same_prompts_digits_as_given_and_a_bad_order_is_named() -> None:
    reverse = list(itertools.islice(ReverseDigitsTask(num_digits=5, seed=2).prompts(), 20))
    copy = list(itertools.islice(ReverseDigitsTask(num_digits=5, seed=2, order="copy").prompts(), 20))
    assert [p.text for p in copy] == [p.text for p in reverse]
    assert all(c.answer == c.text.rstrip(">") == r.answer[::-1] for c, r in zip(copy, reverse, strict=True))
    task = ReverseDigitsTask(num_digits=5, order="copy")
    assert task.verify(copy[0], copy[0].answer, []).reward == 1.0
    with pytest.raises(ValueError, match="order"):
        ReverseDigitsTask(order="sorted")
