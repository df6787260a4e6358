"""Conversations: every turn's exact ids, log-probs and versions, kept per HTTP session as branches of one
episode.

A conversation is one episode, kept under the session id a request names (``/sessions/<id>``, ``session_id``
or ``X-Session-ID``). Each request on it is recorded as a turn: its prompt ids and the engine's result. A turn
whose prompt ids *start with* a branch's ids (that branch's prompt, sampled replies and bridged context, in
order) extends that branch: the branch gains the new context tokens (mask 0, version -1) and the sampled
reply. Any other turn starts a new branch (a rewritten history: compaction, stripped reasoning, a
sub-agent). Matching on ids, not on messages, means a chat turn that was bridged, a token-in turn
(``/inference/v1/generate``) and a completion whose prompt holds the earlier ids all attach alike.

A branch whose last reply ended by length is closed: a later turn on it still gets served, but lands in a
branch marked ``after_length``, which is never trained on (the policy did not choose to stop there).

`Conversation.samples` turns the branches into training samples: loss mask 1 on sampled tokens only, and a
token that several branches share (the same ids at the same positions, sampled in an earlier branch) is
trained in its first branch only, so a shared prefix is not counted twice. It walks each branch once through a
trie of the ids seen so far, so it costs the samples' total length, never branches x branches. The chat layer
keeps each branch's messages too (`Branch.messages`), to find the branch a chat request continues and bridge
from it.

Every conversation is bounded (`SessionLimits`: ``generator.serve.max_session_branches`` and
``max_session_tokens``, the branches' total length, which is what its samples hold): a request that would take
it past either is refused (`SessionFull`: the endpoint's 413 naming the limit), and a conversation an agent run
trains on remembers that it was (``Conversation.refused``), so its episode fails with a typed reason. The
generator's conversations are bounded too (``generator.serve.max_sessions``, agent runs' included): past it the
least recently used one that no agent run holds is dropped, and an agent run that finds every one held is refused
(`SessionFull`, reason ``session_limit``); so are the tokens all of them keep together
(``generator.serve.max_kept_tokens``): a request that needs more drops the least recently used unheld ones, or
is refused (429). A request's branches and tokens are reserved when it is admitted (`check_room`) and held until
it is recorded, so concurrent requests on one session cannot pass its limits together.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.failures import InfraFailure, InfraReason
from pipeline.rl.engine_records import GenerateResult
from pipeline.rl.routes import assemble_routes
from pipeline.rl.turns import Trajectory, Turn, assemble


@dataclass
class Branch:
    """One root-to-leaf path of an episode: turns in order."""

    turns: list[Turn]
    messages: list[tuple[Any, ...]] = field(default_factory=list)
    """The conversation as `pipeline.chat.template.normalized` messages, when the branch came from chat."""
    tools_key: str = ""
    after_length: bool = False

    @functools.cached_property
    def ids(self) -> np.ndarray:
        """Its turns' ids, concatenated once (a branch's turns never change: `Conversation.record` makes a new one)."""
        return np.concatenate([t.token_ids for t in self.turns]) if self.turns else np.zeros(0, np.int32)

    @property
    def closed(self) -> bool:
        """Its last reply ran out of length: nothing after it is trained on."""
        return bool(self.turns) and self.turns[-1].kind == "policy" and self.turns[-1].finish_reason == "length"


@dataclass(frozen=True)
class BranchSample(Trajectory):
    """One branch as a trajectory (`pipeline.rl.turns.Trajectory`), before the episode's reward is known, and its
    index among the conversation's branches."""

    branch: int = field(kw_only=True)


@dataclass(frozen=True)
class SessionLimits:
    """What one conversation may hold (``generator.serve.max_session_branches`` / ``max_session_tokens``)."""

    max_branches: int = 256
    max_tokens: int = 1 << 21
    max_kept_tokens: int = 1 << 26
    """All kept conversations together (``generator.serve.max_kept_tokens``)."""


class SessionFull(InfraFailure):
    """A conversation, or the generator's set of them, is at its limit: ``limit`` names the config field."""

    reason = InfraReason.SESSION_LIMIT

    def __init__(self, detail: str, *, limit: str) -> None:
        super().__init__(detail)
        self.limit = limit


class Conversation:
    """One episode's branches. ``trained``: an agent run opened it, so its branches become samples; other
    conversations are served and kept for bridging only. ``session_id`` is the HTTP session id it is kept
    under ("" for a request served alone)."""

    def __init__(
        self,
        session_id: str,
        *,
        trained: bool = False,
        limits: SessionLimits | None = None,
        owner: Conversations | None = None,
    ) -> None:
        self.session_id = session_id
        self.trained = trained
        self.limits = limits or SessionLimits()
        self.owner = owner
        """The set this conversation is kept in (its tokens count toward ``max_kept_tokens``); None: not kept."""
        self.branches: list[Branch] = []
        self.tokens = 0
        """The branches' total length: what its samples hold."""
        self.pending_branches = 0
        self.pending_tokens = 0
        """Reserved by requests admitted (`check_room`) and not yet recorded."""
        self.refused: SessionFull | None = None
        """The first request refused for a limit of this conversation (an agent run's episode fails with it)."""
        self.lock = asyncio.Lock()
        self.last_used_s = time.monotonic()
        self.requests = 0

    def check_room(self, n: int, prompt_tokens: int) -> None:
        """Reserve room for a request of ``n`` replies to a ``prompt_tokens`` prompt (held until `record` or
        `release`), or refuse it (`SessionFull`) if it would take this conversation, or all kept ones together,
        past their limits; the refusal is remembered in `refused`."""
        limits = self.limits
        branches, tokens = len(self.branches) + self.pending_branches, self.tokens + self.pending_tokens
        needed = n * (prompt_tokens + 1)
        problem = None
        if branches + n - 1 > limits.max_branches:
            problem = SessionFull(
                f"the session has {branches} branches (with requests in flight); {n} more replies would pass "
                f"generator.serve.max_session_branches = {limits.max_branches}",
                limit="generator.serve.max_session_branches",
            )
        elif tokens + needed > limits.max_tokens:
            problem = SessionFull(
                f"the session holds {tokens} tokens (with requests in flight); {n} replies to a {prompt_tokens}-token "
                f"prompt would pass generator.serve.max_session_tokens = {limits.max_tokens}",
                limit="generator.serve.max_session_tokens",
            )
        else:
            try:
                if self.owner is not None:
                    self.owner.make_token_room(needed, keep=self)
            except SessionFull as exc:
                problem = exc
        if problem is not None:
            self.refused = self.refused or problem
            raise problem
        self.pending_branches += n
        self.pending_tokens += needed

    def release(self, n: int, prompt_tokens: int) -> None:
        """Give back what `check_room` reserved for a request that will not be recorded (failed, cancelled)."""
        self.pending_branches = max(0, self.pending_branches - n)
        self.pending_tokens = max(0, self.pending_tokens - n * (prompt_tokens + 1))

    def attach(self, prompt_ids: list[int]) -> tuple[int | None, int]:
        """(branch index, length of its ids) of the longest branch whose ids begin ``prompt_ids``; (None, 0)."""
        best: tuple[int | None, int] = (None, 0)
        prompt = np.asarray(prompt_ids, dtype=np.int64)
        for index, branch in enumerate(self.branches):
            ids = branch.ids
            if best[1] < len(ids) <= len(prompt) and np.array_equal(prompt[: len(ids)], ids):
                best = (index, len(ids))
        return best

    def record(
        self,
        prompt_ids: list[int],
        results: list[GenerateResult],
        *,
        messages: list[tuple[Any, ...]] | None = None,
        replies: list[tuple[Any, ...]] | None = None,
        tools_key: str = "",
    ) -> list[int]:
        """Record one request (``n`` results for one prompt); returns the branch index of each result.

        The first result extends the branch the prompt continues (if its length is still what the prompt
        holds); every other result, or a prompt that continues nothing, becomes a branch of its own that
        copies the shared turns (a choice the client did not pick is still an episode branch: trained on)."""
        self.last_used_s = time.monotonic()
        self.requests += 1
        self.release(len(results), len(prompt_ids))  # now counted in `tokens` and `branches`
        index, length = self.attach(prompt_ids)
        base: list[Turn] = [] if index is None else list(self.branches[index].turns)
        after_length = index is not None and (self.branches[index].closed or self.branches[index].after_length)
        rest = prompt_ids[length:]
        placed = []
        for k, result in enumerate(results):
            turns = list(base)
            if rest:
                turns.append(Turn.context("env" if turns else "prompt", rest))
            turns.append(Turn.policy(result))
            conversation = list(messages or [])
            if replies is not None:
                conversation.append(replies[k])
            branch = Branch(turns, conversation, tools_key, after_length)
            self.tokens += len(branch.ids)
            if k == 0 and index is not None and not after_length:
                self.tokens -= len(self.branches[index].ids)
                self.branches[index] = branch
                placed.append(index)
            else:
                self.branches.append(branch)
                placed.append(len(self.branches) - 1)
        return placed

    def find_chat_branch(self, messages: list[tuple[Any, ...]], tools_key: str) -> tuple[int, int] | None:
        """(branch index, messages it covers) of the branch a chat request continues: its messages are a strict
        prefix of the request's, the rest holds no assistant message, and the tools are the same."""
        best = None
        for index, branch in enumerate(self.branches):
            n = len(branch.messages)
            if not n or n >= len(messages) or branch.tools_key != tools_key or branch.after_length:
                continue
            if messages[:n] == branch.messages and all(m[0] != "assistant" for m in messages[n:]):
                if best is None or n > best[1]:
                    best = (index, n)
        return best

    def samples(self) -> list[BranchSample]:
        """Every trainable branch as arrays; a shared sampled token is trained in its first branch only."""
        out: list[BranchSample] = []
        trie: dict[int, int] = {}  # (prefix node, next id) -> node: one node per distinct prefix
        sampled_at: set[int] = set()  # nodes whose last token an earlier branch sampled
        for index, branch in enumerate(self.branches):
            if branch.after_length or not branch.turns:
                continue
            tokens, sampled, logprobs, versions = assemble(branch.turns)
            nodes = _prefix_nodes(trie, tokens)
            trained_before = np.fromiter((n in sampled_at for n in nodes), bool, len(nodes))
            loss_mask = sampled & ~trained_before
            sampled_at.update(n for n, s in zip(nodes, sampled.tolist(), strict=True) if s)
            if not loss_mask.any():
                continue
            versions = np.where(loss_mask.astype(bool), versions, -1).astype(np.int32)
            logprobs = np.where(loss_mask.astype(bool), logprobs, 0.0).astype(np.float32)
            policy = [t for t in branch.turns if t.kind == "policy"]
            out.append(
                BranchSample(
                    branch=index,
                    tokens=tokens,
                    loss_mask=loss_mask.astype(np.uint8),
                    logprobs=logprobs,
                    versions=versions,
                    finish_reason=policy[-1].finish_reason or "abort",
                    num_turns=len(policy),
                    routes=assemble_routes(branch.turns),
                )
            )
        return out


def _prefix_nodes(trie: dict[int, int], tokens: np.ndarray) -> list[int]:
    """The trie node of each prefix ``tokens[: p + 1]`` (added when new): equal prefixes, equal nodes. An edge is
    keyed ``node << 32 | id`` (a plain int: no tuple for the garbage collector to walk)."""
    node, nodes = 0, []
    for token in tokens.tolist():
        node = trie.setdefault(node << 32 | token, len(trie) + 1)
        nodes.append(node)
    return nodes


class Conversations:
    """Conversations by session id, least recently used out beyond ``max_conversations``
    (``generator.serve.max_sessions``), so clients that never close a session cannot grow the generator's
    memory. An agent run's conversation is pinned while the run holds it (`open` to `close`): evicting it
    would lose the episode's samples; it counts toward the same bound, and a run that finds every conversation
    pinned is refused (`SessionFull`)."""

    def __init__(self, max_conversations: int, limits: SessionLimits | None = None) -> None:
        self.max_conversations = max_conversations
        self.limits = limits or SessionLimits()
        self._conversations: OrderedDict[str, Conversation] = OrderedDict()
        self._pinned: set[str] = set()

    def __len__(self) -> int:
        return len(self._conversations)

    def get(self, session_id: str | None) -> Conversation:
        """The session's conversation (created when new); None: a throw-away conversation of its own. A new
        session when every kept one is an agent run's is refused (`SessionFull`)."""
        if session_id is None:
            return Conversation("", limits=self.limits)
        conversation = self._conversations.get(session_id)
        if conversation is None:
            self._make_room()
            conversation = Conversation(session_id, limits=self.limits, owner=self)
            self._conversations[session_id] = conversation
        self._conversations.move_to_end(session_id)
        return conversation

    def open(self, session_id: str) -> Conversation:
        """A fresh conversation an agent run trains on; pinned until `close`."""
        self._make_room()
        conversation = Conversation(session_id, trained=True, limits=self.limits, owner=self)
        self._conversations[session_id] = conversation
        self._pinned.add(session_id)
        return conversation

    def close(self, session_id: str) -> Conversation | None:
        self._pinned.discard(session_id)
        return self._conversations.pop(session_id, None)

    def make_token_room(self, needed: int, *, keep: Conversation) -> None:
        """Room for ``needed`` more tokens among all kept conversations: the least recently used ones no agent run
        holds and no request is using (not ``keep``) out, or `SessionFull` naming ``max_kept_tokens``."""
        limit = self.limits.max_kept_tokens
        kept = sum(c.tokens + c.pending_tokens for c in self._conversations.values())
        for session_id, conversation in list(self._conversations.items()):
            if kept + needed <= limit:
                return
            idle = not conversation.pending_tokens and not conversation.lock.locked()
            if conversation is not keep and session_id not in self._pinned and idle:
                kept -= conversation.tokens
                del self._conversations[session_id]
        if kept + needed > limit:
            raise SessionFull(
                f"the kept sessions hold {kept} tokens; {needed} more would pass "
                f"generator.serve.max_kept_tokens = {limit}",
                limit="generator.serve.max_kept_tokens",
            )

    def _make_room(self) -> None:
        """Room for one more: the least recently used unpinned conversations out, or `SessionFull`."""
        for session_id in list(self._conversations):
            if len(self._conversations) < self.max_conversations:
                return
            if session_id not in self._pinned:
                del self._conversations[session_id]
        if len(self._conversations) >= self.max_conversations:
            raise SessionFull(
                f"{len(self._conversations)} sessions are open, {len(self._pinned)} of them agent runs' "
                f"(generator.serve.max_sessions = {self.max_conversations})",
                limit="generator.serve.max_sessions",
            )
