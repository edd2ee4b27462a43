"""The committed generated code in lorafleet/v1 matches what `make proto` makes from protos/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def test_generated_code_is_fresh(tmp_path):
    protos = sorted((REPO / "protos").rglob("*.proto"))
    assert protos, "no .proto files found"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{REPO / 'protos'}",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            *map(str, protos),
        ],
        check=True,
        cwd=REPO,
    )
    stale = []
    for proto in protos:
        relative = proto.relative_to(REPO / "protos").with_suffix("")
        for suffix in SUFFIXES:
            name = relative.parent / f"{relative.name}{suffix}"
            fresh = (tmp_path / name).read_bytes()
            committed = REPO / name
            if not committed.exists() or committed.read_bytes() != fresh:
                stale.append(str(name))
    assert not stale, f"stale generated code, run `make proto`: {stale}"
