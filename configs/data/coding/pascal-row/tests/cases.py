"""The pascal-row task's cases: run by tests/checker.py, which alone holds the expected values, against
/app/solution.py in a sandbox of its own (`solution` here stands in for it; standard library only)."""

import reprlib

from solution import pascal_row

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
    """Each (args, want): pascal_row(*args) must be exactly want (the label is made before the call)."""
    for args, want in cases:
        name = "pascal_row(" + ", ".join(reprlib.repr(a) for a in args) + ")"
        check(pascal_row(*args), want, name)


from math import comb  # noqa: E402

run_cases(
    [
        ((0,), [1]),
        ((1,), [1, 1]),
        ((2,), [1, 2, 1]),
        ((4,), [1, 4, 6, 4, 1]),
        ((5,), [1, 5, 10, 10, 5, 1]),
        ((100,), [comb(100, k) for k in range(101)]),
    ]
)
check(pascal_row(30)[15], comb(30, 15), "pascal_row(30)[15]")
check(sum(pascal_row(20)), 2**20, "sum(pascal_row(20))")

print(f"pascal-row: all {PASSED} checks passed")
