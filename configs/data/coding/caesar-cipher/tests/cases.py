"""The caesar-cipher task's cases: run by tests/checker.py, which alone holds the expected values, against
/app/solution.py in a sandbox of its own (`solution` here stands in for it; standard library only)."""

import reprlib

from solution import caesar

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
    """Each (args, want): caesar(*args) must be exactly want (the label is made before the call)."""
    for args, want in cases:
        name = "caesar(" + ", ".join(reprlib.repr(a) for a in args) + ")"
        check(caesar(*args), want, name)


run_cases(
    [
        (("abc", 1), "bcd"),
        (("Hello, World!", 3), "Khoor, Zruog!"),
        (("abc", -1), "zab"),
        (("xyz", 3), "abc"),
        (("XYZ", 29), "ABC"),
        (("", 5), ""),
        (("café ☃ 123", 1), "dbgé ☃ 123"),
        (("Hello", 0), "Hello"),
        (("Hello", -52), "Hello"),
        (("Zebra", -27), "Ydaqz"),
        (("Khoor, Zruog!", -3), "Hello, World!"),
    ]
)

print(f"caesar-cipher: all {PASSED} checks passed")
