"""The look-and-say task's cases: run by tests/checker.py, which alone holds the expected values, against
/app/solution.py in a sandbox of its own (`solution` here stands in for it; standard library only)."""

import reprlib

from solution import look_and_say

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
    """Each (args, want): look_and_say(*args) must be exactly want (the label is made before the call)."""
    for args, want in cases:
        name = "look_and_say(" + ", ".join(reprlib.repr(a) for a in args) + ")"
        check(look_and_say(*args), want, name)


run_cases(
    [
        ((1,), "1"),
        ((2,), "11"),
        ((3,), "21"),
        ((4,), "1211"),
        ((5,), "111221"),
        ((6,), "312211"),
        ((7,), "13112221"),
        ((8,), "1113213211"),
    ]
)
check(len(look_and_say(30)), 4462, "len(look_and_say(30))")
check(len(look_and_say(40)), 63138, "len(look_and_say(40))")

print(f"look-and-say: all {PASSED} checks passed")
