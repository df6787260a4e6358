"""The merge-sorted-lists task's cases: run by tests/checker.py, which alone holds the expected values, against
/app/solution.py in a sandbox of its own (`solution` here stands in for it; standard library only)."""

import reprlib

from solution import merge_sorted

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
    """Each (args, want): merge_sorted(*args) must be exactly want (the label is made before the call)."""
    for args, want in cases:
        name = "merge_sorted(" + ", ".join(reprlib.repr(a) for a in args) + ")"
        check(merge_sorted(*args), want, name)


run_cases(
    [
        (([1, 3, 5], [2, 4, 6]), [1, 2, 3, 4, 5, 6]),
        (([1, 1, 2], [1, 3]), [1, 1, 1, 2, 3]),
        (([], []), []),
        (([], [1, 2]), [1, 2]),
        (([1, 2, 3], []), [1, 2, 3]),
        (([-5, 0], [-10, -5, 7]), [-10, -5, -5, 0, 7]),
        (([4, 5, 6], [1, 2, 3]), [1, 2, 3, 4, 5, 6]),
        ((list(range(0, 1000, 2)), list(range(1, 1000, 2))), list(range(1000))),
    ]
)
a, b = [1, 4, 9], [2, 3, 10]
merged = merge_sorted(a, b)
check(merged, [1, 2, 3, 4, 9, 10], "merge_sorted([1, 4, 9], [2, 3, 10])")
check((a, b), ([1, 4, 9], [2, 3, 10]), "inputs after merge_sorted")

print(f"merge-sorted-lists: all {PASSED} checks passed")
