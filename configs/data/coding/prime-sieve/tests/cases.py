"""The prime-sieve task's cases: run by tests/checker.py, which alone holds the expected values, against
/app/solution.py in a sandbox of its own (`solution` here stands in for it; standard library only)."""

import reprlib

from solution import primes_up_to

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
    """Each (args, want): primes_up_to(*args) must be exactly want (the label is made before the call)."""
    for args, want in cases:
        name = "primes_up_to(" + ", ".join(reprlib.repr(a) for a in args) + ")"
        check(primes_up_to(*args), want, name)


run_cases(
    [
        ((10,), [2, 3, 5, 7]),
        ((13,), [2, 3, 5, 7, 11, 13]),
        ((1,), []),
        ((0,), []),
        ((-5,), []),
        ((2,), [2]),
        ((3,), [2, 3]),
        ((30,), [2, 3, 5, 7, 11, 13, 17, 19, 23, 29]),
    ]
)
million = primes_up_to(1_000_000)
check(len(million), 78498, "len(primes_up_to(1_000_000))")
check(million[-1], 999983, "primes_up_to(1_000_000)[-1]")
check(sum(primes_up_to(100)), 1060, "sum(primes_up_to(100))")
check(primes_up_to(49)[-1], 47, "primes_up_to(49)[-1]")

print(f"prime-sieve: all {PASSED} checks passed")
