"""`leeway bench sandbox` through the CLI at a tiny size: every key, sane latencies, and the waves held.

Only keys, signs, orderings and the admission bound are checked; how fast a sandbox starts is the bench's
business, never a test's (a machine may be ten times slower or faster).
"""

from __future__ import annotations

import json

import pytest

from actors.cli import main
from actors.tools.bench.sandbox import max_in_window, percentile
from pipeline.sandbox.bwrap import bwrap_binary

TINY = ["--starts", "4", "--execs", "10", "--pool-starts", "6", "--wave-rate", "5", "--concurrency", "3"]
LATENCIES = ("bwrap_start", "local_start", "subprocess_start", "exec", "subprocess_exec")
RATIOS = ("bwrap_vs_local_start", "bwrap_vs_subprocess_start", "exec_vs_subprocess", "waves_vs_no_waves")
KEYS = {
    "backend",
    "starts",
    "execs",
    "pool_starts",
    "wave_rate",
    "concurrency",
    *(f"{name}_{q}_ms" for name in LATENCIES for q in ("p50", "p99")),
    *RATIOS,
    "starts_per_s_waves",
    "starts_per_s_no_waves",
    "max_admitted_in_any_1s_window",
}


@pytest.mark.skipif(bwrap_binary() is None, reason="bubblewrap is not installed")
def test_bench_sandbox_reports_every_key_and_the_waves_hold(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "sandbox", "--json", *TINY]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1, "--json prints one line"
    result = json.loads(lines[0])
    assert set(result) == KEYS
    assert result["backend"] == "bwrap"
    assert (result["starts"], result["execs"], result["pool_starts"], result["concurrency"]) == (4, 10, 6, 3)
    assert result["wave_rate"] == 5
    for name in LATENCIES:
        p50, p99 = result[f"{name}_p50_ms"], result[f"{name}_p99_ms"]
        assert p50 > 0 and p99 >= p50, name
    for key in (*RATIOS, "starts_per_s_waves", "starts_per_s_no_waves"):
        assert result[key] > 0, key
    assert 1 <= result["max_admitted_in_any_1s_window"] <= result["wave_rate"] + 1


def test_window_counts_and_percentiles() -> None:
    assert max_in_window([0.0, 0.5, 1.0, 1.5, 1.6, 1.7], 1.0) == 4  # [1.0, 2.0); 1.0 is outside [0, 1)
    assert max_in_window([3.0, 0.0, 2.0, 1.0], 1.0) == 1  # order does not matter, the edge is open
    assert max_in_window([], 1.0) == 0
    assert percentile([5.0], 99) == 5.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
