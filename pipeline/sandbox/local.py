"""The unisolated backend: the supervisor runs as a plain child process, in a private directory, with the
generator's uid (or the sandbox's own when root, and its cgroup where one is writable), rlimits and a cleared
environment, and nothing else: the network, the file system and the other processes are all in view, and the
agent's processes can write the supervisor's channel (it is not a PID namespace's init), so a verdict from it
proves nothing. Its killall kills the uid's processes (root) or stops then kills the supervisor's descendants. Refused unless ``sandbox.allow_unisolated:
true`` (`pipeline/sandbox/pool.py`), and logged as such. Sandbox paths are not mounted: a writable directory
such as ``/app`` is ``<root>/app`` on the host, which is where commands start; a task that names absolute paths
in its commands (Harbor's ``/tests``, ``/logs``) needs bwrap or docker.
"""

from __future__ import annotations

from collections.abc import Mapping

from pipeline.sandbox.base import ExecResult
from pipeline.sandbox.supervised import SupervisedSandbox


class LocalSandbox(SupervisedSandbox):
    backend = "local"

    def host_path(self, path: str) -> str:
        """A writable sandbox directory (or a path under it) as the host path that stands for it."""
        assert self.root is not None
        for inside in (*self.spec.writable, "/tmp"):
            if path == inside or path.startswith(inside.rstrip("/") + "/"):
                return str(self.root / inside.strip("/").replace("/", "_")) + path[len(inside) :]
        return path

    def _argv(self, supervisor: list[str]) -> list[str]:
        return supervisor

    def _private_dirs(self) -> tuple[str, ...]:
        return ("tmp", *(p.strip("/").replace("/", "_") for p in self.spec.writable))

    def _path(self, path: str) -> str:
        return self.host_path(path)

    def _cwd(self) -> str | None:
        return self.host_path(self.spec.workdir)

    def _env(self) -> dict[str, str]:
        return {**super()._env(), "HOME": self.host_path("/tmp"), "TMPDIR": self.host_path("/tmp")}

    async def exec(
        self,
        command: str,
        *,
        timeout_s: float,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        max_output: int = 65536,
    ) -> ExecResult:
        return await super().exec(
            command, timeout_s=timeout_s, cwd=self.host_path(cwd or self.spec.workdir), env=env, max_output=max_output
        )
