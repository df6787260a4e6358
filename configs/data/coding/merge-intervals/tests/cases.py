"""The merge-intervals task's cases: run by tests/checker.py, which alone holds the expected values, against
/app/solution.py in a sandbox of its own (`solution` here stands in for it; standard library only)."""

import reprlib

from solution import merge_intervals

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
    """Each (args, want): merge_intervals(*args) must be exactly want (the label is made before the call)."""
    for args, want in cases:
        name = "merge_intervals(" + ", ".join(reprlib.repr(a) for a in args) + ")"
        check(merge_intervals(*args), want, name)


run_cases(
    [
        (([[1, 3], [2, 6], [8, 10], [15, 18]],), [[1, 6], [8, 10], [15, 18]]),
        (([[1, 4], [4, 5]],), [[1, 5]]),
        (([[5, 6], [1, 2]],), [[1, 2], [5, 6]]),
        (([],), []),
        (([[3, 3]],), [[3, 3]]),
        (([[1, 10], [2, 3], [4, 5]],), [[1, 10]]),
        (([[-5, -1], [-2, 0], [2, 3]],), [[-5, 0], [2, 3]]),
        (([[8, 10], [1, 3], [2, 9]],), [[1, 10]]),
        (([[1, 2], [3, 4]],), [[1, 2], [3, 4]]),
    ]
)
given = [[1, 3], [2, 6], [0, 1]]
check(merge_intervals(given), [[0, 6]], "merge_intervals([[1, 3], [2, 6], [0, 1]])")
check(given, [[1, 3], [2, 6], [0, 1]], "input after merge_intervals")

print(f"merge-intervals: all {PASSED} checks passed")
