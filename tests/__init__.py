"""Leeway's test suite. A package, so that pytest puts the repository root on `sys.path` and the shared
helpers import as `tests.support...` (no test module imports another)."""
