"""The title-case-exceptions task's cases: run by tests/checker.py, which alone holds the expected values, against
/app/solution.py in a sandbox of its own (`solution` here stands in for it; standard library only)."""

import reprlib

from solution import title_case

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
    """Each (args, want): title_case(*args) must be exactly want (the label is made before the call)."""
    for args, want in cases:
        name = "title_case(" + ", ".join(reprlib.repr(a) for a in args) + ")"
        check(title_case(*args), want, name)


run_cases(
    [
        (("the lord of the rings", ["of", "the"]), "The Lord of the Rings"),
        (("a TALE of two CITIES", ["a", "of"]), "A Tale of Two Cities"),
        (("", ["a"]), ""),
        (("hello", []), "Hello"),
        (("OF mice AND men", ["and", "of"]), "Of Mice and Men"),
        (("  war   and peace ", ["AND"]), "War and Peace"),
        (("éclair au chocolat", ["au"]), "Éclair au Chocolat"),
        (("x", ["x"]), "X"),
        (("the the", ["the"]), "The the"),
        (("iPhone sales", []), "Iphone Sales"),
    ]
)

print(f"title-case-exceptions: all {PASSED} checks passed")
