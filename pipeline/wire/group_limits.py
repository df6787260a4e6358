"""How large a group may be: samples and tokens, checked on a message's headers before anything is inflated.

A group's `[samples, tokens]` loss layout is what a training step allocates; a group of 10^4 samples, or a
56 KiB message whose headers truthfully claim 2^27 tokens (zstd inflates it to gigabytes), must be refused at
the door, from the headers alone, before a claim object is fetched or a byte decompressed. The caps derive
from the run: samples from `rollout.max_group_samples` (default `GROUP_SAMPLES_PER_GROUP_SIZE` x the group
size, room for an agent's branches), tokens from the model's context times the claimed samples (no sample
can be longer than the context: one that is would be refused as `sample_too_long` anyway) and
`rollout.max_group_tokens`. The generator applies the same caps to a group it assembled
(`actors/generator/rollouts.py`), so an honest generator never publishes what the trainer refuses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pipeline.wire.headers import H_NUM_SAMPLES, H_NUM_TOKENS

GROUP_TOO_LARGE = "group_too_large"
"""Dead-letter reason (and generator failure) of a group past `GroupLimits`."""
GROUP_SAMPLES_PER_GROUP_SIZE = 64
"""Default sample cap per group, in units of `advantages.group_size`: an agent's episodes branch into several
samples each, a plain group has exactly group_size."""


@dataclass(frozen=True)
class GroupLimits:
    """The largest group a consumer takes (and a generator publishes)."""

    max_samples: int
    max_sample_tokens: int | None = None
    """The model's context: a group may hold at most samples x this many tokens. None: the model names none."""
    max_tokens: int | None = None
    """A fixed cap on the group's tokens, all samples together (`rollout.max_group_tokens`). None: none."""

    @classmethod
    def for_run(
        cls, *, group_size: int, max_sample_tokens: int | None, max_samples: int | None, max_tokens: int | None
    ) -> GroupLimits:
        """The run's caps (`rollout.max_group_samples`, `rollout.max_group_tokens`), the sample cap defaulting to
        `GROUP_SAMPLES_PER_GROUP_SIZE` x `group_size` (`advantages.group_size`)."""
        samples = max_samples or GROUP_SAMPLES_PER_GROUP_SIZE * group_size
        return cls(max_samples=samples, max_sample_tokens=max_sample_tokens, max_tokens=max_tokens)

    def token_cap(self, num_samples: int) -> int | None:
        """The most tokens a group of `num_samples` samples may hold; None: no cap."""
        caps = [c for c in (self.max_tokens,) if c is not None]
        if self.max_sample_tokens is not None:
            caps.append(max(0, num_samples) * self.max_sample_tokens)
        return min(caps) if caps else None

    def refusal(self, num_samples: int, num_tokens: int) -> str | None:
        """Why a group of this many samples and tokens is too large (naming the cap), or None if it fits."""
        if num_samples > self.max_samples:
            return f"{num_samples} samples, over the cap of {self.max_samples} samples per group (max_group_samples)"
        cap = self.token_cap(num_samples)
        if cap is not None and num_tokens > cap:
            how = (
                f"{num_samples} samples x the model's context of {self.max_sample_tokens} tokens"
                if cap != self.max_tokens
                else "max_group_tokens"
            )
            return f"{num_tokens} tokens, over the cap of {cap} tokens per group ({how})"
        return None

    def header_refusal(self, headers: Mapping[str, str]) -> str | None:
        """`refusal` from a message's claimed sizes (`Leeway-Num-Samples`, `Leeway-Num-Tokens`), before any body is
        read; headers that are missing or not integers are left to the decoder (`bad_headers`)."""
        try:
            num_samples, num_tokens = int(headers[H_NUM_SAMPLES]), int(headers[H_NUM_TOKENS])
        except (KeyError, ValueError, TypeError):
            return None
        return self.refusal(num_samples, num_tokens)
