"""Built-in agent task ``reverse_tool``: reverse digits that arrive through a tool call, over several turns.

The episode, as the built-in agent (`run`) drives it through the generator's endpoint with the real
``openai`` client::

    user       "r"                                    (context)
    assistant  tool call get_digits()                 (context: the harness's scripted first call)
    tool       "314>"                                 (the first chunk of digits)
    assistant  "413"<eos>                             sampled: turn 1
    user       "159>"                                 (the next chunk)
    assistant  "951"<eos>                             sampled: turn 2 ...

Every turn is bridged (the earlier turns' ids are kept, only the new message is rendered), so the trained
sample is the episode's exact ids. The reward is the mean over turns of the per-position credit of
``reverse_digits`` (`pipeline.tasks.reverse.score_reversal`). A reply cut by the length limit ends the episode
(nothing after it is trained on) and the turns not played score 0, so writing ``<eos>`` pays. The tokenizer and chat template are the
built-in chat ones (`pipeline/tasks/chat_tokenizer.py`): one token per character and one per role marker,
so an episode of a few turns of a few digits fits the tiny presets' 128 positions. By default
(``tokenizer: digits``) the alphabet is the digits and ``>`` only, as with ``reverse_digits``: the tool-call
JSON in the context encodes as ``<unk>``s, and a random policy writes digits about half the time;
``tokenizer: chat`` keeps the letters and punctuation the JSON needs.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from itertools import count
from typing import Any

from pipeline.tasks.agents import AgentContext, AgentOutcome
from pipeline.tasks.base import Task, VerifierResult
from pipeline.tasks.chat_tokenizer import load_chat_template_text, load_chat_tokenizer
from pipeline.tasks.reverse import DIGITS, SEPARATOR, score_reversal
from pipeline.wire.prompts import Prompt

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_digits",
            "description": "The digits to reverse.",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]


class ReverseToolTask(Task):
    """``turns`` chunks of ``digits_per_turn`` digits each; see the module docstring."""

    name = "reverse_tool"

    def __init__(self, digits_per_turn: int = 2, turns: int = 2, seed: int = 0, tokenizer: str = "digits") -> None:
        if digits_per_turn < 1 or turns < 1:
            raise ValueError(f"reverse_tool: digits_per_turn and turns must be >= 1, got {digits_per_turn}, {turns}")
        self.digits_per_turn = digits_per_turn
        self.turns = turns
        self.seed = seed
        self.tokenizer: Any = load_chat_tokenizer(tokenizer)
        self.chat_template = load_chat_template_text()
        self.agent = run

    def prompts(self) -> Iterator[Prompt]:
        rng = random.Random(f"reverse_tool-{self.seed}")
        for index in count():
            chunks = ["".join(rng.choice(DIGITS) for _ in range(self.digits_per_turn)) for _ in range(self.turns)]
            yield Prompt(
                prompt_id=f"reverse_tool-s{self.seed}-{index}",
                text="r",
                answer=" ".join(c[::-1] for c in chunks),
                metadata={"chunks": chunks},
                tags=("reverse_tool",),
            )

    def verify(self, prompt: Prompt, completion_text: str, completion_ids: Sequence[int]) -> VerifierResult:
        """Single-turn scoring of the first chunk (the task is meant to run through its agent)."""
        chunks = list(prompt.metadata.get("chunks") or [])
        if not chunks:
            raise ValueError(f"reverse_tool: prompt {prompt.prompt_id!r} has no chunks")
        return VerifierResult(*score_reversal(chunks[0][::-1], completion_text))


async def run(prompt: Prompt, client: Any, ctx: AgentContext) -> AgentOutcome:
    """The built-in agent: the first chunk through a tool result, each later one as a user turn."""
    chunks = [str(c) for c in prompt.metadata["chunks"]]
    call = {"id": "call_0", "type": "function", "function": {"name": "get_digits", "arguments": "{}"}}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "r"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": chunks[0] + SEPARATOR},
    ]
    scores = []
    for k, chunk in enumerate(chunks):
        if k:
            messages.append({"role": "user", "content": chunk + SEPARATOR})
        response = await client.chat.completions.create(
            model=ctx.model, messages=messages, tools=TOOLS, max_tokens=ctx.max_tokens
        )
        choice = response.choices[0]
        scores.append(score_reversal(chunk[::-1], choice.message.content or "")[0])
        if choice.finish_reason == "length":  # cut off: it never trains past here, so the episode ends
            break
        messages.append(choice.message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
    return AgentOutcome(sum(scores) / len(chunks), info={"turn_rewards": scores})
