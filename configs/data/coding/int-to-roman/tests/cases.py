"""The int-to-roman task's cases: run by tests/checker.py, which alone holds the expected values, against
/app/solution.py in a sandbox of its own (`solution` here stands in for it; standard library only)."""

import reprlib

from solution import int_to_roman

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
    """Each (args, want): int_to_roman(*args) must be exactly want (the label is made before the call)."""
    for args, want in cases:
        name = "int_to_roman(" + ", ".join(reprlib.repr(a) for a in args) + ")"
        check(int_to_roman(*args), want, name)


run_cases(
    [
        ((3,), "III"),
        ((58,), "LVIII"),
        ((1994,), "MCMXCIV"),
        ((1,), "I"),
        ((4,), "IV"),
        ((9,), "IX"),
        ((14,), "XIV"),
        ((40,), "XL"),
        ((90,), "XC"),
        ((400,), "CD"),
        ((444,), "CDXLIV"),
        ((2024,), "MMXXIV"),
        ((3999,), "MMMCMXCIX"),
    ]
)

print(f"int-to-roman: all {PASSED} checks passed")
