"""The run-length-decode task's cases: run by tests/checker.py, which alone holds the expected values, against
/app/solution.py in a sandbox of its own (`solution` here stands in for it; standard library only)."""

import reprlib

from solution import rle_decode

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
    """Each (args, want): rle_decode(*args) must be exactly want (the label is made before the call)."""
    for args, want in cases:
        name = "rle_decode(" + ", ".join(reprlib.repr(a) for a in args) + ")"
        check(rle_decode(*args), want, name)


run_cases(
    [
        (("3a1b2c",), "aaabcc"),
        (("12x",), "x" * 12),
        (("",), ""),
        (("1a1b1c",), "abc"),
        (("2 3!",), "  !!!"),
        (("10é1☃",), "é" * 10 + "☃"),
        (("100a",), "a" * 100),
        (("1a10b",), "a" + "b" * 10),
        (("2A2a",), "AAaa"),
    ]
)

print(f"run-length-decode: all {PASSED} checks passed")
