"""A prompt's token ids, and whether a prompt can ever be rolled out.

`prompt_token_ids` is the one way a prompt becomes the ids a rollout starts from: a text prompt with special tokens
(``<bos>``), given ids as they are, a chat rendered with the model's chat template and its generation prompt.
`checked_prompt_ids` decides, before any engine call, whether a prompt can ever be rolled out (ids inside the
vocabulary, room for one new token in the context): a prompt that cannot raises `UnrunnablePrompt`, an
`pipeline.failures.InfraFailure` whose ``reason`` is its dead letter's, so a generator refuses it alone instead of
failing the engine call of a batch, and the trainer's prompt feed and SFT's examples skip it by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from pipeline.failures import InfraFailure, InfraReason
from pipeline.rl.env_messages import encode
from pipeline.tasks import Prompt

if TYPE_CHECKING:
    from pipeline.chat.template import ChatTemplate


class Tokenizer(Protocol):
    """What the rollout needs from a tokenizer: ``tokenizers.Tokenizer`` and HF fast tokenizers both fit
    (``encode`` may return an ``Encoding`` with ``.ids`` or a list of ids)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> Any: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


def prompt_token_ids(prompt: Prompt, tokenizer: Tokenizer, template: ChatTemplate | None = None) -> list[int]:
    """The ids a prompt is rolled out from: its text with special tokens (``<bos>``), its given ids, or its chat
    rendered with `template` and the generation prompt (`NoChatTemplate` without one)."""
    if prompt.token_ids is not None:
        return list(prompt.token_ids)
    if prompt.messages is not None:
        if template is None:
            raise NoChatTemplate(
                f"prompt {prompt.prompt_id!r} is a chat (messages), and this model has no chat template: set "
                "model.chat_template, or give model.tokenizer a directory that has one (chat_template.jinja, or the key in tokenizer_config.json)"
            )
        return template.render(prompt.messages)
    assert prompt.text is not None
    return encode(tokenizer, prompt.text, add_special_tokens=True)


class NoChatTemplate(ValueError):
    """A chat prompt for a model without a chat template."""


class UnrunnablePrompt(InfraFailure):
    """A prompt no engine call can take, now or on a retry; ``reason`` (one of the prompt reasons of `InfraReason`)
    names the failure for its dead letter. ``str()`` is ``"prompt '<id>': <detail>"``."""

    def __init__(self, prompt_id: str, reason: InfraReason, detail: str) -> None:
        super().__init__(detail, reason=reason)
        self.prompt_id = prompt_id

    def __str__(self) -> str:
        return f"prompt {self.prompt_id!r}: {self.detail}"


def checked_prompt_ids(
    prompt: Prompt,
    tokenizer: Tokenizer,
    *,
    vocab_size: int | None,
    max_context_tokens: int | None,
    template: ChatTemplate | None = None,
) -> list[int]:
    """`prompt_token_ids`, or `UnrunnablePrompt` when they can never be rolled out.

    Reasons: ``no_chat_template`` (a chat prompt, and the model has none), ``prompt_not_tokenizable`` (the
    tokenizer or the chat template raised on it), ``empty_prompt``,
    ``invalid_token_ids`` (an id outside ``[0, vocab_size)``: it would fail the engine call, or assert on a
    GPU), ``prompt_too_long`` (``max_context_tokens`` leaves no room for one new token). A limit of None is
    not checked.
    """
    try:
        ids = prompt_token_ids(prompt, tokenizer, template)
    except NoChatTemplate as exc:
        raise UnrunnablePrompt(prompt.prompt_id, InfraReason.NO_CHAT_TEMPLATE, str(exc)) from exc
    except Exception as exc:  # a tokenizer raising on one text is that prompt's fault, permanently
        raise UnrunnablePrompt(
            prompt.prompt_id, InfraReason.PROMPT_NOT_TOKENIZABLE, f"{type(exc).__name__}: {exc}"
        ) from exc
    if not ids:
        raise UnrunnablePrompt(prompt.prompt_id, InfraReason.EMPTY_PROMPT, "no tokens")
    if vocab_size is not None and (bad := [t for t in ids if not 0 <= t < vocab_size]):
        raise UnrunnablePrompt(
            prompt.prompt_id,
            InfraReason.INVALID_TOKEN_IDS,
            f"token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})",
        )
    if max_context_tokens is not None and len(ids) >= max_context_tokens:
        raise UnrunnablePrompt(
            prompt.prompt_id,
            InfraReason.PROMPT_TOO_LONG,
            f"{len(ids)} tokens leave no room for a reply in the model's context of {max_context_tokens}",
        )
    return ids
