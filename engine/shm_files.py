"""The files the engine and the serving app create in shared memory (/dev/shm): staged KV (`kv`, a prefill
engine's; `rx`, KV a decode replica received), their half-written copies (`.tmp`) and a multi-rank engine's
step-queue ring (`mq`). A file in /dev/shm outlives the process that wrote it, so every name says who owns
it, `pagedserve-<kind>-<pid>-...`: the owner removes its files on every exit path it has, and what a process
killed outright leaves, the next engine to start on the host removes (`sweep`)."""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir()
_PREFIX = "pagedserve"
_KINDS = ("kv", "rx", "mq")
_STAGED_KINDS = ("kv", "rx")  # short-lived: bounded by a lease or a request's wait for admission


def owned_prefix(kind: str) -> str:
    """The start of a new file's name: its kind (`kv`, `rx`, `mq`) and this process's pid, its owner."""
    if kind not in _KINDS:
        raise ValueError(f"kind: {kind!r} is not one of {_KINDS}")
    return f"{_PREFIX}-{kind}-{os.getpid()}-"


def staged_path(directory: str, name: str, rank: int) -> Path:
    """Where one rank's part of a staged KV lives."""
    return Path(directory) / f"{name}.rank{rank}.kv"


def owner(name: str) -> tuple[str, int] | None:
    """(kind, owner's pid) of one of our file names; None for any other name."""
    parts = name.split("-", 3)
    if len(parts) < 4 or parts[0] != _PREFIX or parts[1] not in _KINDS or not parts[2].isdigit():
        return None
    return parts[1], int(parts[2])


def _dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def sweep(directory: str | os.PathLike, older_than_s: float | None = None) -> list[str]:
    """Remove our files in `directory` whose owner is dead; with `older_than_s`, also staged KV older than
    that (its owner's pid may have been reused, or belong to another pid namespace), never a live engine's
    ring. Returns the names removed."""
    horizon = time.time() - older_than_s if older_than_s is not None else None
    removed = []
    for path in Path(directory).glob(f"{_PREFIX}-*"):
        found = owner(path.name)
        if found is None:
            continue
        kind, pid = found
        try:
            if _dead(pid) or (horizon is not None and kind in _STAGED_KINDS and path.stat().st_mtime < horizon):
                path.unlink()
                removed.append(path.name)
        except FileNotFoundError:  # another process swept it first
            pass
    if removed:
        logger.info("removed %d file(s) left in %s by processes that are gone", len(removed), directory)
    return removed


def check_writable_dir(directory: str, field: str) -> None:
    """Refuse, naming `field` and the path, a directory this process cannot create files in."""
    path = Path(directory)
    if not path.is_dir():
        raise ValueError(f"{field}: {directory!r} is not a directory; create it or point {field} at one")
    try:
        with tempfile.TemporaryFile(dir=path):  # an unnamed file where the OS allows: nothing to leave behind
            pass
    except OSError as e:
        raise ValueError(f"{field}: cannot create files in {directory!r} ({e.strerror or e}); make it writable "
                         f"by this process or point {field} elsewhere") from None
