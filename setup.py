"""Build step: generate the gRPC stubs from protos/ and compile the Cython hot paths in ext/.

Neither the stubs nor the generated C files are committed; both are produced here, on `pip install`.
"""

from __future__ import annotations

import os
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_py import build_py
from setuptools.command.develop import develop
from setuptools.command.egg_info import egg_info

ROOT = Path(__file__).parent.resolve()
PROTO_ROOT = ROOT / "protos"


def generate_stubs() -> None:
    """Run protoc on protos/switchyard/v1/*.proto into switchyard/v1/ (a generated, git-ignored package)."""
    from grpc_tools import protoc  # build requirement

    out = ROOT / "switchyard" / "v1"
    out.mkdir(parents=True, exist_ok=True)
    (out / "__init__.py").write_text('"""Generated gRPC stubs for switchyard.v1 (built at install time)."""\n')
    include = Path(protoc.__file__).parent / "_proto"
    for proto in sorted((PROTO_ROOT / "switchyard" / "v1").glob("*.proto")):
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={ROOT}",
            f"--pyi_out={ROOT}",
            f"--grpc_python_out={ROOT}",
            str(proto.relative_to(PROTO_ROOT)),
        ]
        cwd = os.getcwd()
        os.chdir(PROTO_ROOT)
        try:
            if protoc.main(args) != 0:
                raise RuntimeError(f"protoc failed on {proto}")
        finally:
            os.chdir(cwd)


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        generate_stubs()
        super().run()


class DevelopWithStubs(develop):
    def run(self) -> None:
        generate_stubs()
        super().run()


class EggInfoWithStubs(egg_info):
    def run(self) -> None:
        generate_stubs()
        super().run()


extensions = cythonize(
    [
        Extension(f"switchyard.ext.{pyx.stem}", [f"ext/{pyx.name}"], extra_compile_args=["-O3", "-ffp-contract=off"])
        for pyx in sorted((ROOT / "ext").glob("*.pyx"))
    ],
    compiler_directives={"language_level": "3", "boundscheck": False, "wraparound": False},
)

setup(
    ext_modules=extensions,
    cmdclass={"build_py": BuildPyWithStubs, "develop": DevelopWithStubs, "egg_info": EggInfoWithStubs},
)
