"""The untrusted half of a coding task's verifier: imports /app/solution.py and answers the calls `checker.py` sends.

It runs inside a bubblewrap sandbox of its own that `checker.py` starts (its own user, PID, mount, network and IPC
namespaces; only /usr, a read-only /app and a private /tmp: no /tests, no /logs, no /proc, no other process),
with no secret and no expected value in its memory. Whatever the solution does to this process (patches builtins,
replaces this module's functions, prints, exits, forks) it can only change the data this process sends back, and
the checker compares that data with expected values it alone holds. Its source arrives as the first line on stdin
(JSON), so nothing of /tests is mounted here.

Protocol, one JSON object per line: first ``{"ready": true}`` or ``{"import_error": "..."}``; then for each request
``{"call": NAME, "args": [ARG, ...]}`` one reply: ``{"result": VALUE, "same": I or null, "args": {I: ARG}}`` (``same``:
the result is argument I itself; ``args``: the arguments the call changed, as they are after it),
``{"raised": BUILTIN_EXCEPTION_NAME, "message": "..."}`` or ``{"error": "..."}``. Values are typed JSON (`encode`):
a result that is not plain data (None, bool, int, finite float, str, list, tuple, dict) is an error, never
compared.
"""

import builtins
import json
import math
import os
import sys


class NotData(Exception):
    """A value that is not plain data (an object of the solution's own class, a NaN, a set...)."""


def encode(value):
    """``value`` as JSON-able typed data: tuples as ``{"t": [...]}``, dicts as ``{"d": [[key, value], ...]}``;
    exact types only (a subclass of int that claims to equal everything is refused)."""
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        if not math.isfinite(value):
            raise NotData("a float that is not finite")
        return value
    if kind is list:
        if all(type(v) is int or type(v) is str for v in value):
            return value
        return [encode(v) for v in value]
    if kind is tuple:
        return {"t": [encode(v) for v in value]}
    if kind is dict:
        return {"d": [[encode(k), encode(v)] for k, v in value.items()]}
    raise NotData(f"an object of type {kind.__name__}")


def decode(value):
    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, dict):
        if "t" in value:
            return tuple(decode(v) for v in value["t"])
        return {decode(k): decode(v) for k, v in value["d"]}
    return value


def builtin_name(exc):
    """The nearest built-in exception class of ``exc`` (a solution's ``class Bad(ValueError)`` is a ValueError)."""
    for cls in type(exc).__mro__:
        if cls.__module__ == "builtins" and getattr(builtins, cls.__name__, None) is cls:
            return cls.__name__
    return "Exception"


def answer(solution, request):
    function = getattr(solution, str(request.get("call")), None)
    if not callable(function):
        return {"error": f"solution.py defines no function {request.get('call')!r}"}
    args = [decode(a) for a in request["args"]]
    before = [json.dumps(encode(a)) for a in args]
    try:
        result = function(*args)
    except Exception as exc:  # an exception the tests may expect (ValueError...); SystemExit ends this process
        return {"raised": builtin_name(exc), "message": str(exc)[:300]}
    same = next((i for i, a in enumerate(args) if result is a), None)
    try:
        changed = {}
        for i, arg in enumerate(args):
            after = encode(arg)
            if json.dumps(after) != before[i]:
                changed[str(i)] = after
        return {"result": None if same is not None else encode(result), "same": same, "args": changed}
    except (NotData, RecursionError, ValueError) as exc:
        return {"error": f"the result is not plain data: {exc}"}


def main():
    requests = sys.stdin
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what the solution prints goes to stderr, never into the replies
    sys.stdin = open(os.devnull)
    sys.path.insert(0, "/app")
    try:
        import solution
    except BaseException as exc:  # noqa: B036 (an exit or an error at import: the checker is told, nothing passes)
        replies.write(json.dumps({"import_error": f"{type(exc).__name__}: {exc}"[:500]}) + "\n")
        replies.flush()
        return
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    for line in requests:
        try:
            reply = json.dumps(answer(solution, json.loads(line)))
        except (ValueError, RecursionError) as exc:  # an int too long to write, a structure too deep
            reply = json.dumps({"error": f"the result is not plain data: {exc}"})
        replies.write(reply + "\n")
        replies.flush()


main()
