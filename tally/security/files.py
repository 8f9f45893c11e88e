"""Files and directories that hold secrets or promises: private whatever the umask, and written
so that a crash leaves the old content or the new, never a torn file, and the new one on disk."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def private_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` as a directory, creating it and any missing parent 0700 (a umask of 000 must not
    leave a device's keys, state or model cache readable by other users). Directories that
    already exist are left as their owner made them."""
    path = Path(path)
    missing = []
    probe = path
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=0o700)
        except FileExistsError:  # another process made it meanwhile
            continue
        os.chmod(directory, 0o700)  # mkdir's mode is masked by the umask: never widen, only fix
    return path


def write_new(path: Path, data: bytes, mode: int, *, replace: bool) -> None:
    """Write through a temp file with ``mode`` set first; link it into place atomically, failing
    with ``FileExistsError`` if ``path`` appeared meanwhile (unless ``replace``). File and
    directory are fsynced before this returns."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
