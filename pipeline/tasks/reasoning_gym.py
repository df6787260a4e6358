"""Built-in task ``reasoning_gym``: any dataset of the reasoning-gym library, by name, split by seed into a train
and an eval set (the optional extra ``leeway[envs]``).

    task:
      name: reasoning_gym
      args: {dataset: chain_sum, size: 2000, eval_size: 200, seed: 0, config: {min_terms: 2, max_terms: 2}}

reasoning-gym generates every item from its seed, so the trainer and each generator build the same items
without shipping any data (for the few datasets whose items also depend on Python's set order, such as
``polynomial_multiplication``, only when every process runs with ``PYTHONHASHSEED=0``, as scorer workers do; a
prompt made elsewhere is refused, naming the cause: a verify of it is an ``infra_error``, and the verifier
self-check refuses the task): a prompt carries its split and index (``metadata``), and the verifier scores the
reply against that item with the dataset's own ``score_answer``, in a scorer worker (`pipeline/tasks/verifiers.py`)
that rebuilds the task from its arguments (`scorer_recipe`): several scorers ``eval`` or ``sympy.parse_expr`` the
answer, and the verifier self-check refuses those (its code-execution probe). The eval set is generated from another seed
(``eval_seed``, default ``seed + EVAL_SEED_OFFSET``) and keeps only items whose question is not in the train
set, so an eval prompt is never trained on (`eval_prompts`).

With ``chat: true`` a prompt is a chat (``messages``: reasoning-gym's instructions as the system message, the
question as the user's), rendered with the model's chat template; otherwise plain text.

Answers (``answer_format``): ``tags`` (the default) reads the answer from ``<answer>...</answer>`` as
reasoning-gym's own prompts ask (its default system prompt is put before the question); a reply without
the tags is a ``format_error``. ``raw`` scores the whole reply, for models too small to learn the tags.

Scorers written for well-formed answers may raise on what a policy writes (``prime_factorization`` on
``"2 × x"``): that is the policy's failure, a ``format_error`` with reward 0, never an ``infra_error``.
Some datasets are traps as shipped (``game_of_life_halting`` scores any non-empty answer 1.0; open-ended
ones have no reference answer): the verifier self-check refuses them at start-up
(`pipeline/tasks/self_check.py`).

Question (``question_format``): the dataset's own ``question`` by default; a format string over the item makes
another, e.g. ``"{metadata[expression]} ="`` gives ``15 - 43 =`` for ``chain_sum``: the same item and verifier
without reasoning-gym's English preamble, which a model with the ``numeric`` alphabet cannot read (and which would
make most of every sequence unknown tokens). Train/eval overlap is judged on the question as formatted.

Tokenizer (the task's ``tokenizer``, unless ``model.tokenizer`` is set): ``text`` (printable ASCII) or
``numeric`` (digits and arithmetic signs), one token per character (`char_tokenizer.alphabet_tokenizer`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer

from pipeline.tasks.base import Task, VerifierResult
from pipeline.tasks.char_tokenizer import ALPHABETS, alphabet_tokenizer
from pipeline.tasks.files import shuffled_epochs
from pipeline.tasks.scorer_recipe import ScorerRecipe
from pipeline.wire.prompts import Prompt

log = logging.getLogger(__name__)

EVAL_SEED_OFFSET = 1_000_003
"""The eval set's default seed is the train seed plus this: far from the seeds a user steps through."""
ANSWER_FORMATS = ("tags", "raw")


class ReasoningGymTask(Task):
    """One reasoning-gym dataset; see the module docstring."""

    name = "reasoning_gym"
    reward_range = (0.0, 1.0)

    def __init__(
        self,
        dataset: str,
        size: int = 1000,
        eval_size: int = 100,
        seed: int = 0,
        eval_seed: int | None = None,
        config: Mapping[str, Any] | None = None,
        answer_format: str = "tags",
        tokenizer: str = "text",
        chat: bool = False,
        question_format: str | None = None,
    ) -> None:
        try:
            import reasoning_gym
            from reasoning_gym.utils import SYSTEM_PROMPTS
        except ImportError as exc:
            raise ValueError(
                f"task reasoning_gym needs the reasoning-gym package: pip install 'leeway[envs]' ({exc})"
            ) from exc
        if answer_format not in ANSWER_FORMATS:
            raise ValueError(
                f"reasoning_gym: task.args.answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}"
            )
        if tokenizer not in ALPHABETS:
            raise ValueError(
                f"reasoning_gym: task.args.tokenizer must be one of {sorted(ALPHABETS)}, got {tokenizer!r}"
            )
        if size < 1 or eval_size < 0:
            raise ValueError(f"reasoning_gym: task.args.size must be >= 1 and eval_size >= 0, got {size}, {eval_size}")
        self.dataset = dataset
        self.seed = seed
        self.eval_seed = seed + EVAL_SEED_OFFSET if eval_seed is None else eval_seed
        self.answer_format = answer_format
        self.chat = chat
        self.instructions = SYSTEM_PROMPTS["default"] if answer_format == "tags" else None
        args = dict(config or {})
        try:
            self._train = reasoning_gym.create_dataset(dataset, size=size, seed=seed, **args)
            held_out = (
                reasoning_gym.create_dataset(dataset, size=eval_size, seed=self.eval_seed, **args) if eval_size else []
            )
        except Exception as exc:  # an unknown name or a bad config argument: the user's, named
            raise ValueError(
                f"reasoning_gym: cannot build dataset {dataset!r} with task.args.config={args}: {exc}"
            ) from exc
        self.question_format = question_format
        if question_format is not None:
            self._question(self._train[0])  # a bad format fails here, named, not in the first generator
        seen = {self._question(self._train[i]) for i in range(len(self._train))}
        self._eval_index = [i for i in range(len(held_out)) if self._question(held_out[i]) not in seen]
        if eval_size and not self._eval_index:
            log.warning(
                "reasoning_gym %s: every one of the %d eval items is also a train question: the eval split is empty "
                "(the dataset's config leaves too few distinct items; widen it or lower size)",
                dataset,
                eval_size,
            )
        elif eval_size and len(self._eval_index) < eval_size:
            log.info(
                "reasoning_gym %s: %d of %d eval items are also train questions and are left out of the eval set",
                dataset,
                eval_size - len(self._eval_index),
                eval_size,
            )
        self._eval = held_out
        self.tokenizer: Tokenizer = alphabet_tokenizer(tokenizer)
        self.scorer_recipe = ScorerRecipe(
            "pipeline.tasks.reasoning_gym:ReasoningGymTask",
            {
                "dataset": dataset,
                "size": size,
                "eval_size": eval_size,
                "seed": seed,
                "eval_seed": self.eval_seed,
                "config": args,
                "answer_format": answer_format,
                "tokenizer": tokenizer,
                "chat": chat,
                "question_format": question_format,
            },
        )
        """A scorer worker rebuilds this very task (every item comes from the seeds: no file to read)."""

    # ---- prompts -------------------------------------------------------------------------------

    def prompts(self) -> Iterator[Prompt]:
        """The train items forever, in an order shuffled per epoch from the seed."""
        for index in shuffled_epochs(range(len(self._train)), f"reasoning_gym-{self.dataset}-{self.seed}"):
            yield self._prompt("train", index)

    def eval_prompts(self) -> list[Prompt]:
        return [self._prompt("eval", index) for index in self._eval_index]

    def _prompt(self, split: str, index: int) -> Prompt:
        entry = self._items(split)[index]
        return Prompt(
            prompt_id=f"{self.dataset}-{split}-s{self.seed if split == 'train' else self.eval_seed}-{index}",
            **self._content(entry),
            answer=None if entry.get("answer") is None else str(entry["answer"]),
            metadata={"dataset": self.dataset, "split": split, "index": index},
            tags=(self.dataset, split),
        )

    def _content(self, entry: Mapping[str, Any]) -> dict[str, Any]:
        """The prompt's ``text``, or its ``messages`` with ``chat`` (the instructions as the system message)."""
        question = self._question(entry)
        if self.chat:
            system = [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
            return {"messages": (*system, {"role": "user", "content": question})}
        return {"text": question if self.instructions is None else f"{self.instructions}\n\n{question}"}

    def _question(self, entry: Mapping[str, Any]) -> str:
        if self.question_format is None:
            return str(entry["question"])
        try:
            return self.question_format.format(**entry)
        except (KeyError, IndexError, AttributeError, ValueError) as exc:
            raise ValueError(
                f"reasoning_gym {self.dataset}: task.args.question_format={self.question_format!r} does not fit its "
                f"items (keys {sorted(entry)}, metadata keys {sorted(entry.get('metadata') or {})}): {exc!r}"
            ) from exc

    def _items(self, split: str) -> Any:
        return self._train if split == "train" else self._eval

    def _entry(self, prompt: Prompt) -> dict[str, Any]:
        """The item a prompt was made from; a prompt this task did not make is an error of the run, not the policy."""
        meta = prompt.metadata
        split, index = meta.get("split"), meta.get("index")
        if meta.get("dataset") != self.dataset or split not in ("train", "eval") or not isinstance(index, int):
            raise ValueError(f"reasoning_gym {self.dataset}: prompt {prompt.prompt_id!r} was not made by this task")
        items = self._items(split)
        if not 0 <= index < len(items) or not self._made(prompt, items[index]):
            raise ValueError(
                f"reasoning_gym {self.dataset}: prompt {prompt.prompt_id!r} does not match {split} item {index}: the "
                "process that made the prompt built the dataset with other arguments, another reasoning-gym, or "
                "another hash seed (a dataset whose items depend on set order, as polynomial_multiplication's do, "
                "differs between processes unless every one runs with PYTHONHASHSEED=0, as scorer workers do)"
            )
        return items[index]

    def _made(self, prompt: Prompt, entry: Mapping[str, Any]) -> bool:
        content = self._content(entry)
        if "text" in content:
            return prompt.text == content["text"]
        # a run's task.system_prompt may have been put first: the task's own messages end the chat
        own = content["messages"]
        return prompt.messages is not None and tuple(prompt.messages[-len(own) :]) == tuple(own)

    # ---- scoring -------------------------------------------------------------------------------

    def completion_for(self, answer: str) -> str:
        return f"<answer>{answer}</answer>" if self.answer_format == "tags" else answer

    def reference_completion(self, prompt: Prompt) -> str | None:
        answer = self._entry(prompt).get("answer")
        return None if answer is None else self.completion_for(str(answer))

    def verify(self, prompt: Prompt, completion_text: str, completion_ids: Sequence[int]) -> VerifierResult:
        from reasoning_gym.utils import extract_answer

        entry = self._entry(prompt)
        if self.answer_format == "tags":
            answer = extract_answer(completion_text)
            if answer is None:
                return VerifierResult(0.0, "format_error", {"reason": "no <answer>...</answer> in the reply"})
        else:
            answer = completion_text.strip()
        try:
            score = self._items(prompt.metadata["split"]).score_answer(answer, entry=entry)
        except Exception as exc:  # the scorer choked on what the policy wrote: the policy's failure
            return VerifierResult(
                0.0, "format_error", {"reason": "scorer_raised", "error": f"{type(exc).__name__}: {exc}"}
            )
        return VerifierResult(float(score))
