"""The trusted half of a coding task's verifier: runs the task's cases (tests/cases.py) against /app/solution.py,
which it never imports; exit 0 only when every check passed. Run by tests/test.sh as ``python3 -I`` (no /app, no
current directory and no user site on its path, no PYTHON* variable read).

The solution runs in `child.py`, inside a bubblewrap sandbox nested in the verifier's: its own user, PID, mount,
network and IPC namespaces, only /usr, a read-only /app and a private /tmp (no /tests, no /logs, no /proc, no
other process in view), killed with this process (``--die-with-parent``) and at the deadline. The cases file calls the
solution's functions through a stand-in module ``solution`` (``from solution import f`` works as before): each call
crosses as typed JSON, the result comes back as plain data (a value that is not is a failed check), exceptions
come back as their nearest built-in class, changes to the arguments are mirrored onto the caller's objects and a
result that is its argument comes back as that very object, so the cases' checks (types, mutation, identity)
read as they did when the solution ran in-process. The expected values never leave this process, and there is
no token to steal: the verdict is this process's exit status, which test.sh turns into the reward once this
process, and with it the solution's sandbox, is gone.

Without bubblewrap in the verifier's sandbox (a backend without it, a machine that refuses user namespaces) the
solution is not run at all: the verdict is a failure with a message that says why (reward 0).

This file is the same in every task (configs/data/coding/_harness/ holds the original; sync.py copies it).
"""

import builtins
import json
import os
import runpy
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
MERGED_USR = ("bin", "lib", "lib64", "lib32", "libx32", "sbin")
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime")
BOOTSTRAP = "import sys, json; exec(compile(json.loads(sys.stdin.readline()), 'child.py', 'exec'))"
MAX_REPLY = 64 << 20
STDERR_TAIL = 2000


class Refused(BaseException):
    """The solution broke the protocol (died, hung, sent something that is not data): a BaseException, so no
    ``except Exception`` of a cases file can swallow it, and the verdict records it anyway."""


def _system_argv(bwrap):
    argv = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    argv += ["--ro-bind", "/usr", "/usr"]
    for name in MERGED_USR:
        path = "/" + name
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    for name in ETC_FILES:
        argv += ["--ro-bind-try", "/etc/" + name, "/etc/" + name]
    argv += ["--dev", "/dev", "--tmpfs", "/tmp"]  # no /proc: nothing to look at (and a nested one may be refused)
    argv += ["--ro-bind", "/app", "/app"] if os.path.isdir("/app") else ["--dir", "/app"]
    argv += ["--remount-ro", "/", "--chdir", "/app", "--clearenv"]
    for key, value in (("PATH", SYSTEM_PATH), ("HOME", "/tmp"), ("LANG", "C.UTF-8")):
        argv += ["--setenv", key, value]
    return [*argv, "--", "python3", "-I", "-c", BOOTSTRAP]


class Child:
    """The solution's sandboxed process: one request, one reply line, each before the shared deadline."""

    def __init__(self, deadline):
        self.deadline = deadline
        self.failure = None
        self.calls = 0
        self._buffer = b""
        self._stderr = bytearray()
        self.proc = None

    def start(self):
        bwrap = shutil.which("bwrap", path=SYSTEM_PATH)
        if bwrap is None:
            raise Refused(
                "bubblewrap (bwrap) is not installed where the tests run: the solution is never run "
                "without a sandbox of its own (install bubblewrap in the task's environment)"
            )
        self.proc = subprocess.Popen(
            _system_argv(bwrap),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd="/",
            env={"PATH": SYSTEM_PATH, "LANG": "C.UTF-8"},
            start_new_session=True,
        )
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        with open(os.path.join(HERE, "child.py")) as f:
            self._send(json.dumps(f.read()))
        first = self._receive("the solution's start")
        if "import_error" in first:
            self.fail(f"importing /app/solution.py failed: {first['import_error']}")
        if first.get("ready") is not True:
            self.fail(f"the solution's sandbox did not start: {self.stderr_tail()}")

    def fail(self, why):
        self.failure = self.failure or why
        raise Refused(why)

    def _drain_stderr(self):
        for chunk in iter(lambda: self.proc.stderr.read1(65536), b""):
            self._stderr += chunk
            del self._stderr[:-STDERR_TAIL]

    def stderr_tail(self):
        return bytes(self._stderr).decode(errors="replace").strip()[-STDERR_TAIL:]

    def _send(self, line):
        """One request line, written before the deadline (a stopped child that never reads cannot block us)."""
        data = memoryview(line.encode() + b"\n")
        fd = self.proc.stdin.fileno()
        os.set_blocking(fd, False)
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_WRITE)
            while data:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    self.fail("sending a call: past the deadline")
                if not selector.select(left):
                    continue
                try:
                    data = data[os.write(fd, data[: 1 << 16]) :]
                except BlockingIOError:
                    continue
                except OSError:
                    self.fail(f"the solution's process is gone: {self.stderr_tail()}")

    def _receive(self, what):
        """One reply line as a JSON object, read before the deadline (an endless loop is killed, not waited for)."""
        pipe = self.proc.stdout
        with selectors.DefaultSelector() as selector:
            selector.register(pipe, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    self.fail(f"{what}: past the deadline")
                if not selector.select(left):
                    continue
                chunk = os.read(pipe.fileno(), 1 << 20)
                if not chunk:
                    self.fail(f"{what}: the solution's process ended: {self.stderr_tail()}")
                self._buffer += chunk
                if len(self._buffer) > MAX_REPLY:
                    self.fail(f"{what}: a reply over {MAX_REPLY} bytes")
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            reply = json.loads(line, parse_constant=_no_constant)
        except (ValueError, RecursionError) as exc:
            self.fail(f"{what}: a reply that is not JSON: {exc}")
        if not isinstance(reply, dict):
            self.fail(f"{what}: a reply that is not a JSON object")
        return reply

    def call(self, name, args):
        what = f"{name}(...) call {self.calls + 1}"
        self.calls += 1
        self._send(json.dumps({"call": name, "args": [encode(a) for a in args]}))
        reply = self._receive(what)
        if "error" in reply:
            self.fail(f"{what}: {str(reply['error'])[:300]}")
        if "raised" in reply:
            raise _builtin_exception(reply.get("raised"))(str(reply.get("message", ""))[:300])
        try:
            for index, value in dict(reply.get("args") or {}).items():
                _mirror(args[int(index)], decode(value))
            same = reply.get("same")
            if same is not None:
                return args[int(same)]
            return decode(reply.get("result"))
        except (ValueError, TypeError, KeyError, IndexError, RecursionError) as exc:
            self.fail(f"{what}: a reply that is not typed data: {exc!r:.200}")

    def close(self):
        """Kill the sandbox (the whole PID namespace goes with bwrap) and wait until it is gone."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def _no_constant(name):
    raise ValueError(f"{name} is not a value")


def _builtin_exception(name):
    found = getattr(builtins, str(name), None)
    if isinstance(found, type) and issubclass(found, Exception):
        return found
    return Exception


def encode(value):
    """The checker's arguments as typed JSON (the same encoding as child.py's)."""
    if isinstance(value, tuple):
        return {"t": [encode(v) for v in value]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {"d": [[encode(k), encode(v)] for k, v in value.items()]}
    return value


def decode(value):
    """Typed JSON from the child as plain Python data; anything else raises (a malformed reply fails the run)."""
    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value) is list:
        return [decode(v) for v in value]
    if type(value) is dict and set(value) == {"t"} and type(value["t"]) is list:
        return tuple(decode(v) for v in value["t"])
    if type(value) is dict and set(value) == {"d"} and type(value["d"]) is list:
        out = {}
        for pair in value["d"]:
            if type(pair) is not list or len(pair) != 2:
                raise ValueError("a dict entry that is not a [key, value] pair")
            out[decode(pair[0])] = decode(pair[1])
        return out
    raise ValueError(f"not typed data: {type(value).__name__}")


def _mirror(arg, after):
    """What the solution did to its copy of an argument, done to the caller's object (the cases check inputs)."""
    if type(arg) is list and type(after) is list:
        arg[:] = after
    elif type(arg) is dict and type(after) is dict:
        arg.clear()
        arg.update(after)


def stand_in(child):
    """The module ``solution`` as the cases file sees it: every public name is a function that calls the child."""
    module = types.ModuleType("solution")

    def attribute(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args: child.call(name, args)

    module.__getattr__ = attribute
    return module


def main():
    cases = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "cases.py")
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 10.0
    child = None
    try:
        child = Child(time.monotonic() + seconds)
        child.start()
        sys.modules["solution"] = stand_in(child)
        runpy.run_path(cases, run_name="cases")
        if child.failure is None and child.calls == 0:
            child.failure = "the cases made no call to the solution"
    except Refused as exc:
        why = child.failure if child is not None and child.failure else str(exc)
        print(f"checker: FAIL: {why}", flush=True)
        return 1
    except Exception as exc:  # a failed check (AssertionError) or an error in a check: the solution failed
        print(f"checker: FAIL: {type(exc).__name__}: {exc}"[:2000], flush=True)
        return 1
    finally:
        if child is not None:
            child.close()
    if child.failure is not None:  # a cases file that caught the Refused still fails
        print(f"checker: FAIL: {child.failure}", flush=True)
        return 1
    print(f"checker: PASS ({child.calls} calls)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
