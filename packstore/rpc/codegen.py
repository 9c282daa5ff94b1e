"""Generate the Python gRPC modules from ``protos/`` with grpcio-tools (run by setup.py's build hook on
every install: into the wheel, or into the working tree for an editable install such as ``make install``).

Output goes to ``packstore/v1/`` (ignored by git): ``protos/packstore/v1/x.proto`` becomes
``packstore.v1.x_pb2`` and ``packstore.v1.x_pb2_grpc``. Generated code is never edited by hand.

    python -m packstore.rpc.codegen
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1]
REPO_PROTOS = PACKAGE_ROOT.parent / "protos"


def generate(protos: Path = REPO_PROTOS, out: Path = PACKAGE_ROOT.parent) -> list[Path]:
    """Run protoc over every .proto under ``protos``; returns the generated files."""
    from grpc_tools import protoc

    sources = sorted(protos.rglob("*.proto"))
    if not sources:
        raise SystemExit(f"no .proto files under {protos}")
    include = str(resources.files("grpc_tools") / "_proto")
    args = ["protoc", f"-I{protos}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}"]
    if protoc.main(args + [str(s) for s in sources]) != 0:
        raise SystemExit("protoc failed")
    generated = []
    for source in sources:
        target_dir = out / source.parent.relative_to(protos)
        (target_dir / "__init__.py").touch()
        generated += sorted(target_dir.glob(f"{source.stem}_pb2*.py"))
    return generated


if __name__ == "__main__":
    for path in generate():
        print(path, file=sys.stderr)
