"""The rotate-list task's cases: run by tests/checker.py, which alone holds the expected values, against
/app/solution.py in a sandbox of its own (`solution` here stands in for it; standard library only)."""

import reprlib

from solution import rotate

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
    """Each (args, want): rotate(*args) must be exactly want (the label is made before the call)."""
    for args, want in cases:
        name = "rotate(" + ", ".join(reprlib.repr(a) for a in args) + ")"
        check(rotate(*args), want, name)


run_cases(
    [
        (([1, 2, 3, 4, 5], 2), [4, 5, 1, 2, 3]),
        (([1, 2, 3], -1), [2, 3, 1]),
        (([1, 2, 3, 4, 5], 7), [4, 5, 1, 2, 3]),
        (([], 3), []),
        (([1, 2, 3, 4, 5], 0), [1, 2, 3, 4, 5]),
        (([1, 2, 3, 4, 5], 5), [1, 2, 3, 4, 5]),
        (([1, 2, 3, 4, 5], -7), [3, 4, 5, 1, 2]),
        ((["a"], 100), ["a"]),
        ((["x", "y"], 1), ["y", "x"]),
    ]
)
original = [1, 2, 3]
for k in (0, 1, -4):
    result = rotate(original, k)
    check(result is original, False, f"rotate(items, {k}) is items")
check(original, [1, 2, 3], "input after rotate")

print(f"rotate-list: all {PASSED} checks passed")
