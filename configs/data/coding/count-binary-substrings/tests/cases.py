"""The count-binary-substrings task's cases: run by tests/checker.py, which alone holds the expected values, against
/app/solution.py in a sandbox of its own (`solution` here stands in for it; standard library only)."""

import reprlib

from solution import count_binary_substrings

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
    """Each (args, want): count_binary_substrings(*args) must be exactly want (the label is made before the call)."""
    for args, want in cases:
        name = "count_binary_substrings(" + ", ".join(reprlib.repr(a) for a in args) + ")"
        check(count_binary_substrings(*args), want, name)


run_cases(
    [
        (("00110011",), 6),
        (("10101",), 4),
        (("",), 0),
        (("0",), 0),
        (("01",), 1),
        (("0011",), 2),
        (("000111",), 3),
        (("00011",), 2),
        (("1111",), 0),
        (("0110",), 2),
        (("0" * 50_000 + "1" * 50_000,), 50_000),
        (("01" * 50_000,), 99_999),
    ]
)

print(f"count-binary-substrings: all {PASSED} checks passed")
