"""The process inside a sandbox that runs its commands: one JSON request per line on stdin, one JSON reply per line
on stdout, one request at a time.

It is what makes a sandbox's state last across `exec` calls: every command is a child of this one long-lived
process, so files, a shell's background jobs and a tmux server outlive the command that started them. The host
side is `pipeline/sandbox/supervised.py`; the sandbox's own interpreter (``python3 -I -S``) reads this file's
source as the first line of its stdin and runs it, so it uses the standard library only, and nothing of the host's.

Why the policy's commands cannot speak for it (the channel is the only way a verdict reaches the host):
- Under bwrap it is the PID namespace's init (``--as-pid-1``): the kernel drops every signal that processes inside
  send it, SIGKILL and SIGSTOP included, and when it ends the kernel kills everything else inside.
- It makes itself non-dumpable first thing (``prctl(PR_SET_DUMPABLE, 0)``): its ``/proc/<pid>/fd`` and ``mem``
  belong to root and ptrace is refused, even to processes of its uid (they hold no capability in its user
  namespace). Commands never inherit the channel: stdin is /dev/null, output goes to pipes, other fds close.
- Every request carries a fresh random ``id`` that its reply (and each chunk of an export) echoes; the host
  treats anything else as tampering.

Requests: ``{"id", "op": "exec", "command", "timeout_s", "cwd", "env", "max_output"}`` (bash -c in its own
process group, killed at the deadline whatever the command did to its output), ``write``/``read`` (base64),
``killall`` (every process but this one, as a group: see `_killall`), ``export`` (killall, then the tree at
``path`` as a tar in ``{"chunk"}`` lines, bounded by ``max_bytes``) and ``import`` (a tar in ``{"chunk"}`` lines
up to ``{"end": true}``, unpacked safely into ``path``). Replies: ``{"id", "ok": true, ...}`` or ``{"id", "ok":
false, "error"}`` for a request that could not be carried out (a missing file).
"""

import base64
import ctypes
import json
import os
import resource
import selectors
import signal
import stat
import subprocess
import sys
import time

READ_CHUNK = 65536
DRAIN_S = 0.05
"""After bash exits: how long to wait for more output before the reply goes (a background job may hold the pipe)."""
KILL_S = 10.0
"""How long killall keeps killing before it reports processes it could not end."""
CHUNK = 1 << 20
PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 4, 36

CONFIG = {"scope": "tree"}
"""argv[1]: ``limits`` (rlimits) and ``scope``: ``namespace`` (pid 1 of its own PID namespace), ``uid`` (the only
process host-wide of a uid of its own) or ``tree`` (neither: the unisolated local backend of an unprivileged host)."""
_wakeup = None


class Channel:
    """The replies of the request in flight, each stamped with its id."""

    def __init__(self, out):
        self.out = out
        self.id = None

    def send(self, reply):
        reply["id"] = self.id
        self.out.write(json.dumps(reply) + "\n")
        self.out.flush()


CHANNEL = Channel(sys.stdout)


def _exec(request):
    started = time.monotonic()
    env = dict(os.environ)
    env.update(request.get("env") or {})
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
    _cpu_limit(proc.pid)
    reply = _watch(proc, started + float(request["timeout_s"]), int(request.get("max_output", 65536)))
    reply["seconds"] = time.monotonic() - started
    return reply


def _watch(proc, deadline, limit):
    """Read the command's output until it exits (plus DRAIN_S for what is still coming), killing its group at the
    deadline whether or not its output is still open (``exec >&-; sleep 1000`` must not outlast it)."""
    outputs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    sizes = {proc.stdout: 0, proc.stderr: 0}
    selector = selectors.DefaultSelector()
    for pipe in outputs:
        os.set_blocking(pipe.fileno(), False)
        selector.register(pipe, selectors.EVENT_READ, "out")
    pidfd = _pidfd(proc.pid)
    if pidfd is not None:
        selector.register(pidfd, selectors.EVENT_READ, "exit")
    if _wakeup is not None:
        selector.register(_wakeup, selectors.EVENT_READ, "child")
    timed_out, exited_at = False, None
    while True:
        now = time.monotonic()
        if exited_at is None and proc.poll() is not None:
            exited_at = now
        if exited_at is None and now >= deadline:
            timed_out = True
            _kill_group(proc.pid)
            proc.wait()
            exited_at = time.monotonic()
        if exited_at is not None and pidfd is not None:
            selector.unregister(pidfd)
            os.close(pidfd)
            pidfd = None
        pipes_open = any(key.data == "out" for key in selector.get_map().values())
        if exited_at is not None and (not pipes_open or now - exited_at > DRAIN_S):
            break
        wait = DRAIN_S if exited_at is not None else min(0.1 if pidfd is None else 1.0, max(0.0, deadline - now))
        for key, _ in selector.select(wait):
            if key.data == "child":
                _drain(_wakeup)
                _reap(keep=proc.pid)
            elif key.data == "out":
                _read_into(selector, key.fileobj, outputs, sizes, limit)
    selector.close()
    for pipe in outputs:
        pipe.close()
    return {
        "ok": True,
        "exit_code": proc.wait(),
        "stdout": outputs[proc.stdout].decode("utf-8", "replace"),
        "stderr": outputs[proc.stderr].decode("utf-8", "replace"),
        "truncated": any(sizes[p] > limit for p in outputs),
        "timed_out": timed_out,
    }


def _read_into(selector, pipe, outputs, sizes, limit):
    try:
        chunk = os.read(pipe.fileno(), READ_CHUNK)
    except BlockingIOError:
        return
    if not chunk:
        selector.unregister(pipe)
        return
    sizes[pipe] += len(chunk)
    room = limit - len(outputs[pipe])
    if room > 0:
        outputs[pipe] += chunk[:room]


def _pidfd(pid):
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # an old kernel or Python: the loop polls every 0.1 s instead
        return None


def _drain(fd):
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _kill_group(pid):
    for kill, target in ((os.killpg, pid), (os.kill, pid)):
        try:
            kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _stat(pid):
    """(state, ppid) of a process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0].decode(), int(fields[1])


def _pids():
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


def _reap(keep=None):
    """Reap this process's dead children but ``keep`` (a running command's bash, whose code Popen reads): as init,
    or a subreaper, every orphan of the sandbox becomes one, and a zombie still counts against the pids limit."""
    me = os.getpid()
    for pid in _pids():
        info = _stat(pid)
        if pid != keep and info is not None and info[0] == "Z" and info[1] == me:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


def _others():
    """The sandbox's processes but this one that are not yet gone."""
    me, scope = os.getpid(), CONFIG["scope"]
    if scope == "uid":
        uid = os.getuid()
        return [p for p in _pids() if p != me and _uid_of(p) == uid]
    if scope == "tree":
        return _descendants(me)
    return [p for p in _pids() if p != me]


def _uid_of(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _descendants(root):
    children = {}
    for pid in _pids():
        info = _stat(pid)
        if info is not None:
            children.setdefault(info[1], []).append(pid)
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _killall(request):
    """Kill every process of the sandbox but this one, as a group, and return once they are gone.

    ``kill(-1, SIGKILL)`` reaches every process this one may signal but itself in one pass under the kernel's task
    list lock, so a process that keeps forking and exiting (a new pid each time) cannot slip between a scan and a
    kill: in its own PID namespace (``namespace``) or as the only holder of a uid of its own (``uid``) that is the
    whole sandbox. It repeats until /proc shows nothing but this process (zombies reaped). ``tree`` (no namespace,
    a shared uid) stops every descendant (SIGSTOP: a stopped process cannot fork), walks again until every one
    found is stopped, then kills them: orphans stay descendants because this process is their subreaper."""
    deadline = time.monotonic() + KILL_S
    seen = set()
    while True:
        _reap()
        left = _others()
        seen.update(left)
        live = [p for p in left if (_stat(p) or ("Z", 0))[0] != "Z"]
        if not left or (not live and CONFIG["scope"] == "uid"):  # a uid's zombies are another parent's to reap
            return {"ok": True, "killed": len(seen)}
        if time.monotonic() > deadline:
            return {"ok": False, "error": f"ProcessesLeft: {left[:20]} still there after {KILL_S:g} s"}
        if CONFIG["scope"] == "tree":
            _stop_then_kill(live)
        elif live:
            try:
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.001)


def _stop_then_kill(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            pass
    if all((_stat(p) or ("T", 0))[0] in "TtZX" for p in _descendants(os.getpid())):
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
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


class TooBig(Exception):
    pass


class ChunkWriter:
    """A file object for tarfile's stream mode that sends what it is given as ``{"chunk"}`` lines, up to a bound."""

    def __init__(self, max_bytes):
        self.buffer = bytearray()
        self.total = 0
        self.max_bytes = max_bytes

    def write(self, data):
        self.total += len(data)
        if self.total > self.max_bytes:
            raise TooBig(f"the tree is over {self.max_bytes} bytes as a tar")
        self.buffer += data
        if len(self.buffer) >= CHUNK:
            self.flush()
        return len(data)

    def flush(self):
        if self.buffer:
            CHANNEL.send({"chunk": base64.b64encode(bytes(self.buffer)).decode()})
            self.buffer = bytearray()


def _export(request):
    """Kill every process, then send the tree at ``path``: regular files, directories and symlinks (stored as links,
    never followed); anything else, and what this process cannot read, is left out and counted."""
    killed = _killall(request)
    if not killed["ok"]:
        return killed
    root, skipped = request["path"], 0
    os.lstat(root)  # a missing root is FileNotFoundError, not an empty tar
    writer = ChunkWriter(int(request["max_bytes"]))
    import tarfile  # here, not at the top: 12 ms of every sandbox's start for a request few sandboxes get

    try:
        with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for top, dirs, files in os.walk(root):
                for name in sorted(dirs) + sorted(files):
                    skipped += _add(tar, os.path.join(top, name), os.path.relpath(os.path.join(top, name), root))
    except TooBig as exc:
        return {"ok": False, "error": "TooBig: " + str(exc)}
    writer.flush()
    return {"ok": True, "bytes": writer.total, "skipped": skipped}


def _add(tar, path, arcname):
    """Add one entry to ``tar``; 1 when it was left out."""
    import tarfile

    try:
        st = os.lstat(path)
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            return 1
        info = tar.gettarinfo(path, arcname)
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        if info.islnk():  # a second hard link: stored as the file it is, never as a link to resolve on import
            info.type, info.linkname, info.size = tarfile.REGTYPE, "", st.st_size
        if info.isreg():
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as f:
                tar.addfile(info, f)
        else:
            tar.addfile(info)
    except PermissionError:
        return 1
    return 0


class ChunkReader:
    """tarfile's stream source: the ``{"chunk"}`` lines that follow an import request, up to ``{"end": true}``."""

    def __init__(self, lines):
        self.lines = lines
        self.buffer = b""
        self.ended = False

    def read(self, size=-1):
        while not self.ended and (size < 0 or len(self.buffer) < size):
            message = json.loads(next(self.lines))
            if message.get("end"):
                self.ended = True
            else:
                self.buffer += base64.b64decode(message["chunk"])
        size = len(self.buffer) if size < 0 else size
        data, self.buffer = self.buffer[:size], self.buffer[size:]
        return data

    def finish(self):
        while not self.ended:
            self.read(1 << 30)


def _import(request, lines):
    import tarfile

    reader = ChunkReader(lines)
    try:
        return _unpack(request["path"], reader)
    except tarfile.TarError as exc:
        raise ValueError("not a tar: " + str(exc)) from exc
    finally:
        reader.finish()  # the channel stays in step whatever went wrong


def _unpack(root, reader):
    """Unpack into ``root``, which nothing else writes to yet; skip (and count) every member that names an absolute
    path or "..", would go through a symlink or over an existing entry, or is not a file, directory or symlink."""
    import tarfile

    skipped, dirs = 0, []
    with tarfile.open(fileobj=reader, mode="r|") as tar:
        for member in tar:
            target = _target(root, member.name)
            if target is None or not (member.isreg() or member.isdir() or member.issym()):
                skipped += 1
                continue
            try:
                if member.isdir():
                    if not os.path.isdir(target) or os.path.islink(target):
                        os.mkdir(target, 0o700)
                    dirs.append((target, member))
                elif member.issym():
                    os.symlink(member.linkname, target)
                else:
                    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                    with os.fdopen(fd, "wb") as f, tar.extractfile(member) as src:
                        while block := src.read(CHUNK):
                            f.write(block)
                    os.chmod(target, member.mode & 0o777)
                    os.utime(target, (member.mtime, member.mtime))
            except (FileExistsError, NotADirectoryError):
                skipped += 1
    for target, member in reversed(dirs):  # last, so a read-only directory still took its files
        os.chmod(target, (member.mode & 0o777) | 0o700)
    return {"ok": True, "skipped": skipped}


def _target(root, name):
    """The path a member unpacks to, its parents made (never through a symlink), or None when it may not."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if name.startswith("/") or not parts or ".." in parts:
        return None
    here = root
    for part in parts[:-1]:
        here = os.path.join(here, part)
        try:
            if not stat.S_ISDIR(os.lstat(here).st_mode):
                return None
        except FileNotFoundError:
            os.mkdir(here, 0o700)
    return os.path.join(here, parts[-1])


OPS = {"exec": _exec, "write": _write, "read": _read, "killall": _killall, "export": _export}


LIMITS = {
    "memory_mb": (resource.RLIMIT_AS, 1 << 20),
    "max_processes": (resource.RLIMIT_NPROC, 1),
    "max_file_mb": (resource.RLIMIT_FSIZE, 1 << 20),
    "max_open_files": (resource.RLIMIT_NOFILE, 1),
    "cpu_time_s": (resource.RLIMIT_CPU, 1),
}


def _limit(limits):
    """Everything this process starts inherits these; the CPU seconds are each command's (`_cpu_limit`), never this
    process's own, or a sandbox that lives long (or makes it reap a storm of orphans) would see it killed."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for name, value in limits.items():
        if name in LIMITS:
            which, unit = LIMITS[name]
            if which == resource.RLIMIT_CPU:
                CONFIG["cpu_s"] = int(value) * unit
            else:
                resource.setrlimit(which, (int(value) * unit, int(value) * unit))


def _cpu_limit(pid):
    """A command's CPU limit, set on its bash once it runs: a preexec_fn would cost every exec 4 ms (fork instead of
    vfork). A process bash forks in its first instants escapes only this backstop: the deadline, killall, the
    cgroup's CPU quota and the sandbox's end still hold it."""
    if "cpu_s" in CONFIG:
        try:
            resource.prlimit(pid, resource.RLIMIT_CPU, (CONFIG["cpu_s"], CONFIG["cpu_s"]))
        except ProcessLookupError:
            pass


def _protect():
    """Non-dumpable (no /proc/self/fd, mem or ptrace for the sandbox's processes); the signals a pid-namespace init
    leaves at their defaults are dropped when sent from inside, so only SIGCHLD (to reap orphans) gets a handler."""
    global _wakeup
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0)")
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if CONFIG["scope"] == "tree" and libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER, 1)")
    if CONFIG["scope"] != "uid":
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        _wakeup = read


def main():
    config = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    CONFIG["scope"] = config.get("scope", "tree")
    _protect()
    _limit(config.get("limits", {}))
    CHANNEL.send({"ok": True, "ready": True, "pid": os.getpid()})
    lines = iter(sys.stdin.readline, "")
    for line in lines:
        try:
            request = json.loads(line)
            CHANNEL.id = request.get("id")
            if request["op"] == "import":
                reply = _import(request, lines)
            else:
                reply = OPS[request["op"]](request)
        except (OSError, KeyError, ValueError, TypeError, StopIteration) as exc:
            reply = {"ok": False, "error": type(exc).__name__ + ": " + str(exc)}
        CHANNEL.send(reply)
        if _wakeup is not None:
            _drain(_wakeup)
            _reap()


if __name__ == "__main__":  # run by the bootstrap, whose module is __main__
    main()
