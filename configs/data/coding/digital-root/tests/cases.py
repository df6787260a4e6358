"""The digital-root task's cases: run by tests/checker.py, which alone holds the expected values, against
/app/solution.py in a sandbox of its own (`solution` here stands in for it; standard library only)."""

import reprlib

from solution import digital_root

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
    """Each (args, want): digital_root(*args) must be exactly want (the label is made before the call)."""
    for args, want in cases:
        name = "digital_root(" + ", ".join(reprlib.repr(a) for a in args) + ")"
        check(digital_root(*args), want, name)


run_cases(
    [
        ((16,), 7),
        ((942,), 6),
        ((0,), 0),
        ((9,), 9),
        ((10,), 1),
        ((132189,), 6),
        ((493193,), 2),
        ((999999999999,), 9),
        ((10**100,), 1),
        ((2**1000,), 7),
    ]
)

print(f"digital-root: all {PASSED} checks passed")
