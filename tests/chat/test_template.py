"""Chat templates through transformers' own renderer: the bridge equals a fresh render for append-only
templates (ChatML with newlines, the built-in one), a history-rewriting template is reported, template files
load, and the Hermes tool-call parser reads what Qwen-style models write."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from pipeline.chat.template import ChatTemplate, ChatTemplateError, load_chat_template, normalized
from pipeline.chat.template_budget import TEMPLATE_STEPS, TemplateBudget, TemplateBudgetError
from pipeline.chat.tool_parsers import get_tool_parser, hermes
from pipeline.tasks.chat_tokenizer import (
    DIGITS_CHARACTERS,
    DIGITS_TOKENIZER_PATH,
    SPECIAL_TOKENS,
    TOKENIZER_PATH,
    build_chat_tokenizer,
    load_chat_template_text,
    load_chat_tokenizer,
)
from tests.support.tokenizers import chatml_tokenizer as support_chatml_tokenizer

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{{ c.function | tojson }}\n</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
STRIPPING = (  # like Qwen3's template: earlier assistant turns lose what precedes </think>
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and not loop.last %}{{ (m.content or '').split('</think>')[-1] }}"
    "{% else %}{{ m.content or '' }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chatml_tokenizer() -> Tokenizer:
    return support_chatml_tokenizer("<tool_call>", "</tool_call>", "</think>")


def test_the_shipped_chat_tokenizers_are_what_the_builder_writes(tmp_path: Path) -> None:
    build_chat_tokenizer(tmp_path / "tok.json")
    assert json.loads((tmp_path / "tok.json").read_text()) == json.loads(TOKENIZER_PATH.read_text())
    build_chat_tokenizer(tmp_path / "digits.json", characters=DIGITS_CHARACTERS)
    assert json.loads((tmp_path / "digits.json").read_text()) == json.loads(DIGITS_TOKENIZER_PATH.read_text())
    assert load_chat_tokenizer("digits").get_vocab_size() == len(SPECIAL_TOKENS) + len(DIGITS_CHARACTERS)


@pytest.mark.parametrize("kind", ["chatml", "builtin"])
def test_bridged_ids_equal_a_fresh_render_for_user_and_tool_turns(kind: str) -> None:
    if kind == "chatml":
        template = ChatTemplate(chatml_tokenizer(), CHATML, eos_token="<|im_end|>")
    else:
        template = ChatTemplate(load_chat_tokenizer(), load_chat_template_text(), eos_token="<eos>")
    assert template.append_only_problems() == []
    first = [{"role": "user", "content": "hi"}]
    reply = {"role": "assistant", "content": "ok"}
    for new in ({"role": "user", "content": "more"}, {"role": "tool", "content": "42", "tool_call_id": "c1"}):
        sampled = template.encode("ok") + [template.eos_id]
        bridged = template.render(first) + sampled + template.bridge([new])
        assert bridged == template.render([*first, reply, new])
        # a reply cut before its end-of-turn token gets it from the bridge
        assert template.render(first) + template.encode("ok") + template.bridge([new], ended_with_eos=False) == bridged


def test_a_template_that_rewrites_earlier_turns_is_reported() -> None:
    template = ChatTemplate(chatml_tokenizer(), STRIPPING, eos_token="<|im_end|>")
    assert template.append_only_problems() == []  # plain replies keep their text
    first = [{"role": "user", "content": "q"}]
    reply = {"role": "assistant", "content": "why</think>ok"}
    fresh = template.render([*first, reply, {"role": "user", "content": "n"}])
    sampled = template.encode("why</think>ok") + [template.eos_id]
    assert template.render(first) + sampled + template.bridge([{"role": "user", "content": "n"}]) != fresh


def test_an_unrenderable_conversation_is_a_chat_template_error() -> None:
    refusing = "{% if tools %}{{ raise_exception('no tools here') }}{% endif %}" + CHATML
    template = ChatTemplate(chatml_tokenizer(), refusing, eos_token="<|im_end|>")
    with pytest.raises(ChatTemplateError, match="no tools here"):
        template.render([{"role": "user", "content": "x"}], tools=[{"type": "function", "function": {"name": "f"}}])
    with pytest.raises(ChatTemplateError, match="broken"):  # one that renders nothing is refused when built
        ChatTemplate(chatml_tokenizer(), "{{ raise_exception('broken') }}", eos_token="<|im_end|>")


def test_templates_load_from_jinja_files_and_tokenizer_configs(tmp_path: Path) -> None:
    (tmp_path / "a.jinja").write_text(CHATML)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    named = tmp_path / "named"
    named.mkdir()
    (named / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": CHATML}]})
    )
    assert load_chat_template(tmp_path / "a.jinja") == CHATML
    assert load_chat_template(tmp_path / "tokenizer_config.json") == CHATML
    assert load_chat_template(named) == CHATML
    (tmp_path / "empty.json").write_text("{}")
    with pytest.raises(ValueError, match="no 'chat_template'"):
        load_chat_template(tmp_path / "empty.json")


def test_the_hermes_parser_reads_several_calls_and_keeps_what_it_cannot_read() -> None:
    text = 'Let me look.<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call><tool_call>{"name": "b", "parameters": "{}"}</tool_call>'
    parsed = hermes(text)
    assert parsed.content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls] == [
        ("a", {"x": 1}),
        ("b", {}),
    ]
    assert len({c["id"] for c in parsed.tool_calls}) == 2 and parsed.unparseable == 0
    broken = hermes('<tool_call>{"arguments": {}}</tool_call>')
    assert broken.tool_calls == [] and broken.unparseable == 1 and broken.content.startswith("<tool_call>")
    assert hermes("plain").content == "plain"
    with pytest.raises(ValueError, match="model.tool_parser"):
        get_tool_parser("nope")


def test_messages_compare_by_role_text_and_tool_calls_not_by_call_ids() -> None:
    a = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": '{"x": 1}'}}],
    }
    b = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "2", "function": {"name": "f", "arguments": {"x": 1}}}],
    }
    assert normalized(a) == normalized(b)
    assert normalized({"role": "user", "content": [{"type": "text", "text": "hi"}]}) == normalized(
        {"role": "user", "content": "hi"}
    )


def test_a_tokenizer_with_both_eos_and_end_of_turn_stops_at_both_and_chat_turns_end_with_end_of_turn(
    tmp_path: Path,
) -> None:
    from actors.models import load_chat_template_for, stop_token_ids
    from pipeline.config import load_config

    tokenizer = chatml_tokenizer()  # <|endoftext|> and <|im_end|>, as a Qwen3 tokenizer has
    stops = stop_token_ids(tokenizer)
    assert set(stops) == {tokenizer.token_to_id("<|endoftext|>"), tokenizer.token_to_id("<|im_end|>")}
    (tmp_path / "chatml.jinja").write_text(CHATML)
    cfg = load_config(None, [f"model.chat_template={tmp_path / 'chatml.jinja'}"], environ={})
    template = load_chat_template_for(cfg, tokenizer)
    assert template is not None and template.eos_token == "<|im_end|>"


def test_chat_template_args_reach_the_template() -> None:
    thinking = CHATML.replace(
        "<|im_start|>assistant\n{% endif %}",
        "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
        "{% endif %}",
    )
    messages = [{"role": "user", "content": "1+1"}]
    plain = ChatTemplate(chatml_tokenizer(), thinking, eos_token="<|im_end|>").render_text(messages)
    off = ChatTemplate(
        chatml_tokenizer(), thinking, eos_token="<|im_end|>", template_args={"enable_thinking": False}
    ).render_text(messages)
    assert off == plain + "<think></think>"


NESTED_LOOPS = (
    "{% for a in range(10000) %}{% for b in range(10000) %}{% for c in range(10000) %}"
    "{{ a }}{% endfor %}{% endfor %}{% endfor %}" + CHATML
)
"""10^12 passes, each range within the sandbox's bound: hangs the process that loads it on main."""


def test_a_template_of_nested_loops_is_refused_at_load_naming_its_file_and_the_budget(tmp_path: Path) -> None:
    path = tmp_path / "chat_template.jinja"
    path.write_text(NESTED_LOOPS)
    with pytest.raises(TemplateBudgetError, match=f"{path}.*{TEMPLATE_STEPS:,} template steps"):
        ChatTemplate(chatml_tokenizer(), load_chat_template(path), eos_token="<|im_end|>", source=str(path))


def test_a_template_that_hangs_outside_its_own_lines_is_refused_at_the_clock() -> None:
    """Arithmetic on a huge number runs in one step the step budget cannot see: the probe is killed at the
    deadline (a short one here; the default is `TEMPLATE_TIME_S`), and the next template is checked afresh."""
    budget = TemplateBudget(time_s=0.5)
    with pytest.raises(TemplateBudgetError, match=r"probe conversations within 0\.5 s"):
        ChatTemplate(chatml_tokenizer(), "{{ 7 ** (7 ** 11) }}" + CHATML, eos_token="<|im_end|>", budget=budget)
    assert (
        ChatTemplate(chatml_tokenizer(), "{#- another -#}" + CHATML, eos_token="<|im_end|>").append_only_problems()
        == []
    )


def test_a_template_that_allocates_past_its_memory_budget_is_refused() -> None:
    budget = TemplateBudget(memory_bytes=64 << 20)
    with pytest.raises(TemplateBudgetError, match="needed more than 67,108,864 bytes"):
        ChatTemplate(
            chatml_tokenizer(), "{% set s = 'x' * 500000000 %}" + CHATML, eos_token="<|im_end|>", budget=budget
        )
