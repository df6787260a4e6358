"""The nth-fibonacci task's cases: run by tests/checker.py, which alone holds the expected values, against
/app/solution.py in a sandbox of its own (`solution` here stands in for it; standard library only)."""

import reprlib

from solution import fib

PASSED = 0


def same(got, want):
    """Equal with the same types all the way down (an object claiming to equal everything does not pass)."""
    if type(got) is not type(want):
        return False
    if isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(same(g, w) for g, w in zip(got, want, strict=True))
    if isinstance(want, dict):
        return all(type(k) is str for k in got) and set(got) == set(want) and all(same(got[k], want[k]) for k in want)
    return got == want


def check(got, want, label):
    global PASSED
    if not same(got, want):
        raise AssertionError(f"{label}: expected {want!r:.300}, got {got!r:.300}")
    PASSED += 1


def run_cases(cases):
    """Each (args, want): fib(*args) must be exactly want (the label is made before the call)."""
    for args, want in cases:
        name = "fib(" + ", ".join(reprlib.repr(a) for a in args) + ")"
        check(fib(*args), want, name)


def reference(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


run_cases(
    [
        ((0,), 0),
        ((1,), 1),
        ((2,), 1),
        ((10,), 55),
        ((50,), 12586269025),
        ((90,), 2880067194370816120),
        ((100,), 354224848179261915075),
        ((1000,), reference(1000)),
        ((10000,), reference(10000)),
    ]
)
check(len(str(fib(10000))), 2090, "len(str(fib(10000)))")

print(f"nth-fibonacci: all {PASSED} checks passed")
