"""The gcd-lcm-list task's cases: run by tests/checker.py, which alone holds the expected values, against
/app/solution.py in a sandbox of its own (`solution` here stands in for it; standard library only)."""

import reprlib

from solution import gcd_lcm

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
    """Each (args, want): gcd_lcm(*args) must be exactly want (the label is made before the call)."""
    for args, want in cases:
        name = "gcd_lcm(" + ", ".join(reprlib.repr(a) for a in args) + ")"
        check(gcd_lcm(*args), want, name)


run_cases(
    [
        (([12, 18],), (6, 36)),
        (([2, 3, 4],), (1, 12)),
        (([-4, 6, 10],), (2, 60)),
        (([7],), (7, 7)),
        (([-7],), (7, 7)),
        (([5, 5, 5],), (5, 5)),
        (([6, 10, 15],), (1, 30)),
        (([17, 19],), (1, 323)),
        ((list(range(1, 11)),), (1, 2520)),
        (([10**18, 10**12],), (10**12, 10**18)),
        (([-3, -9],), (3, 9)),
    ]
)

print(f"gcd-lcm-list: all {PASSED} checks passed")
