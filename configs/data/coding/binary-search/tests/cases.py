"""The binary-search task's cases: run by tests/checker.py, which alone holds the expected values, against
/app/solution.py in a sandbox of its own (`solution` here stands in for it; standard library only)."""

import reprlib

from solution import binary_search

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
    """Each (args, want): binary_search(*args) must be exactly want (the label is made before the call)."""
    for args, want in cases:
        name = "binary_search(" + ", ".join(reprlib.repr(a) for a in args) + ")"
        check(binary_search(*args), want, name)


big = list(range(0, 2_000_000, 2))
run_cases(
    [
        (([1, 3, 5, 7], 5), 2),
        (([1, 2, 2, 2, 3], 2), 1),
        (([], 4), -1),
        (([1, 3, 5, 7], 4), -1),
        (([1, 3, 5, 7], 1), 0),
        (([1, 3, 5, 7], 7), 3),
        (([5] * 10, 5), 0),
        (([-10, -3, 0, 0, 8], 0), 2),
        (([-10, -3, 0], -11), -1),
        (([1, 2, 3], 99), -1),
        ((big, 1_999_998), 999_999),
        ((big, 7), -1),
    ]
)

print(f"binary-search: all {PASSED} checks passed")
