"""Inference engines behind one interface (`Engine`): the in-process torch engine now, SGLang later.

Only the interface is imported here; an engine module is imported by whoever chooses it, so heavy
optional dependencies stay out of processes that do not use them.
"""

from actors.generator.engines.base import (
    Engine,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    NamedTensors,
    SamplingParams,
)

__all__ = ["Engine", "FinishReason", "GenerateRequest", "GenerateResult", "NamedTensors", "SamplingParams"]
