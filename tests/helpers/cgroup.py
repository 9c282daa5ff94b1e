"""What a service process really holds in memory, shared memory included: a fresh child memory cgroup per test
module, the service started inside it from its first instruction, and a reader of the cgroup's resident,
non-reclaimable memory (anonymous RSS + shared memory) and its peak.

Why a cgroup: a process's RSS counts the store's mapped file pages (page cache the kernel can drop) and counts an
anonymous shared mapping (``mmap(-1, n)``, a hot pack) only while it is mapped, and only in the process that maps
it; the cgroup is charged for every page its processes allocate, mapped or not, and reports anonymous and shared
memory apart from the page cache.

- cgroup v1 (the memory controller mounted on its own, e.g. /sys/fs/cgroup/memory): ``memory.stat``
  ``total_rss + total_shmem`` (``rss`` there is anonymous memory only; shared memory is counted in ``cache``
  and again in ``shmem``).
- cgroup v2 (unified): ``memory.stat`` ``anon + shmem`` (``anon`` excludes shared memory).

The child is made under the cgroup this process is in (found from /proc/self/cgroup and /proc/self/mountinfo),
so it stays inside whatever limits the machine set. Neither version keeps a peak of anon + shmem (their peaks,
``memory.max_usage_in_bytes`` / ``memory.peak``, include the page cache), so ``MemoryCgroup`` samples it on a
thread every ``interval`` seconds: ``peak_bytes`` is the largest sample (a spike shorter than the interval can
be missed); ``charged_peak_bytes`` is the kernel's own peak of everything charged, page cache included, an upper
bound of it.

Fallback: where no memory cgroup can be made (not root, no memory controller, a v2 parent whose processes forbid
enabling the controller for a child), the figure is the tracked processes' anonymous RSS (``RssAnon`` of
/proc/PID/status: VmRSS without the mapped file pages and shared memory) plus the growth of the machine-wide
``Shmem`` of /proc/meminfo since the context began. That counts other processes' shared memory too, and misses a
process's children it was not told of: an upper bound for shared memory, a lower one for anonymous memory.
``MemoryCgroup.kind`` says which one a figure came from.
"""

from __future__ import annotations

import errno
import os
import secrets
import subprocess
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

RESIDENT_KEYS = {1: ("total_rss", "total_shmem"), 2: ("anon", "shmem")}
CHARGED_PEAK = {1: "memory.max_usage_in_bytes", 2: "memory.peak"}


def _read_stat(path: Path) -> dict[str, int]:
    values = {}
    for line in path.read_text().splitlines():
        name, _, value = line.partition(" ")
        if value.strip().isdigit():
            values[name] = int(value)
    return values


def _meminfo(field: str) -> int:
    """A /proc/meminfo field, in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) << 10
    return 0


def _anon_rss(pid: int) -> int:
    """``RssAnon`` of a live process, in bytes (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) << 10
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def own_memory_cgroup() -> tuple[int, Path] | None:
    """(version, directory) of the memory cgroup this process is in, where one is mounted and visible; else None."""
    try:
        membership = Path("/proc/self/cgroup").read_text().splitlines()
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    v1_path = v2_path = None
    for line in membership:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            v1_path = path
        elif controllers == "":
            v2_path = path
    for line in mounts:
        fields = line.split()
        dash = fields.index("-")
        root, mount_point, fstype, options = fields[3], fields[4], fields[dash + 1], fields[dash + 3]
        if fstype == "cgroup" and v1_path is not None and "memory" in options.split(","):
            return 1, _inside(mount_point, root, v1_path)
        if fstype == "cgroup2" and v2_path is not None and v1_path is None:
            directory = _inside(mount_point, root, v2_path)
            try:
                if "memory" in (directory / "cgroup.controllers").read_text().split():
                    return 2, directory
            except OSError:
                return None
    return None


def _inside(mount_point: str, root: str, path: str) -> Path:
    """The directory of cgroup ``path`` under a hierarchy whose ``root`` is mounted at ``mount_point``."""
    relative = os.path.relpath(path, root) if path.startswith(root) else path.lstrip("/")
    return Path(mount_point) / ("" if relative == "." else relative)


class MemoryCgroup:
    """A child memory cgroup (``path``, cgroup ``version`` 1 or 2), or the fallback (``path`` None); see the module."""

    def __init__(self, path: Path | None, version: int | None, interval: float) -> None:
        self.path, self.version, self.interval = path, version, interval
        self.kind = f"cgroup v{version}" if path is not None else "fallback: RssAnon of the started processes + growth of /proc/meminfo Shmem"
        self._pids: list[int] = []
        self._shmem_before = _meminfo("Shmem")
        self._peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- starting processes inside it ------------------------------------------------------------

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the cgroup from its start: a shell writes 0 (itself) to ``cgroup.procs``, then
        execs ``argv`` under the same pid, so every page the program allocates is charged here. (Not a
        ``preexec_fn``: that runs Python in a forked copy of a process with gRPC's threads, which may deadlock.)
        Unchanged in the fallback."""
        if self.path is None:
            return list(argv)
        return ["/bin/sh", "-c", 'echo 0 > "$0" && exec "$@"', str(self.path / "cgroup.procs"), *argv]

    def track(self, process: subprocess.Popen) -> None:
        """Count ``process`` (needed by the fallback only, harmless otherwise)."""
        self._pids.append(process.pid)

    # -- reading -----------------------------------------------------------------------------

    def resident_bytes(self) -> int:
        """Anonymous + shared memory the cgroup's processes hold now (the fallback: see the module)."""
        if self.path is None:
            return sum(_anon_rss(pid) for pid in self._pids) + max(0, _meminfo("Shmem") - self._shmem_before)
        stat = _read_stat(self.path / "memory.stat")
        return sum(stat.get(key, 0) for key in RESIDENT_KEYS[self.version])

    def sample(self) -> int:
        """Read ``resident_bytes`` once, raising ``peak_bytes`` to it if higher."""
        try:
            now = self.resident_bytes()
        except OSError:  # the cgroup went away at the end
            return 0
        self._peak = max(self._peak, now)
        return now

    @property
    def peak_bytes(self) -> int:
        """The largest anon + shmem seen so far (sampled; read once more now)."""
        self.sample()
        return self._peak

    @property
    def charged_peak_bytes(self) -> int | None:
        """The kernel's peak of all memory charged to the cgroup, page cache included (None: not available)."""
        if self.path is None:
            return None
        try:
            return int((self.path / CHARGED_PEAK[self.version]).read_text())
        except (OSError, ValueError):
            return None

    def report(self) -> str:
        """A line for the robustness report: the peak and where it came from."""
        charged = self.charged_peak_bytes
        extra = f", {charged / 2**20:.0f} MB charged at peak incl. page cache" if charged is not None else ""
        return f"peak anon+shmem {self.peak_bytes / 2**20:.0f} MB{extra} ({self.kind})"

    # -- the sampling thread -----------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="cgroup-memory-sampler", daemon=True)
        self._thread.start()

    def _finish(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


LIMIT_FILE = {1: "memory.limit_in_bytes", 2: "memory.max"}


def _make_child(version: int, parent: Path, name: str, limit_bytes: int | None) -> Path | None:
    """A new child cgroup of ``parent`` with the memory controller (and ``limit_bytes`` as its limit), or None when
    that cannot be had here."""
    child = parent / f"{name}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        child.mkdir()
    except OSError:
        return None
    if version == 2 and not (child / "memory.stat").exists():
        try:  # the parent must hand the controller down; refused (EBUSY) when it has processes of its own
            (parent / "cgroup.subtree_control").write_text("+memory")
        except OSError:
            pass
        if not (child / "memory.stat").exists():
            _remove(child, parent)
            return None
    if limit_bytes is not None:
        try:
            (child / LIMIT_FILE[version]).write_text(str(limit_bytes))
        except OSError:
            warnings.warn(f"could not limit the test cgroup {child} to {limit_bytes} bytes", stacklevel=2)
    return child


def _remove(child: Path, parent: Path) -> None:
    """Move whatever is still in ``child`` to ``parent`` and remove it (a few tries: an exiting process lingers)."""
    for _ in range(50):
        try:
            for pid in (child / "cgroup.procs").read_text().split():
                try:
                    (parent / "cgroup.procs").write_text(pid)
                except OSError:
                    pass
            child.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                break
        time.sleep(0.1)
    warnings.warn(f"could not remove the test cgroup {child}", stacklevel=2)


@contextmanager
def memory_cgroup(name: str = "packstore-test", *, interval: float = 0.02, limit_bytes: int | None = None) -> Iterator[MemoryCgroup]:
    """A fresh child memory cgroup (the fallback where none can be made), sampled every ``interval`` seconds until
    the context ends, then removed. Start processes in it with ``command`` (``running_server(..., cgroup=)`` does);
    they should have ended by the time the context does (whatever is left is moved to the parent).

    ``limit_bytes``: the cgroup's memory limit (page cache included, which the kernel reclaims first), a safety net
    for a machine other tests share: a runaway process is OOM-killed inside the cgroup instead of pressing on
    everyone. None in the fallback."""
    found = own_memory_cgroup()
    child = _make_child(found[0], found[1], name, limit_bytes) if found is not None else None
    cgroup = MemoryCgroup(child, found[0] if child is not None else None, interval)
    cgroup._start()
    try:
        yield cgroup
    finally:
        cgroup._finish()
        if child is not None:
            cgroup.sample()
            _remove(child, found[1])
