"""Writing one large log body to a new file, durably and without a trip through the page cache.

Used by `store.Store` for its side files (the share vectors a party logs:
8 MB each at d = 1e6). A plain ``write`` copies the body into the kernel's
page cache first, and on the loopback benchmark that copy was a third of
an aggregator's CPU per round (fresh page-cache pages, then invalidated
again when compaction deletes the file). With ``O_DIRECT`` (Linux) the
device reads the body straight from our memory instead.

Durability is unchanged: the caller still ``fsync``s the file (its size and
extents, and the device's write cache) and its folder before it commits the
row that names it. ``O_DIRECT`` only decides how the bytes reach the device,
not when they are acknowledged as durable.

``O_DIRECT`` wants the memory address, the length and the file offset of
every write aligned to the device's block size (`ALIGN` covers the common
ones). A body that does not start on such an address is copied, block by
block, through an aligned scratch buffer; the body's last partial block is
written padded with zeros and the file then truncated to the body's size.
Where ``O_DIRECT`` is not supported (another OS, a file system that refuses
it, an odd block size) the file is written the ordinary way, with the same
bytes and the same fsync.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os

import numpy as np

__all__ = ["SideFileWriter", "ALIGN"]

#: Alignment of address, length and offset for direct writes (4 KiB: every common block size divides it).
ALIGN = 4096
#: Scratch size for bodies that are not aligned in memory (copied through it in pieces of this size).
SCRATCH = 1 << 20

_O_DIRECT = getattr(os, "O_DIRECT", 0)


def _address(view: memoryview) -> int:
    """The memory address of the first byte of `view` (read-only views too)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


class SideFileWriter:
    """Writes bodies to files with ``O_DIRECT`` where it works, falling back to plain writes (one per `Store`).

    Not thread-safe: `Store` calls it under its lock.
    """

    def __init__(self, direct: bool = True):
        #: False once direct writes failed here (or were never available): plain writes from then on.
        self.direct = bool(direct and _O_DIRECT)
        self._scratch: mmap.mmap | None = None  # page-aligned, allocated on first use, reused

    def write(self, path: str | os.PathLike[str], body: bytes | bytearray | memoryview) -> None:
        """Create `path` (owner-only, must not exist), write `body` to it and fsync it."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        view = memoryview(body).cast("B")
        fd = -1
        if self.direct:
            try:
                fd = os.open(path, flags | _O_DIRECT, 0o600)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = False  # the file system refuses O_DIRECT (e.g. an older tmpfs)
        if fd < 0:
            fd = os.open(path, flags, 0o600)
        try:
            done = self._write_direct(fd, view) if self.direct else 0
            if done < len(view):  # the rest (all of it without O_DIRECT) the ordinary way
                os.ftruncate(fd, done)
                rest = view[done:]
                while rest:
                    rest = rest[os.pwrite(fd, rest, done):]
                    done = len(view) - len(rest)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _write_direct(self, fd: int, view: memoryview) -> int:
        """Write `view` with O_DIRECT; returns how many bytes are written (all, or fewer after a refusal,
        with O_DIRECT then switched off on `fd` and for this writer)."""
        n = len(view)
        whole = n - n % ALIGN
        pos = 0
        try:
            if _address(view) % ALIGN == 0:
                while pos < whole:  # straight from the caller's memory
                    pos += self._pwrite_aligned(fd, view[pos:whole], pos)
            else:
                scratch = self._scratch_buffer()
                while pos < whole:
                    size = min(SCRATCH, whole - pos)
                    scratch[:size] = view[pos:pos + size]
                    pos += self._pwrite_aligned(fd, memoryview(scratch)[:size], pos)
            if pos < n:  # the last partial block, padded with zeros, then the file cut to size
                tail = n - pos
                scratch = self._scratch_buffer()
                scratch[:tail] = view[pos:]
                scratch[tail:ALIGN] = bytes(ALIGN - tail)
                self._pwrite_aligned(fd, memoryview(scratch)[:ALIGN], pos)
                pos = n
                os.ftruncate(fd, n)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self.direct = False  # e.g. a block size larger than ALIGN: plain writes from here on
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)
            return pos - pos % ALIGN
        return pos

    @staticmethod
    def _pwrite_aligned(fd: int, view: memoryview, offset: int) -> int:
        written = os.pwrite(fd, view, offset)
        if written <= 0 or written % ALIGN:
            # A short direct write that ends mid-block cannot be continued directly.
            raise OSError(errno.EINVAL, "short direct write")
        return written

    def _scratch_buffer(self) -> mmap.mmap:
        if self._scratch is None:
            self._scratch = mmap.mmap(-1, SCRATCH)  # anonymous mappings are page-aligned
        return self._scratch
