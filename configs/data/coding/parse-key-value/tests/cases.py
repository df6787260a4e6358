"""The parse-key-value task's cases: run by tests/checker.py, which alone holds the expected values, against
/app/solution.py in a sandbox of its own (`solution` here stands in for it; standard library only)."""

import reprlib

from solution import parse_kv

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
    """Each (args, want): parse_kv(*args) must be exactly want (the label is made before the call)."""
    for args, want in cases:
        name = "parse_kv(" + ", ".join(reprlib.repr(a) for a in args) + ")"
        check(parse_kv(*args), want, name)


run_cases(
    [
        (("a=1; b = two",), {"a": "1", "b": "two"}),
        (("x=1;x=2;",), {"x": "2"}),
        (("url=http://h/?q=1",), {"url": "http://h/?q=1"}),
        (("",), {}),
        ((" ; ;",), {}),
        (("k=",), {"k": ""}),
        (("=v",), {"": "v"}),
        (("name = Zoë ; city=Zürich",), {"name": "Zoë", "city": "Zürich"}),
        (("a = b = c",), {"a": "b = c"}),
    ]
)
for bad in ("novalue", "a=1;oops"):
    try:
        parse_kv(bad)
    except ValueError:
        check(True, True, f"parse_kv({bad!r}) raises ValueError")
    else:
        raise AssertionError(f"parse_kv({bad!r}) should raise ValueError")

print(f"parse-key-value: all {PASSED} checks passed")
