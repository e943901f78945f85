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
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graftmerge.errors import GraftError
from graftmerge.formats.checkpoint import Checkpoint, hf_cache_origin

FORMAT_NAME = "graftmerge.delta"
FORMAT_VERSION = 1
MANIFEST_NAME = "delta_manifest.json"
INDEX_NAME = "model.safetensors.index.json"
SAMPLE_BYTES = 4096  # per window; three windows (start, middle, end) per tensor


def _data_offsets(file: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """(start of the data section, byte range of each tensor in it) from a header Checkpoint already checked."""
    with open(file, "rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(header_len))
    offsets = {name: tuple(entry["data_offsets"]) for name, entry in header.items() if name != "__metadata__"}
    return 8 + header_len, offsets


def sampled_digest(checkpoint: Checkpoint) -> str:
    """sha256 over every tensor's name, dtype, shape and three 4 KiB windows of its bytes.

    Cheap (a few reads per tensor, whatever the model size) and independent of
    how the tensors are split into shards. It tells one checkpoint from
    another (a fine-tune changes every tensor it touches all over), not a
    single flipped bit: it is an identity check, not an integrity check.
    """
    by_file: dict[Path, list[str]] = {}
    for name, info in checkpoint.tensors.items():
        by_file.setdefault(info.file, []).append(name)
    windows: dict[str, bytes] = {}
    for file, names in by_file.items():
        data_start, offsets = _data_offsets(file)
        with open(file, "rb") as handle:
            for name in names:
                begin, end = offsets[name]
                size = end - begin
                starts = sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)})
                parts = []
                for start in starts:
                    handle.seek(data_start + begin + start)
                    parts.append(handle.read(min(SAMPLE_BYTES, size - start)))
                windows[name] = b"".join(parts)
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
    try:
        manifest = json.loads(manifest_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise GraftError(f"{manifest_file}: unreadable or corrupt manifest ({error})") from error
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise GraftError(f"{manifest_file}: not a graftmerge delta manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise GraftError(
            f"{manifest_file}: format version {manifest.get('format_version')} is not supported "
            f"(this graftmerge reads v{FORMAT_VERSION}; upgrade graftmerge)"
        )
    for key in ("donor", "donor_ft", "weight", "dtype"):
        if key not in manifest:
            raise GraftError(f"{manifest_file}: corrupt manifest (no {key!r})")
    checkpoint = Checkpoint(path, label=label)
    recorded = {name: entry["shape"] for name, entry in manifest["donor"]["tensors"].items()}
    actual = {name: list(info.shape) for name, info in checkpoint.tensors.items()}
    if recorded != actual:
        differing = sorted(set(recorded) ^ set(actual)) or sorted(n for n in actual if recorded[n] != actual[n])
        raise GraftError(
            f"{label}: its tensors do not match its manifest (e.g. {', '.join(differing[:3])}); "
            "the folder was modified after extraction, extract it again"
        )
    return DeltaFolder(path=path, manifest=manifest, checkpoint=checkpoint)
