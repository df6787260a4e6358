"""The fizzbuzz-list task's cases: run by tests/checker.py, which alone holds the expected values, against
/app/solution.py in a sandbox of its own (`solution` here stands in for it; standard library only)."""

import reprlib

from solution import fizzbuzz

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
    """Each (args, want): fizzbuzz(*args) must be exactly want (the label is made before the call)."""
    for args, want in cases:
        name = "fizzbuzz(" + ", ".join(reprlib.repr(a) for a in args) + ")"
        check(fizzbuzz(*args), want, name)


FIFTEEN = ["1", "2", "Fizz", "4", "Buzz", "Fizz", "7", "8", "Fizz", "Buzz", "11", "Fizz", "13", "14", "FizzBuzz"]
run_cases(
    [
        ((5,), ["1", "2", "Fizz", "4", "Buzz"]),
        ((0,), []),
        ((-3,), []),
        ((1,), ["1"]),
        ((15,), FIFTEEN),
    ]
)
hundred = fizzbuzz(100)
check(type(hundred), list, "type(fizzbuzz(100))")
check(len(hundred), 100, "len(fizzbuzz(100))")
check(hundred[:15], FIFTEEN, "fizzbuzz(100)[:15]")
check(hundred[29], "FizzBuzz", "fizzbuzz(100)[29]")
check(hundred[98], "Fizz", "fizzbuzz(100)[98]")
check(hundred[99], "Buzz", "fizzbuzz(100)[99]")
check(hundred[96], "97", "fizzbuzz(100)[96]")

print(f"fizzbuzz-list: all {PASSED} checks passed")
