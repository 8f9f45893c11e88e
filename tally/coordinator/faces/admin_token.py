"""The admin token: the secret that lets whoever can read the coordinator's state directory operate
it (``tally job``). Kept apart from the Admin service so the CLI finds the file without importing
the service."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Protocol

ADMIN_TOKEN_FILE = "admin.token"


def load_or_create_admin_token(directory: Path) -> str:
    """``<directory>/admin.token``: 32 random bytes as URL-safe text, mode 0600, made once."""
    path = Path(directory) / ADMIN_TOKEN_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        token = path.read_text().strip()
        if len(token) < 32:
            raise ValueError(f"{path} holds no usable admin token") from None
        return token
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def write_admin_token(directory: Path, token: str) -> None:
    """Put a token made elsewhere (replicas share theirs through the store) where ``tally job``
    and ``tally k8s status`` look for it: replaced atomically, mode 0600."""
    path = Path(directory) / ADMIN_TOKEN_FILE
    tmp = path.with_name(f".{ADMIN_TOKEN_FILE}.{secrets.token_hex(4)}.tmp")
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(token + "\n")
    os.replace(tmp, path)


class SharedSettings(Protocol):
    def shared_setting(self, name: str, proposed: str) -> str: ...


def share_admin_token(settings: SharedSettings, directory: Path) -> str:
    """Replicas: the one token the first of them proposed, agreed through the store and written
    to this replica's state directory, so whoever reads any replica's directory (leading or not)
    can operate the deployment."""
    token = settings.shared_setting("admin_token", secrets.token_urlsafe(32))
    write_admin_token(directory, token)
    return token
