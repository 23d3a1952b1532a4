"""The memory-cgroup runner: each command in a fresh v1/v2 memory cgroup entered by a
shell launcher before exec, its peak and OOM kills read back; the same interface
without a cgroup; dropping the page cache. Imports nothing of the package."""

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ...errors import FlashError

# --- memory cgroups ---


V1_ROOT = Path("/sys/fs/cgroup/memory")
V2_ROOT = Path("/sys/fs/cgroup")


class CgroupUnavailable(FlashError):
    pass


def cgroup_support(v1_root=V1_ROOT, v2_root=V2_ROOT):
    """('v2', root) or ('v1', root) when this process can make memory cgroups; else (None, why)."""
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        return None, "not root: creating a memory cgroup needs root"
    v1_root, v2_root = Path(v1_root), Path(v2_root)
    ctl = v2_root / "cgroup.controllers"
    if ctl.exists():
        try:
            if "memory" in ctl.read_text().split():
                return "v2", v2_root
        except OSError:
            pass
    if (v1_root / "memory.limit_in_bytes").exists():
        return "v1", v1_root
    return None, (f"no memory cgroup: neither {ctl} listing 'memory' (v2) nor "
                  f"{v1_root / 'memory.limit_in_bytes'} (v1) exists")


@dataclass
class CgroupRun:
    returncode: int
    oom_killed: bool
    limit_bytes: int = None
    peak_bytes: int = None  # the cgroup's peak, page cache included (None without a cgroup)
    limit_hits: int = None  # v1 memory.failcnt / v2 memory.events "max"
    oom_kills: int = None
    timed_out: bool = False
    wall_s: float = 0.0
    cgroup: str = None  # v1 | v2 | None

    @property
    def signal(self):
        return -self.returncode if self.returncode < 0 else None


ENTERED_FAILED = 97  # the launcher's exit status when it cannot enter the cgroup
# $0 is cgroup.procs; the shell writes its own pid (which the exec keeps) there.
LAUNCHER = 'echo $$ > "$0" || exit 97; exec "$@"'


class MemoryCgroupRunner:
    """Runs commands one at a time, each in a fresh memory cgroup under
    <root>/mlx_flash_peers_<pid>/run<k>, with an optional byte limit.

        with MemoryCgroupRunner() as runner:
            r = runner.run([sys.executable, "-c", "..."], limit_bytes=64 << 20)
            r.oom_killed, r.peak_bytes
    """

    def __init__(self, name=None, v1_root=V1_ROOT, v2_root=V2_ROOT):
        version, where = cgroup_support(v1_root, v2_root)
        if version is None:
            raise CgroupUnavailable(where)
        self.version = version
        self.path = Path(where) / (name or f"mlx_flash_peers_{os.getpid()}")
        try:
            self.path.mkdir(exist_ok=True)
            if version == "v2":
                _write(self.path / "cgroup.subtree_control", "+memory")
        except OSError as e:
            raise CgroupUnavailable(f"cannot create the memory cgroup {self.path}: {e}")
        self._n = 0
        self.current = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def run(self, cmd, limit_bytes=None, timeout=None, **popen_kwargs):
        self._n += 1
        cg = self.path / f"run{self._n}"
        cg.mkdir()
        try:
            self._set_limit(cg, limit_bytes)
            t0 = time.monotonic()
            launcher = ["/bin/sh", "-c", LAUNCHER, str(cg / "cgroup.procs"), *map(str, cmd)]
            rc, timed_out = _wait(subprocess.Popen(launcher, **popen_kwargs), timeout, self)
            wall = time.monotonic() - t0
            if rc == ENTERED_FAILED:
                raise CgroupUnavailable(f"could not move the child into {cg} (launcher exit {rc})")
            peak, hits, ooms = self._stats(cg)
        finally:
            self._remove(cg)
        oom = ooms > 0 if ooms is not None else (rc == -signal.SIGKILL and bool(hits))
        return CgroupRun(rc, oom, limit_bytes, peak, hits, ooms, timed_out, wall, self.version)

    def _set_limit(self, cg, limit):
        if self.version == "v1":
            if limit is not None:
                _write(cg / "memory.limit_in_bytes", str(int(limit)))
                # with swap accounting, also forbid swapping past the limit
                _try_write(cg / "memory.memsw.limit_in_bytes", str(int(limit)))
        else:
            _write(cg / "memory.max", str(int(limit)) if limit is not None else "max")
            if limit is not None:
                _try_write(cg / "memory.swap.max", "0")

    def _stats(self, cg):
        if self.version == "v1":
            peak = _read_int(cg / "memory.max_usage_in_bytes")
            hits = _read_int(cg / "memory.failcnt")
            ooms = _read_keyed(cg / "memory.oom_control").get("oom_kill")
        else:
            peak = _read_int(cg / "memory.peak")
            events = _read_keyed(cg / "memory.events")
            hits, ooms = events.get("max"), events.get("oom_kill")
        return peak, hits, ooms

    def _remove(self, cg):
        if self.version == "v1":
            _try_write(cg / "memory.force_empty", "0")  # give the page cache charges back
        for _ in range(50):
            try:
                cg.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.05)  # the last task is still leaving
        print(f"[peers] warning: could not remove {cg}", file=sys.stderr)

    def close(self):
        if self.path is None:
            return
        for child in sorted(self.path.glob("run*")):
            if child.is_dir():
                self._remove(child)
        try:
            self.path.rmdir()
        except OSError as e:
            print(f"[peers] warning: could not remove {self.path}: {e}", file=sys.stderr)
        self.path = None


class UnconstrainedRunner:
    """The same interface without a cgroup (not root, or no memory controller)."""

    version = None

    def __init__(self, reason):
        self.reason = reason
        self.current = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def run(self, cmd, limit_bytes=None, timeout=None, **popen_kwargs):
        t0 = time.monotonic()
        rc, timed_out = _wait(subprocess.Popen([str(c) for c in cmd], **popen_kwargs), timeout, self)
        return CgroupRun(rc, False, None, None, None, None, timed_out, time.monotonic() - t0, None)

    def close(self):
        pass


def _wait(proc, timeout, owner):
    owner.current = proc
    try:
        return proc.wait(timeout=timeout), False
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(), True
    except BaseException:
        proc.kill()  # interrupted: never leave a child behind
        proc.wait()
        raise
    finally:
        owner.current = None


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def _try_write(path, text):
    try:
        _write(path, text)
        return True
    except OSError:
        return False


def _read_int(path):
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _read_keyed(path):
    out = {}
    try:
        for line in Path(path).read_text().splitlines():
            k, _, v = line.partition(" ")
            if v.strip().lstrip("-").isdigit():
                out[k] = int(v)
    except OSError:
        pass
    return out


def loadavg():
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def drop_caches():
    """Empty the page cache (root): the next run reads its weights from disk. False if not allowed."""
    try:
        os.sync()
        _write("/proc/sys/vm/drop_caches", "3")
        return True
    except OSError:
        return False
