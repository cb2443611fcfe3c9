"""Reading an input file that must be a regular file."""

from __future__ import annotations

import errno
import os
import stat


def read_regular(path: str, limit: int) -> bytes:
    """At most ``limit`` bytes of the regular file ``path``. It is opened without
    blocking and checked before any read, so a FIFO (which would wait for a writer),
    a device or a folder is refused at once. Raises OSError: the system's for a path
    that cannot be opened or read, ``strerror`` "not a regular file" for those."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        return f.read(limit)
