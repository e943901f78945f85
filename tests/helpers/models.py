"""Model folders in tests: read one whole, copy it, hash a tree (inputs must never change),
list a tree, and compare state dicts bit for bit or within one ulp."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import torch

from graftmerge.formats.checkpoint import Checkpoint


def read_model(folder: Path) -> dict[str, torch.Tensor]:
    checkpoint = Checkpoint(folder)
    return {name: checkpoint.read(name) for name in checkpoint.tensors}


def tree_digest(folder: Path) -> str:
    """Content hash of every file under ``folder`` (inputs must never change)."""
    digest = hashlib.sha256()
    for file in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(folder)).encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()


def copy_model(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def assert_identical(got: dict, expected: dict) -> None:
    """Same tensor names, dtypes and bits."""
    assert got.keys() == expected.keys()
    for name in expected:
        assert got[name].dtype == expected[name].dtype and torch.equal(got[name], expected[name]), name


def tree(root: Path, skip: Path | None = None) -> dict[str, tuple[str, str]]:
    """Every entry under ``root`` (links not followed): relative path → (kind, link target or size)."""
    found = {}
    for folder, folders, files in os.walk(root, followlinks=False):
        for name in [*folders, *files]:
            path = Path(folder) / name
            if skip is not None and (path == skip or skip in path.parents):
                continue
            if path.is_symlink():
                found[str(path.relative_to(root))] = ("link", os.readlink(path))
            elif path.is_dir():
                found[str(path.relative_to(root))] = ("dir", "")
            else:
                found[str(path.relative_to(root))] = ("file", str(path.stat().st_size))
    return found


def assert_within_one_ulp(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name].float(), b[name].float()
        ulp = torch.finfo(a[name].dtype).eps * torch.maximum(x.abs(), y.abs()).clamp_min(
            torch.finfo(a[name].dtype).tiny
        )
        assert bool(((x - y).abs() <= ulp).all()), name
