"""Generator reports as the trainer keeps them: validated on arrival, forgotten when old.

Any NATS client can publish on ``leeway.<run>.metrics.generator``, so a report is untrusted input:
one with a non-numeric number, an oversized body, too many fields or a failure name outside the taxonomy
(`pipeline.failures.FAILURE_NAMES`) is logged and ignored, never allowed to reach the metrics record (where
`generators/tokens_per_s` sums its numbers) or to stop the trainer. A report is kept until a newer one from the same generator replaces it, or until it is
`REPORT_EXPIRY_INTERVALS` report intervals old: a generator that stopped reporting (killed,
partitioned) drops out of the metrics instead of showing its last numbers forever.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import orjson

from pipeline.failures import FAILURE_NAMES
from pipeline.wire.announce import GENERATOR_REPORT_INTERVAL_S

log = logging.getLogger(__name__)

REPORT_MAX_BYTES = 16 * 1024
"""A generator's report is under 1 KiB; anything much larger is not one."""
REPORT_MAX_FIELDS = 64
"""Fields per report (a generator sends about 25)."""
REPORT_MAX_KEY_CHARS = 64
GENERATOR_ID_MAX_CHARS = 128
REPORT_MAX_GENERATORS = 1024
"""Distinct generator ids remembered at once; past it the least recently heard from is forgotten."""
REPORT_EXPIRY_INTERVALS = 10
"""A report older than this many `GENERATOR_REPORT_INTERVAL_S` is dropped from the metrics."""
REPORT_MAX_AGE_S = REPORT_EXPIRY_INTERVALS * GENERATOR_REPORT_INTERVAL_S
TEXT_FIELDS = {"generator_id": GENERATOR_ID_MAX_CHARS, "kind": 32, "endpoint": 256}
"""The only fields that may be strings (with their length bound); every other field is a number or null."""
LOGGED_REJECTIONS_MAX = 64
"""Rejections logged at WARNING (one per field); the rest at DEBUG, so a flood does not drown the log."""


COUNT_FIELDS = {"failure_reasons": 64}
"""Fields that are name -> count maps (the typed failures), with their most names."""
COUNT_NAMES = {"failure_reasons": FAILURE_NAMES}
"""The names each count field may carry: a generator counts only failures of the taxonomy (`pipeline/failures.py`),
so a name outside it is a report from something else (or a generator out of step with this trainer)."""


class ReportError(ValueError):
    """A generator report that is not one; the message names the field."""


def parse_report(data: bytes) -> dict[str, Any]:
    """The report as a dict, or ReportError naming what is wrong (size, JSON, a field's type or size)."""
    if len(data) > REPORT_MAX_BYTES:
        raise ReportError(f"report is {len(data)} bytes > {REPORT_MAX_BYTES}")
    try:
        report = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ReportError(f"report is not JSON: {exc}") from exc
    if not isinstance(report, dict):
        raise ReportError(f"report is a JSON {type(report).__name__}, not an object")
    if len(report) > REPORT_MAX_FIELDS:
        raise ReportError(f"report has {len(report)} fields > {REPORT_MAX_FIELDS}")
    if not isinstance(report.get("generator_id"), str) or not report["generator_id"]:
        raise ReportError(f"field 'generator_id' must be a non-empty string, got {report.get('generator_id')!r:.80}")
    for key, value in report.items():
        if len(key) > REPORT_MAX_KEY_CHARS:
            raise ReportError(f"field name {key[:REPORT_MAX_KEY_CHARS]!r}... longer than {REPORT_MAX_KEY_CHARS}")
        if key in COUNT_FIELDS:
            if (
                not isinstance(value, dict)
                or len(value) > COUNT_FIELDS[key]
                or not all(
                    isinstance(k, str) and len(k) <= REPORT_MAX_KEY_CHARS and type(v) is int and v >= 0
                    for k, v in value.items()
                )
            ):
                raise ReportError(
                    f"field {key!r} must map at most {COUNT_FIELDS[key]} names to counts, got {value!r:.80}"
                )
            unknown = sorted(set(value) - COUNT_NAMES[key])
            if unknown:
                raise ReportError(f"field {key!r} must name known failures (pipeline/failures.py), got {unknown!r:.80}")
        elif key in TEXT_FIELDS:
            if not isinstance(value, str) or len(value) > TEXT_FIELDS[key]:
                raise ReportError(f"field {key!r} must be a string of <= {TEXT_FIELDS[key]} chars, got {value!r:.80}")
        elif value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
        ):
            raise ReportError(f"field {key!r} must be a finite number or null, got {value!r:.80}")
    return report


class GeneratorReports:
    """The newest valid report of each generator heard from recently (see the module docstring)."""

    def __init__(self, *, max_age_s: float = REPORT_MAX_AGE_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_age_s = max_age_s
        self.clock = clock
        self._reports: dict[str, tuple[float, dict[str, Any]]] = {}
        self.num_rejected = 0
        self._logged: set[str] = set()

    def receive(self, data: bytes, subject: str = "") -> bool:
        """Keep a report if it is valid (True); log and ignore it otherwise (False). Never raises."""
        try:
            report = parse_report(data)
        except ReportError as exc:
            self.num_rejected += 1
            key = str(exc).split(" must ", 1)[0]
            first = key not in self._logged and len(self._logged) < LOGGED_REJECTIONS_MAX
            self._logged.add(key)
            log.log(logging.WARNING if first else logging.DEBUG, "ignoring a generator report on %s: %s", subject, exc)
            return False
        generator_id = report["generator_id"]
        self._reports.pop(generator_id, None)  # re-inserted last: the dict stays in order of last report
        self._reports[generator_id] = (self.clock(), report)
        while len(self._reports) > REPORT_MAX_GENERATORS:
            self._reports.pop(next(iter(self._reports)))
        return True

    def current(self) -> dict[str, dict[str, Any]]:
        """Reports no older than `max_age_s`, by generator id (older ones are forgotten here)."""
        now = self.clock()
        for generator_id in [g for g, (at, _) in self._reports.items() if now - at > self.max_age_s]:
            del self._reports[generator_id]
        return {g: report for g, (_, report) in self._reports.items()}

    def tokens_per_s(self) -> float:
        """Sum of the current reports' `tokens_per_s` (validated numbers; null counts 0)."""
        return float(sum(r.get("tokens_per_s") or 0.0 for r in self.current().values()))
