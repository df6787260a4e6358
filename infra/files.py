"""Files only their owner may read: configs, credentials, pid records.

A resolved config can carry what a reader should not have (a NATS URL with its token, S3 endpoints,
credential file paths), so every copy Leeway writes of one (`leeway run`'s `<run.dir>/config.yaml`, a
fleet role's `fleet/<role>.yaml`) is 0600, like the stack's credentials and certificates.
"""

from __future__ import annotations

import os
from pathlib import Path

PRIVATE_FILE_MODE = 0o600
"""Read and write for the owner, nothing for group and others."""


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` readable by the owner only (0600), without a moment of wider permissions.

    Written to a sibling created 0600 and renamed over `path`, so a file already there with wider
    permissions (from an older version) is replaced, not rewritten in place, and a reader never sees
    half of it.
    """
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
