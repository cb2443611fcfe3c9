"""Crash-safe file writes: temp file in the same folder, fsync, then rename or link."""

from __future__ import annotations

import errno
import os
import stat
import tempfile


def resolved_path(path: str) -> str:
    """``path`` with its folder part as the system resolves it (``os.path.realpath``),
    keeping the last name: ``abspath`` folds ``link/..`` as text, which names
    another folder than the system does when ``link`` is a symbolic link."""
    return os.path.join(os.path.realpath(os.path.dirname(path) or os.curdir), os.path.basename(path))


def not_replaceable(path: str) -> str | None:
    """Why :func:`atomic_write` must not replace ``path``: ``"a symbolic link"`` or
    ``"not a regular file"`` (a device such as /dev/null, a FIFO, socket or folder,
    which a rename would turn into a regular file); None when nothing is there or
    it is a regular file. Raises OSError when ``path`` cannot be looked at."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISREG(st.st_mode):
        return None
    return "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"


def takes_new_files(folder: str) -> bool:
    """Whether :func:`atomic_write` can write in ``folder`` now: it opens for reading
    and a file is created there (and removed). ``os.access`` would say yes to root
    for a folder whose file system takes no new files (/proc, /sys)."""
    try:
        os.close(os.open(folder, os.O_RDONLY | os.O_DIRECTORY))
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
    except OSError:
        return False
    os.close(fd)
    os.unlink(tmp)
    return True


def atomic_write(path: str, data: bytes, mode: int = 0o644, overwrite: bool = True) -> None:
    """Write ``data`` to ``path`` so readers see either nothing or all of it.

    The bytes go to a temp file beside ``path`` (in the folder the system
    resolves ``path``'s own folder part to) created with ``mode``, are
    fsynced, then renamed over ``path`` (``overwrite=True``) or hard-linked to
    it, which fails with FileExistsError if ``path`` exists (``overwrite=False``).
    The folder is fsynced afterwards; it is opened for that first, so a folder
    that cannot be read fails before anything is written. Raises OSError on
    I/O failure. With
    ``overwrite=False`` a failure or an interrupt after the link (the folder's
    fsync) removes ``path`` again, so the call leaves the whole file or nothing;
    a rename cannot be undone, so with ``overwrite=True`` the new file stays.
    Only a regular file is ever replaced: anything :func:`not_replaceable` names
    raises FileExistsError and is left as it is.
    """
    why = not_replaceable(path) if overwrite else None
    if why:
        raise FileExistsError(errno.EEXIST, f"refusing to replace it: it is {why}", path)
    folder = os.path.dirname(resolved_path(path))
    dfd = os.open(folder, os.O_RDONLY)   # before the write: the fsync after the rename must not fail
    tmp, linked = None, False
    try:   # the cleanup knows the temp file once mkstemp returns (an interrupt inside it can still leave one)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if overwrite:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)
            linked = True
            os.unlink(tmp)
        os.fsync(dfd)
    except BaseException:
        if linked:   # this call made the name: a failed write leaves nothing
            os.unlink(path)
        raise
    finally:
        os.close(dfd)
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
