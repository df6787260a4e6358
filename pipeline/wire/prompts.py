"""The prompt record: what a task yields, what the trainer admits and what the prompt queue carries.

One record end to end: a `Task` yields it (``policy_version`` -1), the trainer stamps the version it
held at admission (`pipeline.wire.prompt_queue.queue_prompt`) and enqueues it as JSON, a generator decodes
it, rolls it out and hands the same record to the task's verifier. On the queue (`pipeline.wire.prompt_queue`)
one prompt is one JSON object::

    {"schema_version": 1, "prompt_id": "reverse_digits-s0-41.3", "text": "4821>", "token_ids": null,
     "answer": "1284", "tags": ["reverse"], "metadata": {"difficulty": 2}, "policy_version": 7}

Exactly one of ``text``, ``token_ids`` and ``messages`` (a chat: ``[{"role": "user", "content": "..."}]``,
rendered by the generator with the model's chat template and its generation prompt) is set. ``policy_version`` is what the generator's sync floor
reads (the rule is in `pipeline/rl/staleness.py`). ``schema_version`` is `PROMPT_SCHEMA_VERSION`: trainer
and generators are launched independently and may run different builds, so a record says which format it
is in, and a reader refuses one it was not built for (or one that does not say) instead of guessing from
its fields. A payload that fails validation raises `PromptError` naming the field; the queue dead-letters
such a message (`bad_prompt`) instead of dropping it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from pipeline.wire.trajectory import ID_RE

PROMPT_SCHEMA_VERSION = 2
"""Format of the prompt JSON object, carried in its ``schema_version``; bump it on any change of the fields.
2 added ``messages``. A prompt without messages is still written as 1, which every earlier build reads."""
READ_SCHEMA_VERSIONS = (1, 2)
"""The versions this build reads (1: no ``messages`` key)."""
WIRE_FIELDS = frozenset(
    {"schema_version", "prompt_id", "text", "token_ids", "messages", "answer", "tags", "metadata", "policy_version"}
)
"""The keys of a prompt's JSON object; any other key makes the payload invalid."""
MESSAGE_ROLES = frozenset({"system", "user", "assistant", "tool"})


class PromptError(ValueError):
    """A prompt that is not valid; the message names the prompt and the field."""


@dataclass(frozen=True)
class Prompt:
    """One prompt. ``text`` is tokenized by the rollout (special tokens such as ``<bos>`` added), unless
    ``token_ids`` is given, which is then used as is. ``answer`` and ``metadata`` are for the verifier;
    ``tags`` group metrics (per-task-tag reward means). ``policy_version``: the trainer's version when it
    admitted the prompt, -1 before admission (no sync floor from it)."""

    prompt_id: str
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[Mapping[str, Any], ...] | None = None
    answer: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    tags: tuple[str, ...] = ()
    policy_version: int = -1

    def __post_init__(self) -> None:
        if not isinstance(self.prompt_id, str) or not ID_RE.match(self.prompt_id):
            raise PromptError(f"prompt_id {self.prompt_id!r} is not a valid id (letters, digits, '_.:-')")
        if sum(x is not None for x in (self.text, self.token_ids, self.messages)) != 1:
            raise PromptError(f"prompt {self.prompt_id!r}: give exactly one of text, token_ids and messages")
        if self.messages is not None:
            object.__setattr__(self, "messages", _checked_messages(self.prompt_id, self.messages))
        if self.text is not None and not isinstance(self.text, str):
            raise PromptError(f"prompt {self.prompt_id!r}: text must be a string")
        if self.token_ids is not None:
            if not isinstance(self.token_ids, Sequence) or isinstance(self.token_ids, str):
                raise PromptError(f"prompt {self.prompt_id!r}: token_ids must be a list of integers")
            ids = tuple(self.token_ids)
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise PromptError(f"prompt {self.prompt_id!r}: token_ids must be non-negative integers")
            object.__setattr__(self, "token_ids", ids)
        if self.answer is not None and not isinstance(self.answer, str):
            raise PromptError(f"prompt {self.prompt_id!r}: answer must be a string or null")
        if not isinstance(self.metadata, Mapping):
            raise PromptError(f"prompt {self.prompt_id!r}: metadata must be an object")
        tags = tuple(self.tags)
        if not all(isinstance(t, str) for t in tags):
            raise PromptError(f"prompt {self.prompt_id!r}: tags must be strings")
        object.__setattr__(self, "tags", tags)
        version = self.policy_version
        if not isinstance(version, int) or isinstance(version, bool) or version < -1:
            raise PromptError(f"prompt {self.prompt_id!r}: policy_version must be an integer >= -1, got {version!r}")

    def to_json(self) -> bytes:
        record: dict[str, Any] = {
            "schema_version": 1 if self.messages is None else PROMPT_SCHEMA_VERSION,
            "prompt_id": self.prompt_id,
            "text": self.text,
            "token_ids": None if self.token_ids is None else list(self.token_ids),
            "answer": self.answer,
            "tags": list(self.tags),
            "metadata": dict(self.metadata),
            "policy_version": self.policy_version,
        }
        if self.messages is not None:
            record["messages"] = [dict(m) for m in self.messages]
        return orjson.dumps(record)

    @classmethod
    def from_json(cls, data: bytes) -> Prompt:
        """Decode and validate; raises `PromptError` naming the field for any invalid payload."""
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise PromptError(f"not JSON: {exc}") from exc
        if not isinstance(obj, dict):
            raise PromptError(f"expected a JSON object, got {str(obj)[:80]}")
        if "schema_version" not in obj:
            raise PromptError(
                f"prompt {obj.get('prompt_id')!r}: schema_version missing (this build reads {PROMPT_SCHEMA_VERSION})"
            )
        version = obj["schema_version"]
        if type(version) is not int or version not in READ_SCHEMA_VERSIONS:
            raise PromptError(
                f"prompt {obj.get('prompt_id')!r}: schema_version {version!r} unknown "
                f"(this build reads {list(READ_SCHEMA_VERSIONS)})"
            )
        fields = WIRE_FIELDS if version >= 2 else WIRE_FIELDS - {"messages"}
        if unknown := set(obj) - fields:
            raise PromptError(f"unknown prompt fields {sorted(unknown)} (expected {sorted(fields)})")
        tags = obj.get("tags") or ()
        if not isinstance(tags, list | tuple):
            raise PromptError(f"prompt {obj.get('prompt_id')!r}: tags must be a list")
        return cls(
            prompt_id=obj.get("prompt_id"),
            text=obj.get("text"),
            token_ids=obj.get("token_ids"),
            messages=obj.get("messages"),
            answer=obj.get("answer"),
            metadata=obj.get("metadata") or {},
            tags=tuple(tags),
            policy_version=obj.get("policy_version", -1),
        )


def _checked_messages(prompt_id: str, messages: object) -> tuple[dict[str, Any], ...]:
    """The chat as a tuple of plain dicts; `PromptError` naming the message and field otherwise."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise PromptError(f"prompt {prompt_id!r}: messages must be a non-empty list of {{role, content}} objects")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise PromptError(f"prompt {prompt_id!r}: messages[{i}] must be an object")
        role, content = message.get("role"), message.get("content")
        if role not in MESSAGE_ROLES:
            raise PromptError(
                f"prompt {prompt_id!r}: messages[{i}].role {role!r} is not one of {sorted(MESSAGE_ROLES)}"
            )
        if content is not None and not isinstance(content, str | list):
            raise PromptError(f"prompt {prompt_id!r}: messages[{i}].content must be a string, a list of parts or null")
        out.append({str(k): v for k, v in message.items()})
    return tuple(out)
