"""The files a FlashReader reads, opened uncached where the file system allows (O_DIRECT on
Linux, F_NOCACHE on macOS; the page cache, logged once, where refused: reader.py says why),
and the errors a read raises, naming the file, the offset and why."""

import errno
import logging
import os
import sys

from ..errors import ModelFileError

log = logging.getLogger("mlx_flash.io")

_F_NOCACHE = 48  # <sys/fcntl.h> on macOS, when Python's fcntl module lacks them
_F_RDAHEAD = 45

_logged = set()


def log_once(key, msg, *args):
    if key not in _logged:
        _logged.add(key)
        log.warning(msg, *args)


class ReadError(ModelFileError):
    """A read that did not deliver: names the file, the offset and why."""

    def __init__(self, file, offset, reason):
        self.file, self.offset, self.reason = str(file), offset, reason
        where = f" at offset {offset}" if offset is not None else ""
        super().__init__(f"{file}: read failed{where}: {reason}")


class ChecksumError(ReadError):
    """A bundle part whose bytes do not match its checksum, read twice."""

    def __init__(self, file, bundle, part, offset):
        self.bundle, self.part = bundle, part
        super().__init__(file, offset, f"bundle {bundle} (part {part}) does not match its checksum, "
                         "read twice: the file is damaged (mlx_flash.verify checks a whole folder; "
                         "convert the model again)")


class FlashFile:
    """An open file of a FlashReader (from reader.open)."""

    __slots__ = ("path", "fd", "size", "direct", "align")

    def __init__(self, path, fd, size, direct, align):
        self.path, self.fd, self.size, self.direct, self.align = path, fd, size, direct, align

    def close(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __repr__(self):
        mode = f"uncached, align {self.align}" if self.direct else "buffered"
        return f"FlashFile({self.path!r}, {self.size} bytes, {mode})"


def logical_block_size(fd):
    """The alignment uncached reads of this file need (4096 when unknown)."""
    if sys.platform.startswith("linux"):
        st = os.fstat(fd)
        dev = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
        # a whole disk has queue/, a partition's parent has it
        for q in (f"{dev}/queue/logical_block_size", f"{dev}/../queue/logical_block_size"):
            try:
                with open(q) as fh:
                    v = int(fh.read())
                if v > 0 and v & (v - 1) == 0:
                    return v
            except (OSError, ValueError):
                pass
    return 4096


def open_uncached(path, direct):
    """-> (fd, uncached?) ; raises OSError for a missing or unreadable file."""
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
    if direct and sys.platform.startswith("linux"):
        try:
            return os.open(path, flags | os.O_DIRECT), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            log_once(("odirect", os.path.dirname(path)),
                     "FlashReader: the file system of %s refuses O_DIRECT; reading through "
                     "the page cache instead (figures will not be the device's)", path)
    fd = os.open(path, flags)
    if direct and sys.platform == "darwin":
        import fcntl

        try:
            fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", _F_NOCACHE), 1)
            fcntl.fcntl(fd, getattr(fcntl, "F_RDAHEAD", _F_RDAHEAD), 0)
            return fd, True
        except OSError as e:
            log_once(("nocache", os.path.dirname(path)),
                     "FlashReader: F_NOCACHE refused for %s (%s); reading through the page cache",
                     path, e)
    elif direct and not sys.platform.startswith("linux"):
        log_once("platform", "FlashReader: no uncached reads on %s; using the page cache",
                 sys.platform)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead on random reads
    return fd, False
