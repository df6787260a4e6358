"""The roman-to-int task's cases: run by tests/checker.py, which alone holds the expected values, against
/app/solution.py in a sandbox of its own (`solution` here stands in for it; standard library only)."""

import reprlib

from solution import roman_to_int

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
    """Each (args, want): roman_to_int(*args) must be exactly want (the label is made before the call)."""
    for args, want in cases:
        name = "roman_to_int(" + ", ".join(reprlib.repr(a) for a in args) + ")"
        check(roman_to_int(*args), want, name)


run_cases(
    [
        (("III",), 3),
        (("LVIII",), 58),
        (("MCMXCIV",), 1994),
        (("I",), 1),
        (("IV",), 4),
        (("IX",), 9),
        (("XL",), 40),
        (("XC",), 90),
        (("CD",), 400),
        (("CM",), 900),
        (("MMMCMXCIX",), 3999),
        (("MMXXIV",), 2024),
        (("DCCCXC",), 890),
    ]
)

print(f"roman-to-int: all {PASSED} checks passed")
