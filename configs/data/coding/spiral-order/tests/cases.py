"""The spiral-order task's cases: run by tests/checker.py, which alone holds the expected values, against
/app/solution.py in a sandbox of its own (`solution` here stands in for it; standard library only)."""

import reprlib

from solution import spiral_order

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
    """Each (args, want): spiral_order(*args) must be exactly want (the label is made before the call)."""
    for args, want in cases:
        name = "spiral_order(" + ", ".join(reprlib.repr(a) for a in args) + ")"
        check(spiral_order(*args), want, name)


run_cases(
    [
        (([[1, 2, 3], [4, 5, 6], [7, 8, 9]],), [1, 2, 3, 6, 9, 8, 7, 4, 5]),
        (([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]],), [1, 2, 3, 4, 8, 12, 11, 10, 9, 5, 6, 7]),
        (([],), []),
        (([[1]],), [1]),
        (([[1, 2, 3]],), [1, 2, 3]),
        (([[1], [2], [3]],), [1, 2, 3]),
        (([[1, 2], [3, 4]],), [1, 2, 4, 3]),
        (([[1, 2], [3, 4], [5, 6]],), [1, 2, 4, 6, 5, 3]),
        (([[1, 2, 3], [4, 5, 6]],), [1, 2, 3, 6, 5, 4]),
        (
            ([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]],),
            [1, 2, 3, 4, 8, 12, 16, 15, 14, 13, 9, 5, 6, 7, 11, 10],
        ),
        (([[-1, -2], [-3, -4], [-5, -6], [-7, -8]],), [-1, -2, -4, -6, -8, -7, -5, -3]),
    ]
)

print(f"spiral-order: all {PASSED} checks passed")
