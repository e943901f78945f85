"""Delta folder format v1: sharded safetensors of Δ, an index, a config, and a manifest.

Layout of a delta folder (written by :func:`graftmerge.pipeline.delta_extract.extract_delta`)::

    delta_manifest.json                 written last; a folder without it is not a delta
    model.safetensors.index.json        weight_map, as for any sharded HF model
    model-00001-of-0000N.safetensors    Δ = weight·(θft − θdonor), keyed by parameter name
    config.json                         the donor's, so mergekit can load the folder as a model

The manifest records both sources with a fingerprint (tensor names, shapes and
dtypes, plus a sampled content digest) so a graft can check that a delta is
applied against the donor it was extracted from.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from graftmerge.errors import GraftError
from graftmerge.formats.checkpoint import Checkpoint, hf_cache_origin, tensor_windows
from graftmerge.formats.json_file import load_json_file
from graftmerge.formats.manifest_schema import DELTA_DTYPES, check_delta_manifest
from graftmerge.math.finite import all_finite

FORMAT_NAME = "graftmerge.delta"
FORMAT_VERSION = 1
MANIFEST_NAME = "delta_manifest.json"
INDEX_NAME = "model.safetensors.index.json"


def sampled_digest(checkpoint: Checkpoint) -> str:
    """sha256 over every tensor's name, dtype, shape and three 4 KiB windows of its bytes.

    Cheap (a few reads per tensor, whatever the model size) and independent of
    how the tensors are split into shards. It tells one checkpoint from
    another (a fine-tune changes every tensor it touches all over), not a
    single flipped bit: it is an identity check, not an integrity check.
    """
    windows: dict[str, bytes] = {}
    for file, layout in checkpoint.layouts.items():
        with open(file, "rb") as handle:
            for name, (begin, end) in layout.offsets.items():
                windows[name] = tensor_windows(handle, layout.data_start + begin, end - begin)
    digest = hashlib.sha256()
    for name in sorted(windows):
        info = checkpoint.tensors[name]
        digest.update(json.dumps([name, info.dtype, list(info.shape)]).encode())
        digest.update(len(windows[name]).to_bytes(8, "little"))
        digest.update(windows[name])
    return digest.hexdigest()


def source_record(checkpoint: Checkpoint) -> dict[str, Any]:
    """What a manifest says about one source: where it was, its Hub origin if known, its fingerprint."""

    repo, revision = hf_cache_origin(checkpoint.folder)
    return {
        "path": str(checkpoint.folder.resolve()),
        "source": repo,
        "revision": revision,
        "sampled_sha256": sampled_digest(checkpoint),
        "tensors": checkpoint.fingerprint(),
    }


@dataclass(frozen=True)
class DeltaFolder:
    """An opened delta folder: its manifest, checked, and its tensors (headers only)."""

    path: Path
    manifest: dict[str, Any]
    checkpoint: Checkpoint

    @property
    def donor(self) -> dict[str, Any]:
        """The manifest's record of the donor the delta was extracted from."""
        return self.manifest["donor"]

    @property
    def weight(self) -> float:
        """The weight the delta was scaled by at extraction."""
        return float(self.manifest["weight"])

    @property
    def dtype(self) -> str:
        """The dtype the delta is stored in (``float32`` or ``bfloat16``)."""
        return self.manifest["dtype"]

    def check_donor(self, donor: Checkpoint) -> None:
        """Refuse to combine this delta with a donor other than the one it was extracted from."""
        recorded = self.donor
        if recorded["tensors"] != donor.fingerprint():
            raise GraftError(
                f"delta {self.path} was extracted from donor {recorded['path']}, whose tensors "
                f"(names, shapes or dtypes) differ from {donor.label}; use the donor it was made from"
            )
        if recorded["sampled_sha256"] != sampled_digest(donor):
            raise GraftError(
                f"delta {self.path} was extracted from another donor than {donor.label} "
                f"(content fingerprint differs; it was made from {recorded['path']}): "
                "use the donor it was made from, or drop `role: donor` and graft the delta alone"
            )


def open_delta(path: str | os.PathLike, label: str | None = None) -> DeltaFolder:
    """Open a delta folder; raise GraftError if it is not one, or its files do not match its manifest."""
    path = Path(path)
    label = label or f"delta {path}"
    if not path.is_dir():
        raise GraftError(f"{label}: folder {path} does not exist")
    manifest_file = path / MANIFEST_NAME
    if not manifest_file.exists():
        raise GraftError(
            f"{label}: {path} is not a graftmerge delta (no {MANIFEST_NAME}); make one with "
            "`graftmerge delta extract DONOR DONOR_FT -o DELTA` (an interrupted extract leaves none)"
        )
    manifest = load_json_file(manifest_file, "manifest")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise GraftError(f"{manifest_file}: not a graftmerge delta manifest")
    if manifest.get("format_version") != FORMAT_VERSION or isinstance(manifest.get("format_version"), bool):
        raise GraftError(
            f"{manifest_file}: format version {manifest.get('format_version')} is not supported "
            f"(this graftmerge reads v{FORMAT_VERSION}; upgrade graftmerge)"
        )
    recorded = check_delta_manifest(manifest, str(manifest_file))
    checkpoint = DeltaCheckpoint(path, label=label)
    actual = {name: info.shape for name, info in checkpoint.tensors.items()}
    if recorded != actual:
        differing = sorted(set(recorded) ^ set(actual)) or sorted(n for n in actual if recorded[n] != actual[n])
        raise GraftError(
            f"{label}: its tensors do not match its manifest (e.g. {', '.join(differing[:3])}); "
            "the folder was modified after extraction, extract it again"
        )
    stored = DELTA_DTYPES[manifest["dtype"]]
    for name, info in sorted(checkpoint.tensors.items()):
        if info.dtype != stored:
            raise GraftError(f"{info.file}: delta tensor {name!r} is stored as {info.dtype}, but the manifest says "
                             f"{manifest['dtype']} ({stored})")
    return DeltaFolder(path=path, manifest=manifest, checkpoint=checkpoint)


class DeltaCheckpoint(Checkpoint):
    """A delta folder's tensors: every read is checked finite (a NaN in Δ would reach the merged model)."""

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """One tensor (or its rows), as stored; GraftError naming file and tensor if it holds NaN or Inf."""
        tensor = super().read(name, rows)
        check_finite_delta(tensor, self.tensors[name].file, name)
        return tensor

    def check_all_values(self) -> None:
        """Read every tensor once: all finite (what a pull checks)."""
        for name in sorted(self.tensors):
            self.read(name)


def check_finite_delta(tensor: torch.Tensor, file: Path | None, name: str) -> None:
    """GraftError ``<file>: delta tensor <name> contains NaN or Inf`` unless every value is finite."""
    if not all_finite(tensor):  # one min/max reduction, a fraction of isfinite().all()'s time
        raise GraftError(f"{file}: delta tensor {name!r} contains NaN or Inf")
