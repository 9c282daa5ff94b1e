"""Refuse a damaged store file before LMDB maps it, instead of letting LMDB crash the process.

LMDB keeps no checksums of its own pages: a truncated file makes a read fault (SIGBUS), and a page
whose header is damaged can trip an assertion that aborts the process. packstore checksums every
value it stores (header seals, chunk digests, record digests), so damaged *values* are reported as
DATA_LOSS when read; what is left is LMDB's own structure, checked here when a store is opened:

- ``check_file``: the data file is at least as long as the newest meta page says it must be (else it
  was truncated), read directly from the file, no mapping;
- ``check_structure``: a child process walks every database's tree (every branch and leaf page,
  every node's key and value size); if LMDB reports corruption, or the child dies, the store is
  refused. The walk is remembered in ``packstore.checked`` against the file's size, modification
  time and newest transaction id, so it reruns only after the file changed.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

from packstore.errors import IntegrityError

STAMP_FILE = "packstore.checked"
_MAGIC = 0xBEEFC0DE
_PAGE_HEADER = 16  # mp_pgno u64, mp_pad u16, mp_flags u16, lower/upper u16 u16
_META = struct.Struct("<IIQQ48s48sQQ")  # magic, version, address, mapsize, free db, main db, last page, txnid
_WALK = r"""
import sys, lmdb
env = lmdb.open(sys.argv[1], readonly=True, max_dbs=64, subdir=True, map_size=int(sys.argv[2]))
def begin():
    while True:
        try:
            return env.begin(buffers=True)
        except lmdb.MapResizedError:  # another process grew the store since it was opened: not damage
            env.set_mapsize(0)  # adopt the size the file now has
with begin() as txn:
    names = [bytes(key) for key, _ in txn.cursor()]
for name in names:
    db = env.open_db(name, create=False)
    with begin() as txn:
        for key, value in txn.cursor(db=db):
            len(key), len(value)
print("ok")
"""


def _newest_meta(head: bytes) -> tuple[int, int, int]:
    """(page size, last page number, transaction id) of the newer valid meta page at the file's start."""
    best = None
    first = _META.unpack_from(head, _PAGE_HEADER) if len(head) >= _PAGE_HEADER + _META.size else None
    if first is None or first[0] != _MAGIC:
        raise IntegrityError("is not an LMDB data file (bad magic in its first meta page)")
    page_size = struct.unpack_from("<I", first[4], 0)[0]  # LMDB keeps the page size in the free db's md_pad
    if page_size < 512 or page_size & (page_size - 1):
        raise IntegrityError(f"has a damaged meta page (page size {page_size})")
    for offset in (0, page_size):
        if len(head) >= offset + _PAGE_HEADER + _META.size:
            meta = _META.unpack_from(head, offset + _PAGE_HEADER)
            if meta[0] == _MAGIC and (best is None or meta[7] > best[2]):
                best = (page_size, meta[6], meta[7])
    return best  # type: ignore[return-value]


def check_file(path: Path) -> tuple[int, int, int]:
    """Raise IntegrityError if ``path``/data.mdb is shorter than its newest meta page requires (or has
    no valid meta page); returns (file size, modification time in ns, newest transaction id)."""
    data = path / "data.mdb"
    try:
        with open(data, "rb") as file:
            head = file.read(2 * 65536)
            stat = os.fstat(file.fileno())
    except OSError as exc:
        raise IntegrityError(f"store {path}: cannot read its data file: {exc.strerror}") from None
    try:
        page_size, last_page, txnid = _newest_meta(head)
    except IntegrityError as exc:
        raise IntegrityError(f"store {path}: the data file {exc}; restore it from a backup") from None
    needed = (last_page + 1) * page_size
    if stat.st_size < needed:
        raise IntegrityError(
            f"store {path}: the data file is truncated ({stat.st_size} bytes, its newest meta page needs {needed}); "
            "restore it from a backup"
        )
    return stat.st_size, stat.st_mtime_ns, txnid


def check_structure(path: Path, map_size: int, *, remember: bool = True) -> None:
    """Walk every LMDB tree of the store at ``path`` in a child process (unless the stamp says the file
    is unchanged since the last good walk); IntegrityError if LMDB finds damage or the child dies."""
    state = list(check_file(path))
    stamp = path / STAMP_FILE
    try:
        if json.loads(stamp.read_text()) == state:
            return
    except (OSError, ValueError):
        pass
    try:
        walk = subprocess.run(
            [sys.executable, "-c", _WALK, str(path), str(max(map_size, state[0]))], capture_output=True, text=True, timeout=3600
        )
    except subprocess.TimeoutExpired:
        raise IntegrityError(f"store {path}: checking its structure took over an hour") from None
    if walk.returncode != 0 or walk.stdout.strip() != "ok":
        reason = walk.stderr.strip().splitlines()[-1] if walk.stderr.strip() else f"the check died with signal {-walk.returncode}"
        raise IntegrityError(f"store {path}: the data file is damaged ({reason}); restore it from a backup")
    if remember:
        try:
            partial = stamp.with_name(stamp.name + ".partial")
            partial.write_text(json.dumps(state))
            os.replace(partial, stamp)
        except OSError:
            pass  # a read-only directory: the walk runs again next time
