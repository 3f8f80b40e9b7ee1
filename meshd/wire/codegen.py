"""Generate the protobuf modules in this package from the schemas in ``proto/``.

Run by ``make proto``. The generated modules are committed; a test regenerates them and fails when
they differ, so the committed code always matches the schema and nothing is generated at run time.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = REPO_ROOT / "proto"
OUT_DIR = Path(__file__).resolve().parent


def generate(out_dir: Path) -> list[Path]:
    """Run protoc (from grpcio-tools) on every schema; return the generated files."""
    from grpc_tools import protoc

    schemas = sorted(PROTO_DIR.glob("*.proto"))
    if not schemas:
        raise SystemExit(f"no .proto files in {PROTO_DIR}")
    args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={out_dir}", f"--pyi_out={out_dir}"]
    args += [str(p) for p in schemas]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    generated = sorted(out_dir.glob("*_pb2.py*"))
    for path in generated:
        path.write_text(_package_imports(path.read_text()))
    return generated


def _package_imports(source: str) -> str:
    """protoc writes a schema's imports as top-level modules (``import card_pb2``); ours live in this
    package, so each becomes ``from meshd.wire import card_pb2``."""
    return re.sub(r"^import (\w+_pb2)( as \w+)?$", r"from meshd.wire import \1\2", source, flags=re.MULTILINE)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            shutil.copyfile(path, OUT_DIR / path.name)
            print(f"wrote {(OUT_DIR / path.name).relative_to(REPO_ROOT)}")


if __name__ == "__main__":
    main()
