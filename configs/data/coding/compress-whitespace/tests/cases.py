"""The compress-whitespace task's cases: run by tests/checker.py, which alone holds the expected values, against
/app/solution.py in a sandbox of its own (`solution` here stands in for it; standard library only)."""

import reprlib

from solution import compress_whitespace

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
    """Each (args, want): compress_whitespace(*args) must be exactly want (the label is made before the call)."""
    for args, want in cases:
        name = "compress_whitespace(" + ", ".join(reprlib.repr(a) for a in args) + ")"
        check(compress_whitespace(*args), want, name)


run_cases(
    [
        (("  hello   world  ",), "hello world"),
        (("a\t\nb",), "a b"),
        (("",), ""),
        (("   ",), ""),
        (("nochange",), "nochange"),
        (("a b",), "a b"),
        (("x\u00a0\u00a0y",), "x y"),
        (("line1\r\n\r\nline2\n",), "line1 line2"),
        (("  ☃  é ",), "☃ é"),
        (("\u2003em\u2003space",), "em space"),
    ]
)

print(f"compress-whitespace: all {PASSED} checks passed")
