"""The process inside a sandbox that runs its commands: one JSON request per line on stdin, one JSON reply per line
on stdout, one request at a time.

It is what makes a sandbox's state last across `exec` calls: every command is a child of this one long-lived
process, in the sandbox's one PID namespace, so files, a shell's background jobs and a tmux server outlive the
command that started them, and all of it ends when this process does (the namespace's init then kills the
rest). The host side is `pipeline/sandbox/supervised.py`; the sandbox's own interpreter (``python3 -I -S``)
reads this file's source as the first line of its stdin and runs it, so it uses the standard library only, and nothing of the host's Python.

Requests: ``{"op": "exec", "command", "timeout_s", "cwd", "env", "max_output"}`` (bash -c; the command's process
group is killed at the timeout), ``{"op": "write", "path", "data"}`` and ``{"op": "read", "path", "max_bytes"}``
(base64), ``{"op": "killall"}`` (every process but this one). Replies: ``{"ok": true, ...}`` or ``{"ok": false, "error"}`` for a request that could not be carried
out (a missing file). A command's output stops being read once bash has exited and nothing more is ready, so a
background job holding the pipe open never holds the reply up.
"""

import base64
import json
import os
import resource
import selectors
import signal
import subprocess
import sys
import time

READ_CHUNK = 65536
DRAIN_S = 0.05
"""After bash exits: how long to wait for more output before the reply goes (a background job may hold the pipe)."""


def _exec(request):
    started = time.monotonic()
    env = dict(os.environ)
    env.update(request.get("env") or {})
    limit = int(request.get("max_output", 65536))
    try:
        proc = subprocess.Popen(
            ["/bin/bash", "-c", request["command"]],
            cwd=request.get("cwd") or None,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:  # no process left under the limit, no such cwd: the command failed, the sandbox lives
        return {
            "ok": True,
            "exit_code": 126,
            "stdout": "",
            "stderr": "cannot run the command: " + str(exc) + "\n",
            "truncated": False,
            "timed_out": False,
            "seconds": time.monotonic() - started,
        }
    outputs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    sizes = {proc.stdout: 0, proc.stderr: 0}
    selector = selectors.DefaultSelector()
    for pipe in outputs:
        os.set_blocking(pipe.fileno(), False)
        selector.register(pipe, selectors.EVENT_READ)
    deadline = started + float(request["timeout_s"])
    timed_out = False
    exited_at = None
    while selector.get_map():
        now = time.monotonic()
        if exited_at is None and proc.poll() is not None:
            exited_at = now
        if exited_at is not None and now - exited_at > DRAIN_S:
            break
        if exited_at is None and now >= deadline:
            timed_out = True
            _kill_group(proc.pid)
            proc.wait()
            exited_at = time.monotonic()
        wait = DRAIN_S if exited_at is not None else min(0.1, max(0.0, deadline - now))
        for key, _ in selector.select(wait):
            try:
                chunk = os.read(key.fileobj.fileno(), READ_CHUNK)
            except BlockingIOError:
                continue
            if not chunk:
                selector.unregister(key.fileobj)
                continue
            sizes[key.fileobj] += len(chunk)
            room = limit - len(outputs[key.fileobj])
            if room > 0:
                outputs[key.fileobj] += chunk[:room]
    for pipe in outputs:
        pipe.close()
    code = proc.wait()
    return {
        "ok": True,
        "exit_code": code,
        "stdout": outputs[proc.stdout].decode("utf-8", "replace"),
        "stderr": outputs[proc.stderr].decode("utf-8", "replace"),
        "truncated": any(sizes[p] > limit for p in outputs),
        "timed_out": timed_out,
        "seconds": time.monotonic() - started,
    }


def _kill_group(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _write(request):
    path = request["path"]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb") as f:
        f.write(base64.b64decode(request["data"]))
    if request.get("mode") is not None:
        os.chmod(path, int(request["mode"]))
    return {"ok": True}


def _read(request):
    with open(request["path"], "rb") as f:
        data = f.read(int(request.get("max_bytes", 1 << 24)) + 1)
    limit = int(request.get("max_bytes", 1 << 24))
    return {"ok": True, "data": base64.b64encode(data[:limit]).decode(), "truncated": len(data) > limit}


def _killall(request):
    """Kill every process of the sandbox but this one and the namespace's init (what an agent left running must
    not touch the files a verifier reads)."""
    keep = {os.getpid(), 1}
    killed = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in keep:
            try:
                os.kill(int(entry), signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
    for _ in range(killed):  # reap our own children among them
        try:
            os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
    return {"ok": True, "killed": killed}


OPS = {"exec": _exec, "write": _write, "read": _read, "killall": _killall}


LIMITS = {
    "memory_mb": (resource.RLIMIT_AS, 1 << 20),
    "max_processes": (resource.RLIMIT_NPROC, 1),
    "max_file_mb": (resource.RLIMIT_FSIZE, 1 << 20),
    "max_open_files": (resource.RLIMIT_NOFILE, 1),
    "cpu_time_s": (resource.RLIMIT_CPU, 1),
}


def _limit(limits):
    """Everything this process starts inherits these (the first argument: JSON of `SandboxLimits`)."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for name, value in limits.items():
        which, unit = LIMITS[name]
        resource.setrlimit(which, (int(value) * unit, int(value) * unit))


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    _limit(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {})
    out = sys.stdout
    out.write(json.dumps({"ok": True, "ready": True, "pid": os.getpid()}) + "\n")
    out.flush()
    for line in sys.stdin:
        try:
            request = json.loads(line)
            reply = OPS[request["op"]](request)
        except (OSError, KeyError, ValueError, TypeError) as exc:
            reply = {"ok": False, "error": type(exc).__name__ + ": " + str(exc)}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":  # run by the bootstrap, whose module is __main__
    main()
