"""Run ``python -m lmdbstore ARGS`` in a process that cannot bypass file permissions: as root, with the
capabilities that let root read and write any file (``CAP_DAC_OVERRIDE``, ``CAP_DAC_READ_SEARCH``,
``CAP_FOWNER``) dropped first, so that a store directory of mode 0555 is as read-only to it as another user's
dataset is to its users.  As another user it only runs the CLI.  Exit status 77: the capabilities could not be
dropped (the test skips)."""

from __future__ import annotations

import ctypes
import os
import sys

#: ``_LINUX_CAPABILITY_VERSION_3`` and the capabilities dropped (bits of the first 32-bit word).
CAP_VERSION_3 = 0x20080522
DROPPED = (1 << 1) | (1 << 2) | (1 << 3)


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_dac() -> bool:
    """Drop the capabilities above from this process; whether it worked (always ``True`` when not root)."""
    if os.geteuid() != 0:
        return True
    libc = ctypes.CDLL(None, use_errno=True)
    header, data = _Header(CAP_VERSION_3, 0), (_Data * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        return False
    for field in ("effective", "permitted", "inheritable"):
        setattr(data[0], field, getattr(data[0], field) & ~DROPPED & 0xFFFFFFFF)
    return libc.capset(ctypes.byref(header), data) == 0


if __name__ == "__main__":
    if not drop_dac():
        sys.exit(77)
    from lmdbstore_cli.main import main

    sys.argv = ["lmdbstore", *sys.argv[1:]]
    sys.exit(main())
