"""Regenerate the Python modules for ``rayturn.proto``.

The proto is compiled from a staging tree where it sits at
``rayturn/protos/rayturn.proto``, so the gRPC module imports its messages as
``from rayturn.protos import rayturn_pb2`` rather than as a top-level module.

    python -m rayturn.protos.generate [--out DIR]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

PROTO_DIR = Path(__file__).resolve().parent
PROTO_NAME = "rayturn.proto"
# The package path of the generated modules, as a directory under the staging root.
PACKAGE_DIR = Path("rayturn", "protos")
GENERATED_NAMES = ("rayturn_pb2.py", "rayturn_pb2.pyi", "rayturn_pb2_grpc.py")


def generate(out_dir: Path = PROTO_DIR) -> list[Path]:
    """Compile ``rayturn.proto`` into ``out_dir`` and return the written files."""
    well_known_protos = resources.files("grpc_tools") / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        staging = Path(tmp, "src")
        generated = Path(tmp, "out")
        (staging / PACKAGE_DIR).mkdir(parents=True)
        generated.mkdir()
        shutil.copyfile(PROTO_DIR / PROTO_NAME, staging / PACKAGE_DIR / PROTO_NAME)
        status = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{staging}",
                f"-I{well_known_protos}",
                f"--python_out={generated}",
                f"--pyi_out={generated}",
                f"--grpc_python_out={generated}",
                str(staging / PACKAGE_DIR / PROTO_NAME),
            ]
        )
        if status != 0:
            raise RuntimeError(f"protoc failed on {PROTO_DIR / PROTO_NAME} with exit status {status}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in GENERATED_NAMES:
            target = out_dir / name
            shutil.copyfile(generated / PACKAGE_DIR / name, target)
            written.append(target)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_DIR, help="directory for the generated modules")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)


if __name__ == "__main__":
    main()
