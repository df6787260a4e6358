"""The word-frequency task's cases: run by tests/checker.py, which alone holds the expected values, against
/app/solution.py in a sandbox of its own (`solution` here stands in for it; standard library only)."""

import reprlib

from solution import word_frequency

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
    """Each (args, want): word_frequency(*args) must be exactly want (the label is made before the call)."""
    for args, want in cases:
        name = "word_frequency(" + ", ".join(reprlib.repr(a) for a in args) + ")"
        check(word_frequency(*args), want, name)


run_cases(
    [
        (("the cat and the hat",), [("the", 2), ("and", 1), ("cat", 1), ("hat", 1)]),
        (("It's it, IT.",), [("it", 3), ("s", 1)]),
        (("",), []),
        (("a b a c b a",), [("a", 3), ("b", 2), ("c", 1)]),
        (("123 456 !!!",), []),
        (("Café café CAFÉ",), [("café", 3)]),
        (("b a",), [("a", 1), ("b", 1)]),
        (("x_y x2y",), [("x", 2), ("y", 2)]),
        (("hello\nworld\thello",), [("hello", 2), ("world", 1)]),
    ]
)

print(f"word-frequency: all {PASSED} checks passed")
