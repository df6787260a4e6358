"""The two-sum task's cases: run by tests/checker.py, which alone holds the expected values, against
/app/solution.py in a sandbox of its own (`solution` here stands in for it; standard library only)."""

import reprlib

from solution import two_sum

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
    """Each (args, want): two_sum(*args) must be exactly want (the label is made before the call)."""
    for args, want in cases:
        name = "two_sum(" + ", ".join(reprlib.repr(a) for a in args) + ")"
        check(two_sum(*args), want, name)


long = list(range(100_000))
run_cases(
    [
        (([2, 7, 11, 15], 9), (0, 1)),
        (([1, 2, 3, 4], 5), (1, 2)),
        (([1, 2], 7), None),
        (([3, 2, 4], 6), (1, 2)),
        (([3, 3], 6), (0, 1)),
        (([], 0), None),
        (([5], 10), None),
        (([-1, -2, -3, -4], -7), (2, 3)),
        (([0, 4, 3, 0], 0), (0, 3)),
        (([2, 2, 7, 7], 9), (0, 2)),
        ((long, 199_997), (99_998, 99_999)),
        ((long, -1), None),
    ]
)

print(f"two-sum: all {PASSED} checks passed")
