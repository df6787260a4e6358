"""The matrix-transpose task's cases: run by tests/checker.py, which alone holds the expected values, against
/app/solution.py in a sandbox of its own (`solution` here stands in for it; standard library only)."""

import reprlib

from solution import transpose

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
    """Each (args, want): transpose(*args) must be exactly want (the label is made before the call)."""
    for args, want in cases:
        name = "transpose(" + ", ".join(reprlib.repr(a) for a in args) + ")"
        check(transpose(*args), want, name)


run_cases(
    [
        (([[1, 2, 3], [4, 5, 6]],), [[1, 4], [2, 5], [3, 6]]),
        (([[7]],), [[7]]),
        (([],), []),
        (([[1], [2], [3]],), [[1, 2, 3]]),
        (([[1, 2, 3]],), [[1], [2], [3]]),
        (([[1, 2], [3, 4]],), [[1, 3], [2, 4]]),
        (([[-1, 0], [5, -7], [2, 2]],), [[-1, 5, 2], [0, -7, 2]]),
    ]
)
m = [[1, 2], [3, 4], [5, 6]]
check(transpose(m), [[1, 3, 5], [2, 4, 6]], "transpose([[1, 2], [3, 4], [5, 6]])")
check(m, [[1, 2], [3, 4], [5, 6]], "input after transpose")

print(f"matrix-transpose: all {PASSED} checks passed")
