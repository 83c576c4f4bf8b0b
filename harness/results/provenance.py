"""What makes a cell record reproducible: the hash of its resolved config, the hash of the
harness code that ran it, and the two together (the cell version).

Two records with the same ``config_hash`` ran the same cell; with the same ``cell_version``
they also ran it with the same harness code, so their losses should agree bitwise where the
arithmetic is deterministic (fp32 on CPU). The libraries' versions are in the run's run.json
(``environment.versions``), which every record sits beside.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from harness.config import CellSpec

HARNESS_DIR = Path(__file__).resolve().parents[1]
_HASH_CHARS = 16


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:_HASH_CHARS]


def config_hash(cell: CellSpec) -> str:
    """Hash of the resolved cell spec (every field, keys sorted)."""
    return _digest(json.dumps(cell.to_dict(), sort_keys=True).encode())


@functools.cache
def harness_code_hash() -> str:
    """Hash of every source file of the harness package (Python and report templates), by
    path and content: any edit to the code that runs or records a cell changes it."""
    h = hashlib.sha256()
    for path in sorted(p for p in HARNESS_DIR.rglob("*") if p.suffix in (".py", ".j2") and p.is_file()):
        h.update(str(path.relative_to(HARNESS_DIR)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:_HASH_CHARS]


def of(cell: CellSpec) -> dict[str, Any]:
    """The record's ``provenance`` entry."""
    config, code = config_hash(cell), harness_code_hash()
    return {"config_hash": config, "harness_code_hash": code,
            "cell_version": _digest(f"{config}:{code}".encode()), "seed": cell.seed}
