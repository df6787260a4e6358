"""The matrix-multiply task's cases: run by tests/checker.py, which alone holds the expected values, against
/app/solution.py in a sandbox of its own (`solution` here stands in for it; standard library only)."""

import reprlib

from solution import matmul

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
    """Each (args, want): matmul(*args) must be exactly want (the label is made before the call)."""
    for args, want in cases:
        name = "matmul(" + ", ".join(reprlib.repr(a) for a in args) + ")"
        check(matmul(*args), want, name)


run_cases(
    [
        (([[1, 2], [3, 4]], [[5, 6], [7, 8]]), [[19, 22], [43, 50]]),
        (([[1, 2, 3]], [[4], [5], [6]]), [[32]]),
        (([[4], [5], [6]], [[1, 2, 3]]), [[4, 8, 12], [5, 10, 15], [6, 12, 18]]),
        (([[2]], [[-3]]), [[-6]]),
        (([[1, 0], [0, 1]], [[9, 8], [7, 6]]), [[9, 8], [7, 6]]),
        (([[1, 2, 3], [4, 5, 6]], [[7, 8], [9, 10], [11, 12]]), [[58, 64], [139, 154]]),
        (([[10**20]], [[10**20]]), [[10**40]]),
    ]
)
for a, b in (([[1, 2]], [[1, 2]]), ([[1, 2, 3]], [[1], [2]])):
    try:
        matmul(a, b)
    except ValueError:
        check(True, True, f"matmul({a!r}, {b!r}) raises ValueError")
    else:
        raise AssertionError(f"matmul({a!r}, {b!r}) should raise ValueError")

print(f"matrix-multiply: all {PASSED} checks passed")
