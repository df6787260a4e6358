"""The flatten-nested-list task's cases: run by tests/checker.py, which alone holds the expected values, against
/app/solution.py in a sandbox of its own (`solution` here stands in for it; standard library only)."""

import reprlib

from solution import flatten

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
    """Each (args, want): flatten(*args) must be exactly want (the label is made before the call)."""
    for args, want in cases:
        name = "flatten(" + ", ".join(reprlib.repr(a) for a in args) + ")"
        check(flatten(*args), want, name)


deep = [7]
for _ in range(100):
    deep = [deep]
run_cases(
    [
        (([1, [2, [3, 4]], 5],), [1, 2, 3, 4, 5]),
        (([[], [[]]],), []),
        ((["ab", (1, 2)],), ["ab", (1, 2)]),
        (([],), []),
        (([[[[7]]]],), [7]),
        (([1, [2], [[3]], [[[4]]]],), [1, 2, 3, 4]),
        (([None, [True, [0, -1.5]]],), [None, True, 0, -1.5]),
        (([["x", ["y"]], "z", {"k": [1]}],), ["x", "y", "z", {"k": [1]}]),
        ((deep,), [7]),
    ]
)

print(f"flatten-nested-list: all {PASSED} checks passed")
