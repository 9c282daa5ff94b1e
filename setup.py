"""Build hook: generate packstore/v1 (the gRPC modules) from protos/ while building, so every install,
the core one included, ships them and none needs grpcio-tools to run (pyproject.toml lists it to build)."""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithProtos(build_py):
    """build_py, then protoc over protos/: into the wheel, or into the source tree for an editable install."""

    def run(self) -> None:
        super().run()
        spec = importlib.util.spec_from_file_location("codegen", ROOT / "packstore" / "rpc" / "codegen.py")
        codegen = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(codegen)
        codegen.generate(ROOT / "protos", ROOT if self.editable_mode else Path(self.build_lib))


setup(cmdclass={"build_py": BuildPyWithProtos})
