"""Fold a results directory's plain records into their compressed files, before the records are committed.

results/ keeps every evaluation's JSON-lines records gzip-compressed (NAME.jsonl.gz; ``evallib.compressed``): the
large ones shrink 6-10 times. A run that resumes a compressed directory appends its new records to a plain
NAME.jsonl beside it, and every reader reads both (``evallib.read_jsonl``); this folds them back into one compressed
file (byte-identical for the same records). From the repository root:

    .venv/bin/python -m tools.eval.compress_records results/eval_packs [DIR ...]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from tools.lib.evallib import compress_records


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directories", nargs="+", type=Path, help="results directories")
    args = parser.parse_args(argv)
    for directory in args.directories:
        if not directory.is_dir():
            parser.error(f"{directory} is not a directory")
        for path in compress_records(directory):
            print(f"{path}: {path.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
