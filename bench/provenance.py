"""What a benchmark's result file says about where it came from: the commit measured and the
command that made it (the README quotes both beside every figure)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    """The commit measured, marked ``-dirty`` when tracked files differ from it."""
    done = subprocess.run(
        ["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True
    )
    return done.stdout.strip() or "unknown"


def write_result(out: Path, script: str, record: dict, indent: int = 1) -> None:
    """``record`` as JSON at ``out``, with this run's command (``python bench/<script>`` and its
    arguments) and commit."""
    command = " ".join(["python", f"bench/{script}", *sys.argv[1:]])
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {**record, "command": command, "commit": git_commit()}
    out.write_text(json.dumps(record, indent=indent) + "\n")
    print(f"wrote {out}")
