"""A chat template bound to a tokenizer: messages in, token ids out, and the bridge from one turn to the next.

Rendering goes through `transformers`' own ``apply_chat_template`` (Jinja, the same sandbox and filters a
model's template is written for), then the text is encoded with ``add_special_tokens=False``: the template
writes every special token it wants itself, and only the template: special-token text inside a message (a tool's
output that says ``<|im_end|>``) is encoded as the characters it is (`pipeline/chat/literal.py`), so no message
can open a turn; ordinary text encodes token for token as the tokenizer encodes the rendered string.

**The bridge** (tokens in, tokens out across turns). A multi-turn conversation is rendered once, for its
first turn. Later turns never re-render what came before: the model's sampled ids are kept byte for byte,
and only the *new* messages (a tool result, the user's next turn) are rendered, with the template's own
scaffold, by the fixed-base trick::

    base      = [user "x", assistant "y"]                 rendered without a generation prompt
    extended  = [user "x", assistant "y", *new_messages]  rendered with one
    bridge    = what follows the assistant's end-of-turn token in `base`   ("\\n" in ChatML)
              + extended[len(base):]                      (the new messages' scaffold + generation prompt)

The ids of a turn are then ``previous prompt + sampled reply (ending in its stop token) + encode(bridge)``.
`append_only_problems` checks at start-up that the template renders a user turn and a tool turn by
appending (a template that rewrites earlier turns, like Qwen3's stripping of past ``<think>`` blocks, makes
the bridge differ from a fresh render; the endpoint still bridges, and says so once).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from pipeline.chat.literal import LiteralSpecials, encode_released
from pipeline.chat.template_budget import TemplateBudget, check_template_budget

Message = dict[str, Any]
"""An OpenAI chat message: ``role``, ``content`` (str, None, or a list of text parts), ``tool_calls``,
``tool_call_id``, ``name``."""

_BASE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
MAX_CACHED_BASES = 64
"""Rendered base conversations kept, one per distinct tool list."""


class ChatTemplateError(ValueError):
    """The template cannot render these messages (a Jinja error, or a role the template refuses)."""


def load_chat_template(path: str | Path) -> str:
    """A template from a file: a ``.jinja`` file as it stands, or a ``tokenizer_config.json`` (its
    ``chat_template``, a string, or the ``default`` of a list of named templates)."""
    path = Path(path)
    if path.is_dir():
        for name in ("chat_template.jinja", "tokenizer_config.json"):
            if (path / name).is_file():
                return load_chat_template(path / name)
        raise ValueError(f"chat template: {path} holds neither chat_template.jinja nor tokenizer_config.json")
    if not path.is_file():
        raise ValueError(f"chat template: no file {path}")
    if path.suffix != ".json":
        return path.read_text()
    config = json.loads(path.read_text())
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template:
        raise ValueError(f"chat template: {path} has no 'chat_template' string")
    return template


class ChatTemplate:
    """A Jinja chat template over a `tokenizers.Tokenizer`; ``eos_token`` is the end-of-turn token the
    model samples (the engine's stop token). Built only after the template rendered probe conversations within
    `budget` (`pipeline/chat/template_budget.py`; `TemplateBudgetError` names ``source``, where the template came
    from, and the budget)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        template: str,
        *,
        eos_token: str,
        bos_token: str | None = None,
        template_args: Mapping[str, Any] | None = None,
        source: str | None = None,
        budget: TemplateBudget | None = None,
    ) -> None:
        if tokenizer.token_to_id(eos_token) is None:
            raise ValueError(f"chat template: the tokenizer has no end-of-turn token {eos_token!r}")
        if source is None:
            source = f"chat template (sha256 {hashlib.sha256(template.encode(errors='replace')).hexdigest()[:12]})"
        tokens = {"eos_token": eos_token} if bos_token is None else {"eos_token": eos_token, "bos_token": bos_token}
        check_template_budget(template, source=source, variables={**tokens, **(template_args or {})}, budget=budget)
        self.tokenizer = tokenizer
        self.template = template
        self.eos_token = eos_token
        self.eos_id = int(tokenizer.token_to_id(eos_token))
        self.template_args = dict(template_args or {})
        self._hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos_token, bos_token=bos_token)
        self._hf.chat_template = template
        self._literal = LiteralSpecials(tokenizer)
        self._bases: dict[str, str] = {}
        self._scaffold_after_eos = self._after_eos()

    def render_text(
        self, messages: Sequence[Message], *, tools: Sequence[Mapping[str, Any]] | None = None, generation: bool = True
    ) -> str:
        return self._literal.restore(self._render_hidden(messages, tools=tools, generation=generation))

    def _render_hidden(
        self, messages: Sequence[Message], *, tools: Sequence[Mapping[str, Any]] | None, generation: bool
    ) -> str:
        """The rendered text with the special-token text of messages and tools as placeholders."""
        try:
            text = self._hf.apply_chat_template(
                self._literal.hide_messages(messages),
                tools=self._literal.hide_tools(tools),
                tokenize=False,
                add_generation_prompt=generation,
                **self.template_args,
            )
        except Exception as exc:  # jinja2 errors, raise_exception() in the template, bad message shapes
            raise ChatTemplateError(f"the chat template cannot render these messages: {exc}") from exc
        if not isinstance(text, str):
            raise ChatTemplateError(f"the chat template rendered {type(text).__name__}, not text")
        return text

    def encode(self, text: str) -> list[int]:
        return encode_released(self.tokenizer, text)

    def render(
        self, messages: Sequence[Message], *, tools: Sequence[Mapping[str, Any]] | None = None, generation: bool = True
    ) -> list[int]:
        """The ids of a conversation's first turn (with the generation prompt: what the model continues)."""
        return self._literal.encode(self._render_hidden(messages, tools=tools, generation=generation))

    def bridge(
        self,
        new_messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        ended_with_eos: bool = True,
    ) -> list[int] | None:
        """The ids to append after a sampled reply so the conversation continues with ``new_messages`` and a
        generation prompt; None when the template does not render them by appending (the caller renders the
        whole conversation afresh: a new branch). ``ended_with_eos``: the reply's last id is the end-of-turn
        token (a reply cut by a stop string or a length limit did not write it, so the bridge writes it)."""
        if not new_messages:
            return None
        base = self._base(tools)
        extended = self._render_hidden([*_BASE, *new_messages], tools=tools, generation=True)
        if not extended.startswith(base):
            return None
        head = self._scaffold_after_eos if ended_with_eos else self.eos_token + self._scaffold_after_eos
        return self._literal.encode(head + extended[len(base) :])

    def _base(self, tools: Sequence[Mapping[str, Any]] | None) -> str:
        """The fixed base conversation rendered with these tools (cached: every bridged turn needs it), its tools'
        special-token text as placeholders."""
        key = json.dumps(tools, sort_keys=True) if tools else ""
        base = self._bases.get(key)
        if base is None:
            if len(self._bases) >= MAX_CACHED_BASES:
                self._bases.clear()
            base = self._bases[key] = self._render_hidden(_BASE, tools=tools, generation=False)
        return base

    def _after_eos(self) -> str:
        """What the template writes after an assistant turn's end-of-turn token (ChatML: a newline)."""
        base = self.render_text(_BASE, generation=False)
        at = base.rfind(self.eos_token)
        return "" if at < 0 else base[at + len(self.eos_token) :]

    def append_only_problems(self) -> list[str]:
        """Why bridged ids would differ from a fresh render of the same conversation (empty: they agree), for a
        user turn and for a tool turn after an assistant reply."""
        problems = []
        first = [{"role": "user", "content": "12"}]
        prompt = self.render(first)
        reply = self.encode("34") + [self.eos_id]
        for new in ({"role": "user", "content": "56"}, {"role": "tool", "content": "56", "tool_call_id": "call_0"}):
            conversation = [*first, {"role": "assistant", "content": "34"}, new]
            try:
                bridged = self.bridge([new])
                fresh = self.render(conversation)
            except ChatTemplateError as exc:
                problems.append(f"a {new['role']} turn: {exc}")
                continue
            if bridged is None:
                problems.append(f"a {new['role']} turn is not rendered by appending to the conversation")
            elif prompt + reply + bridged != fresh:
                problems.append(
                    f"a {new['role']} turn: prompt + sampled reply + bridge differs from a fresh render of the "
                    "conversation (the template rewrites earlier turns or renders the reply differently)"
                )
        return problems


def message_text(message: Mapping[str, Any]) -> str:
    """A message's content as text: a string, None (empty), or OpenAI text parts joined."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
    raise ChatTemplateError(f"message content must be a string or a list of text parts, got {type(content).__name__}")


def normalized(message: Mapping[str, Any]) -> tuple[Any, ...]:
    """What makes two messages the same turn (role, text, tool calls by name and parsed arguments, the tool
    call they answer): how a session tells a request that extends its conversation from one that rewrote it.
    Tool-call ids and other fields a client may regenerate are ignored."""
    calls = []
    for call in message.get("tool_calls") or ():
        function = call.get("function", {}) if isinstance(call, Mapping) else {}
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        calls.append((function.get("name"), json.dumps(arguments, sort_keys=True)))
    return (message.get("role"), message_text(message), tuple(calls), message.get("tool_call_id"))
