"""SmolLM2-135M-Instruct imported from its GGUF once per test session, shared by every module
and every pytest-xdist worker.

Dequantising the GGUF takes half a minute of CPU; four modules need the imported folder. The
first worker to ask runs ``graftmerge import-gguf`` (the real command, in its process) under a
file lock in the session's shared temporary folder; the others wait for it and read the same
folder. The folder is read-only by convention: a test that changes a model copies it first.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from filelock import FileLock

from tests.helpers.runners import run_cli


def session_shared_folder(tmp_path_factory) -> Path:
    """A folder every worker of this pytest session sees: with xdist, the parent of the
    workers' base temporary folders (one per session); without, the session's own."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def shared_smollm2_import(shared: Path, gguf: Path) -> dict:
    """``{"post": folder, "returncode", "stdout", "stderr", "gguf_sha256_before", "gguf_sha256_after"}``
    of ``graftmerge import-gguf GGUF -o shared/smollm2/post``, run by the first caller of the session.

    The record is written last, so a worker that died mid-import leaves no record and the next
    caller starts again from an empty folder.
    """
    root = shared / "smollm2"
    record = root / "import-gguf.json"
    with FileLock(str(shared / "smollm2.lock")):
        if not record.is_file():
            if root.exists():
                shutil.rmtree(root)
            root.mkdir(parents=True)
            before = sha256(gguf)
            result = run_cli("graftmerge", "import-gguf", str(gguf), "-o", str(root / "post"))
            record.write_text(json.dumps({
                "returncode": result.returncode, "stdout": result.stdout, "stderr": result.stderr,
                "gguf_sha256_before": before, "gguf_sha256_after": sha256(gguf),
            }))
    return {"post": root / "post", **json.loads(record.read_text())}
