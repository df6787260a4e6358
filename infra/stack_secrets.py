"""The embedded stack's secrets: `<dir>/credentials.json` (0600), generated once per stack dir and kept.

It holds the S3 key, the NATS token (the operator user's password, `infra.nats_server.OPERATOR_USER`) and one
NATS password per role user (`nats_users`: `trainer`, `generator`; `infra.nats_server.role_users`). Kept across
restarts, so clients that reconnect forever after `down` and `up` get back in. Nothing here is ever logged or
written to `stack.json`; an unreadable file's error never quotes its contents.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from infra import nats_server
from infra.files import write_private
from infra.process import StackError
from infra.seaweed import Credentials

CREDENTIALS_FILE = "credentials.json"


def load_nats_token(dir: str | Path) -> str:
    """The stack's NATS token from `<dir>/credentials.json` (0600), created by the first `start_stack` there."""
    token = read_secrets(Path(dir)).get("nats_token")
    if not isinstance(token, str) or not token:
        raise StackError(f"{Path(dir) / CREDENTIALS_FILE}: no NATS token; start the stack there (leeway stack up)")
    return token


def load_credentials(dir: str | Path) -> Credentials:
    """The stack's S3 key from `<dir>/credentials.json` (0600), created by the first `start_stack` there."""
    path = Path(dir) / CREDENTIALS_FILE
    try:
        data = json.loads(path.read_text())
        return Credentials(access_key_id=data["access_key_id"], secret_access_key=data["secret_access_key"])
    except FileNotFoundError as exc:
        raise StackError(f"{path}: no stack credentials; start the stack there first (leeway stack up)") from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise StackError(f"{path}: unreadable stack credentials ({type(exc).__name__})") from exc


def ensure_credentials(root: Path) -> Credentials:
    """Load the dir's S3 key, or generate one on first use; the file is kept at 0600."""
    path = root / CREDENTIALS_FILE
    if path.exists():
        if path.stat().st_mode & 0o077:
            path.chmod(0o600)
        return load_credentials(root)
    credentials = Credentials(
        access_key_id="LW" + secrets.token_hex(9).upper(), secret_access_key=secrets.token_urlsafe(30)
    )
    write_private(
        path,
        json.dumps({"access_key_id": credentials.access_key_id, "secret_access_key": credentials.secret_access_key}),
    )
    return credentials


def ensure_nats_token(root: Path) -> str:
    """Load the dir's NATS token, or add a new one to `credentials.json` (a dir from before authentication has none).

    Kept across restarts, like the S3 key: clients that reconnect forever after `down` and `up` get back in.
    """
    data = read_secrets(root)
    token = data.get("nats_token")
    if isinstance(token, str) and token:
        return token
    token = nats_server.new_token()
    write_private(root / CREDENTIALS_FILE, json.dumps({**data, "nats_token": token}))
    return token


def ensure_role_passwords(root: Path) -> dict[str, str]:
    """Load the dir's NATS role passwords (`nats_users` in `credentials.json`), adding any role that has none."""
    data = read_secrets(root)
    passwords = role_passwords(data)
    missing = [role for role in nats_server.ROLE_USERS if role not in passwords]
    if missing:
        passwords.update({role: nats_server.new_token() for role in missing})
        write_private(root / CREDENTIALS_FILE, json.dumps({**data, "nats_users": passwords}))
    return passwords


def role_passwords(secrets_: Mapping[str, Any]) -> dict[str, str]:
    """The role users' passwords in a `credentials.json` dict (`nats_users`), valid entries only."""
    users = secrets_.get("nats_users")
    if not isinstance(users, dict):
        return {}
    return {role: pw for role, pw in users.items() if role in nats_server.ROLE_USERS and isinstance(pw, str) and pw}


def read_secrets(root: Path) -> dict[str, Any]:
    """`credentials.json` as a dict ({} when absent); the error for an unreadable file never quotes its contents."""
    path = root / CREDENTIALS_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except ValueError as exc:
        raise StackError(f"{path}: unreadable stack credentials ({type(exc).__name__})") from exc
    if not isinstance(data, dict):
        raise StackError(f"{path}: unreadable stack credentials (not a JSON object)")
    return data
