"""Fisher cache format v1: a JSON manifest plus safetensors shards.

Layout of a cache folder::

    fisher_manifest.json          written last; a folder without it is not a cache
    fisher-00001.safetensors ...  tensors keyed by the post model's parameter names
                                  (diagonal) or by factor keys (KFAC sides)

Every weight with Fisher information has one manifest entry naming its own
representation, ``diagonal`` (one tensor shaped like the weight) or ``kfac``
(a row-side and a column-side factor, each a full eigenbasis or a diagonal);
a weight may carry both (``--kind both``), and then ``kfac`` is its own. Factors that
are bit-identical (q/k/v read the same input) are stored once and shared.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from graftmerge import __version__
from graftmerge.errors import GraftError
from graftmerge.formats.checkpoint import (
    Checkpoint,
    FileIdentity,
    TensorSource,
    file_identity,
    hf_cache_origin,
    read_safetensors_layout,
    shard_sample_digest,
)
from graftmerge.formats.file_hash import file_sha256
from graftmerge.formats.json_file import load_json_file
from graftmerge.formats.manifest_schema import check_fisher_manifest
from graftmerge.formats.model_content import weights_sha256
from graftmerge.formats.output_folder import NEW, OVERWRITE, Inputs, OutputFolder, check_not_inputs, usual_modes
from graftmerge.formats.user_cache import PassedChecks, warn_once
from graftmerge.math.eigenbasis import (
    ORTHONORMAL_TOLERANCE,
    check_orthonormal,
    clamp_eigenvalues,
    symmetric_eigenbasis,
)
from graftmerge.math.kfac import KfacFactors

FORMAT_NAME = "graftmerge.fisher"
FORMAT_VERSION = 1
MANIFEST_NAME = "fisher_manifest.json"
DEFAULT_SHARD_BYTES = 1 << 30


def _check_values(tensor: torch.Tensor, where: str) -> None:
    """Non-negative and finite, in one multi-threaded reduction (NaN propagates into min/max)."""
    if tensor.numel() == 0:
        return
    low, high = (float(v) for v in torch.aminmax(tensor))
    if math.isnan(low) or math.isnan(high) or math.isinf(high) or math.isinf(low):
        raise GraftError(f"{where} contains NaN or Inf")
    if low < 0:
        raise GraftError(f"{where} contains negative entries (min {low:.3g})")


class DiagonalSpans:
    """One weight's diagonal Fisher, read span by span (flattened order) into buffers the caller reuses.

    Why: a merge that walks a tensor in cache-sized spans keeps its arithmetic in the CPU's
    cache instead of streaming every whole-tensor pass through memory, and a reused buffer
    costs no page faults. float32 bytes are read from the file straight into the buffer
    (``preadv``, safe from several threads); any other stored dtype is converted once.
    Every span is value-checked as a whole read is.
    """

    def __init__(self, where: str, *, whole: torch.Tensor | None = None, descriptor: int | None = None,
                 offset: int = 0, size: int = 0):
        self.where = where
        self._whole = whole
        self._descriptor = descriptor
        self._offset = offset
        self.numel = whole.numel() if whole is not None else size

    def read(self, start: int, out: torch.Tensor) -> torch.Tensor:
        """Elements ``start : start + out.numel()`` into ``out`` (1-D, contiguous, float32); returns ``out``."""
        count = out.numel()
        if out.dtype != torch.float32 or out.dim() != 1 or not out.is_contiguous():
            raise ValueError("out must be a 1-D contiguous float32 tensor")
        if start < 0 or start + count > self.numel:
            raise ValueError(f"span {start}:{start + count} is outside the {self.numel} elements")
        if self._whole is not None:
            out.copy_(self._whole[start : start + count])
        elif count:
            target = memoryview(out.numpy()).cast("B")
            done, position = 0, self._offset + 4 * start
            while done < 4 * count:  # one read(2) returns at most ~2 GiB
                got = os.preadv(self._descriptor, [target[done:]], position + done)
                if not got:
                    raise GraftError(f"{self.where}: the file ends before the tensor's bytes "
                                     "(truncated since it was opened?)")
                done += got
        _check_values(out, self.where)
        return out


class FisherCacheWriter:
    """Write a Fisher cache from tensors computed anywhere.

    >>> with FisherCacheWriter("fisher/post-diag", model="./post") as writer:  # doctest: +SKIP
    ...     writer.add_diagonal("model.norm.weight", fisher_of_norm)

    The cache is assembled in a hidden sibling folder and renamed into place
    when the block exits cleanly, manifest last: an interrupted write never
    leaves a folder that looks like a cache, and an existing cache is replaced
    whole or not at all (:class:`~graftmerge.formats.output_folder.OutputFolder`;
    pass ``output``, already opened, to lock the path before your own work starts).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        model: str | os.PathLike | dict[str, Any],
        *,
        source: str | None = None,
        revision: str | None = None,
        estimator: dict[str, Any] | None = None,
        counts: dict[str, Any] | None = None,
        max_shard_bytes: int = DEFAULT_SHARD_BYTES,
        overwrite: bool = False,
        output: OutputFolder | None = None,
        inputs: Inputs = (),
    ):
        self.path = Path(path)
        inputs = [*inputs, *([] if isinstance(model, dict) else [("post model", model)])]
        check_not_inputs(self.path, inputs)  # OUT is no input: checked before anything else
        if self.path.exists() and not overwrite:
            raise GraftError(f"{self.path} already exists; pass overwrite=True (or --overwrite) to replace it")
        if isinstance(model, dict):  # another cache's ``model`` record (``fisher compress``)
            self._model_tensors = model["tensors"]
            self.model_info = {
                **model,
                "source": source or model.get("source"),
                "revision": revision or model.get("revision"),
            }
        else:
            checkpoint = Checkpoint(model, label="post model")
            guessed_source, guessed_revision = hf_cache_origin(checkpoint.folder)
            self._model_tensors = checkpoint.fingerprint()
            self.model_info = {
                "source": source or guessed_source or str(checkpoint.folder.resolve()),
                "revision": revision or guessed_revision,
                "tensors": self._model_tensors,
                "weights_sha256": weights_sha256(checkpoint),
            }
        self.estimator = dict(estimator or {})
        self.counts = dict(counts or {})
        self._overwrite = overwrite
        self._output = output or OutputFolder(self.path, replace=OVERWRITE if overwrite else NEW,
                                              hint="pass overwrite=True (or --overwrite) to replace it",
                                              inputs=inputs)
        self._max_shard_bytes = max_shard_bytes
        self._entries: dict[str, dict[str, Any]] = {}
        self._factors: dict[str, dict[str, Any]] = {}
        self._factor_by_digest: dict[str, str] = {}
        self._files: dict[str, str] = {}
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shard_count = 0
        self._clamped = 0
        self._tmp: Path | None = None
        self._closed = False

    # -- context management -------------------------------------------------
    def __enter__(self) -> FisherCacheWriter:
        self._ensure_tmp()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self.close()
            except BaseException:
                self.abort()  # a failed close leaves no staging folder and no lock behind
                raise
        else:
            self.abort()

    def _ensure_tmp(self) -> Path:
        if self._closed:
            raise GraftError(f"{self.path}: writer already closed")
        if self._tmp is None:
            self._tmp = self._output.open().staging  # locks the path, then a staging folder beside it
        return self._tmp

    # -- adding entries -----------------------------------------------------
    def _check_weight(self, name: str, representation: str) -> tuple[int, ...]:
        if name not in self._model_tensors:
            raise GraftError(f"{name!r} is not a tensor of the post model")
        if representation in self._entries.get(name, {}):
            raise GraftError(f"{name!r} already has a {representation} entry in this Fisher cache")
        return tuple(self._model_tensors[name]["shape"])

    def _add_entry(self, name: str, representation: str, record: dict[str, Any]) -> None:
        entry = self._entries.setdefault(name, {})
        entry[representation] = record
        # A weight's own representation: KFAC when it has factors, else diagonal.
        entry["representation"] = "kfac" if "kfac" in entry else "diagonal"

    def add_diagonal(self, name: str, tensor: torch.Tensor) -> None:
        """Diagonal Fisher of weight ``name``: a non-negative tensor of its shape."""
        shape = self._check_weight(name, "diagonal")
        if tuple(tensor.shape) != shape:
            raise GraftError(f"diagonal Fisher for {name!r} has shape {tuple(tensor.shape)}, weight has {shape}")
        tensor = tensor.detach().to("cpu", torch.float32).contiguous()
        _check_values(tensor, f"diagonal Fisher for {name!r}")
        self._store(name, tensor)
        self._add_entry(name, "diagonal", {"key": name})

    def add_kfac(self, name: str, *, P: torch.Tensor, Q: torch.Tensor) -> None:
        """Kronecker factors of a 2-D weight: P on its rows (d_out side), Q on its columns.

        A 1-D factor is a diagonal side (e.g. token frequencies for an
        embedding's vocabulary rows). Full factors are symmetrised and
        eigendecomposed in float64; tiny negative eigenvalues are clamped to 0.
        """
        self._check_kfac_shape(name, P, Q)
        row_side = self._add_side(P, "rows", name, "P")
        column_side = self._add_side(Q, "columns", name, "Q")
        self._add_entry(name, "kfac", {"rows": row_side, "columns": column_side})

    def add_kfac_eigen(
        self,
        name: str,
        *,
        U: torch.Tensor | None,
        S: torch.Tensor,
        V: torch.Tensor | None,
        D: torch.Tensor,
    ) -> None:
        """Eigenbases computed elsewhere: columns of U/V are eigenvectors; None = identity.

        A truncated side keeps only its leading eigenvectors: U is ``size × r`` with
        ``r < size`` and its columns go with the first r entries of S (S still lists all
        ``size`` eigenvalues; the rest belong to the dropped vectors). Only the kept
        pairs are then scored and masked (``graftmerge fisher compress``).
        """
        shape = self._check_kfac_shape(name, S, D)
        row_side = self._add_eigen_side(U, S, "rows", shape[0], name, "U/S")
        column_side = self._add_eigen_side(V, D, "columns", shape[1], name, "V/D")
        self._add_entry(name, "kfac", {"rows": row_side, "columns": column_side})

    def _check_kfac_shape(self, name: str, row: torch.Tensor, column: torch.Tensor) -> tuple[int, ...]:
        shape = self._check_weight(name, "kfac")
        if len(shape) != 2:
            raise GraftError(f"KFAC entry for {name!r}: weight has shape {shape}, KFAC needs a 2-D weight")
        for side, factor, size in (("row", row, shape[0]), ("column", column, shape[1])):
            if factor.shape[0] != size or factor.ndim not in (1, 2) or (factor.ndim == 2 and factor.shape[1] != size):
                raise GraftError(
                    f"KFAC {side} factor for {name!r} has shape {tuple(factor.shape)}; weight {shape} needs {size}"
                )
        return shape

    def _add_side(self, factor: torch.Tensor, side: str, name: str, label: str) -> str:
        factor = factor.detach().to("cpu", torch.float64)
        digest = hashlib.sha256(factor.contiguous().numpy().tobytes()).hexdigest()

        def decompose() -> tuple[torch.Tensor | None, torch.Tensor]:
            """Check the factor and eigendecompose its symmetric part (a 1-D factor is its own spectrum)."""
            if not torch.isfinite(factor).all():
                raise GraftError(f"KFAC factor {label} for {name!r} contains NaN or Inf")
            if factor.ndim == 1:
                return None, factor
            return symmetric_eigenbasis(factor)

        return self._side_once(digest, name, side, f"KFAC factor {label} for {name!r}", decompose)

    def _add_eigen_side(
        self, vectors: torch.Tensor | None, values: torch.Tensor, side: str, size: int, name: str, label: str
    ) -> str:
        values = values.detach().to("cpu", torch.float64)
        if values.ndim != 1:
            raise GraftError(f"KFAC eigenvalues {label} for {name!r} must be 1-D, got {tuple(values.shape)}")
        hasher = hashlib.sha256(values.numpy().tobytes())
        if vectors is not None:
            vectors = vectors.detach().to("cpu", torch.float64)
            if vectors.ndim != 2 or vectors.shape[0] != size or not 1 <= vectors.shape[1] <= values.shape[0]:
                raise GraftError(
                    f"KFAC eigenvectors {label} for {name!r} have shape {tuple(vectors.shape)}, "
                    f"need ({size}, r) with 1 ≤ r ≤ {values.shape[0]} (r < {size}: leading eigenvectors only)"
                )
            hasher.update(vectors.contiguous().numpy().tobytes())

        def checked() -> tuple[torch.Tensor | None, torch.Tensor]:
            """The given eigenvectors (checked orthonormal, as stored: float32) and eigenvalues."""
            if vectors is not None:
                stored = vectors.to(torch.float32)
                check_orthonormal(stored, f"KFAC eigenvectors {label} for {name!r}")
                ORTHONORMAL_PASSED.add(orthonormal_digest(stored))  # a merge reading these bytes skips the Gram
            return vectors, values

        return self._side_once(
            "eigen:" + hasher.hexdigest(), name, side, f"KFAC eigenvalues {label} for {name!r}", checked
        )

    def _side_once(self, digest: str, name: str, side: str, where: str, decompose) -> str:
        """Store one factor side once: a side identical to one stored before (same digest) shares its key.

        ``decompose()`` (checks, eigendecomposition) runs only for a new side.
        """
        if digest not in self._factor_by_digest:
            vectors, values = decompose()
            values, clamped = clamp_eigenvalues(values, where)
            self._clamped += clamped
            key = f"kfac/{name}/{side}"
            self._store(f"{key}/eigenvalues", values.to(torch.float32).contiguous())
            record: dict[str, Any] = {
                "eigenvalues": f"{key}/eigenvalues",
                "size": int(values.shape[0]),
                "clamped": clamped,
            }
            if vectors is not None:
                self._store(f"{key}/eigenvectors", vectors.to(torch.float32).contiguous())
                record["eigenvectors"] = f"{key}/eigenvectors"
                if vectors.shape[1] < values.shape[0]:  # truncated: leading eigenvectors only
                    record["rank"] = int(vectors.shape[1])
            self._factors[key] = record
            self._factor_by_digest[digest] = key
        return self._factor_by_digest[digest]

    # -- storage ------------------------------------------------------------
    def _store(self, key: str, tensor: torch.Tensor) -> None:
        self._ensure_tmp()
        self._pending[key] = tensor
        self._pending_bytes += tensor.numel() * tensor.element_size()
        if self._pending_bytes >= self._max_shard_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        self._shard_count += 1
        shard = f"fisher-{self._shard_count:05d}.safetensors"
        tmp = self._ensure_tmp()
        save_file(self._pending, str(tmp / (shard + ".tmp")), metadata={"format": "pt"})
        os.replace(tmp / (shard + ".tmp"), tmp / shard)
        for key in self._pending:
            self._files[key] = shard
        self._pending = {}
        self._pending_bytes = 0

    def close(self) -> Path:
        """Flush shards, write the manifest last, and move the cache into place."""
        if self._closed:
            return self.path
        tmp = self._ensure_tmp()
        self._flush()
        kinds = {r for entry in self._entries.values() for r in ("diagonal", "kfac") if r in entry}
        kind = kinds.pop() if len(kinds) == 1 else ("mixed" if kinds else "empty")
        manifest = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "kind": kind,
            "graftmerge_version": __version__,
            "model": self.model_info,
            "estimator": self.estimator,
            "counts": self.counts,
            "clamped_eigenvalues": self._clamped,
            "entries": self._entries,
            "factors": self._factors,
            "files": self._files,
        }
        (tmp / (MANIFEST_NAME + ".tmp")).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        os.replace(tmp / (MANIFEST_NAME + ".tmp"), tmp / MANIFEST_NAME)
        self._closed = True
        usual_modes(tmp)  # a cache is for sharing: its shards as readable as its manifest
        self._output.publish()  # an existing cache is replaced whole
        return self.path

    def abort(self) -> None:
        """Discard everything written so far (an existing cache at the path is left as it was)."""
        self._output.close()
        self._closed = True


ORTHONORMAL_PASSED = PassedChecks("orthonormal")


def orthonormal_digest(vectors: torch.Tensor) -> str:
    """sha256 naming one eigenvector tensor for the orthonormality record: its bytes, shape, dtype and the tolerance.

    Everything the check's verdict depends on is hashed, so a recorded digest vouches
    for exactly the content that passed (a transposed or re-typed copy hashes apart).
    """
    vectors = vectors.contiguous()
    label = f"graftmerge orthonormal v1 {list(vectors.shape)} {vectors.dtype} {ORTHONORMAL_TOLERANCE!r}\n"
    digest = hashlib.sha256(label.encode())
    digest.update(memoryview(vectors.numpy()).cast("B"))
    return digest.hexdigest()


SETTLED_SECONDS = 2.0  # a shard changed more recently than this is not named by its file identity


def unchanged_file_identity(before: os.stat_result, after: os.stat_result, key: str) -> str | None:
    """sha256 naming tensor ``key`` of a shard by the file's identity, when the file did not change during the read.

    Anyone can compute it from ``stat()``: it is only the subject of a record, whose name
    :class:`~graftmerge.formats.user_cache.PassedChecks` keys by the user's secret.

    Device, inode, size, mtime and ctime: the kernel sets ctime on every change to a file
    and user space cannot set it back, so while these agree the file holds the same bytes
    and the record of a basis that passed can be found without hashing them. None (hash
    the bytes instead) when the two stats taken around the read differ, or when the file
    changed within ``SETTLED_SECONDS`` (a coarse timestamp could hide a second change in
    the same tick).
    """
    fields = (after.st_dev, after.st_ino, after.st_size, after.st_mtime_ns, after.st_ctime_ns)
    if fields != (before.st_dev, before.st_ino, before.st_size, before.st_mtime_ns, before.st_ctime_ns):
        return None
    if time.time_ns() - after.st_ctime_ns < SETTLED_SECONDS * 1e9:
        return None
    label = f"graftmerge orthonormal file v1 {fields} {key!r} {ORTHONORMAL_TOLERANCE!r}"
    return hashlib.sha256(label.encode()).hexdigest()


class FisherCache:
    """A Fisher cache opened for lazy reading, one tensor at a time."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.exists():
            raise GraftError(f"Fisher cache {self.path} does not exist")
        manifest_file = self.path / MANIFEST_NAME
        if not self.path.is_dir() or not manifest_file.exists():
            raise GraftError(
                f"{self.path} is not a Fisher cache (no {MANIFEST_NAME}; an interrupted write leaves none)"
            )
        try:
            self._manifest_identity = file_identity(os.stat(manifest_file))  # before it is read: later edits are seen
        except OSError as error:
            raise GraftError(f"{manifest_file}: cannot read manifest ({error.strerror})") from error
        self.manifest = load_json_file(manifest_file, "manifest")
        if not isinstance(self.manifest, dict) or self.manifest.get("format") != FORMAT_NAME:
            raise GraftError(f"{manifest_file}: not a graftmerge Fisher manifest")
        version = self.manifest.get("format_version")
        if version != FORMAT_VERSION or isinstance(version, bool):
            raise GraftError(
                f"{manifest_file}: format version {version} is not supported "
                f"(this graftmerge reads v{FORMAT_VERSION}; upgrade graftmerge)"
            )
        expected = check_fisher_manifest(self.manifest, f"Fisher cache {self.path}")
        self.entries: dict[str, dict[str, Any]] = self.manifest["entries"]
        self._factors: dict[str, dict[str, Any]] = self.manifest.get("factors", {})
        self._files: dict[str, str] = self.manifest["files"]
        missing = sorted({f for f in self._files.values() if not (self.path / f).is_file()})
        if missing:
            raise GraftError(f"Fisher cache {self.path} is missing shard(s) {', '.join(missing)}")
        self._layouts = {f: read_safetensors_layout(self.path / f) for f in sorted(set(self._files.values()))}
        self._check_stored(expected)
        self._orthonormal: set[str] = set()  # sha256 of eigenvector tensors that passed the full check

    def _check_stored(self, expected: dict[str, tuple[int, ...]]) -> None:
        """Every tensor the manifest names is in its shard, float32, with the shape the manifest implies."""
        for key, shape in sorted(expected.items()):
            file = self._files[key]
            info = self._layouts[file].tensors.get(key)
            if info is None:
                raise GraftError(
                    f"Fisher cache {self.path}: {file} has no tensor {key!r} (its manifest files it there)"
                )
            if info.dtype != "F32" or info.shape != shape:
                raise GraftError(
                    f"Fisher cache {self.path}: tensor {key!r} in {file} is {info.dtype} {list(info.shape)}; "
                    f"the format stores F32 {list(shape)}"
                )

    @property
    def kind(self) -> str:
        """What the cache holds: ``diagonal``, ``kfac``, ``mixed`` (both) or ``empty``."""
        return self.manifest["kind"]

    @property
    def model_tensors(self) -> dict[str, dict[str, Any]]:
        """The model's tensors (shape, dtype) that the cache was made for."""
        return self.manifest["model"]["tensors"]

    def representation(self, name: str) -> str | None:
        """The weight's own representation (``kfac`` when it has factors), None if absent."""
        entry = self.entries.get(name)
        return entry["representation"] if entry else None

    def has(self, name: str, representation: str) -> bool:
        """Whether ``name`` has an entry in ``representation`` (``diagonal``, ``kfac``)."""
        return representation in self.entries.get(name, {})

    def kfac_side(self, name: str, side: str) -> dict[str, Any]:
        """Manifest record of one side (``rows`` or ``columns``) of a KFAC entry: size, keys."""
        return self._factors[self.entries[name]["kfac"][side]]

    def names(self, representation: str | None = None) -> list[str]:
        """Weights with an entry (of ``representation``, when given)."""
        return sorted(n for n, e in self.entries.items() if representation is None or representation in e)

    def _read(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        # Opened per read so pages read earlier do not stay mapped (see Checkpoint.read).
        with safe_open(str(self.path / self._files[key]), framework="pt") as handle:
            tensor = handle.get_tensor(key) if rows is None else handle.get_slice(key)[rows[0] : rows[1]]
        return tensor.to(torch.float32)

    def diagonal(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The diagonal Fisher of weight ``name`` (float32, shaped like it; or rows ``start:stop``), value-checked."""
        key = self._diagonal_key(name)
        tensor = self._read(key, rows)
        _check_values(tensor, self._where(key, f"diagonal of {name!r}"))
        return tensor

    def _diagonal_key(self, name: str) -> str:
        if not self.has(name, "diagonal"):
            raise GraftError(f"Fisher cache {self.path} has no diagonal entry for {name!r}")
        return self.entries[name]["diagonal"]["key"]

    @contextmanager
    def diagonal_spans(self, name: str) -> Iterator[DiagonalSpans]:
        """Weight ``name``'s diagonal Fisher, readable span by span into the caller's buffers (see DiagonalSpans)."""
        key = self._diagonal_key(name)
        layout = self._layouts[self._files[key]]
        where = self._where(key, f"diagonal of {name!r}")
        if layout.tensors[key].dtype != "F32" or sys.byteorder != "little":
            yield DiagonalSpans(where, whole=self._read(key).reshape(-1))  # converted once, spans sliced from it
            return
        begin, end = layout.offsets[key]
        descriptor = os.open(layout.file, os.O_RDONLY)
        try:
            yield DiagonalSpans(where, descriptor=descriptor, offset=layout.data_start + begin, size=(end - begin) // 4)
        finally:
            os.close(descriptor)

    def _where(self, key: str, what: str) -> str:
        """How messages name one stored tensor: the cache, the tensor key, its shard, what it is."""
        return f"Fisher cache {self.path}: {key!r} in {self._files[key]} ({what})"

    def kfac(self, name: str) -> KfacFactors:
        """The KFAC eigenbases of weight ``name``: ``(U, S, V, D)`` in its row/column layout."""
        if not self.has(name, "kfac"):
            raise GraftError(f"Fisher cache {self.path} has no KFAC entry for {name!r}")
        entry = self.entries[name]["kfac"]
        U, S = self._side(entry["rows"], name)
        V, D = self._side(entry["columns"], name)
        return KfacFactors(U=U, S=S, V=V, D=D)

    def _side(self, key: str, name: str) -> tuple[torch.Tensor | None, torch.Tensor]:
        vectors, values = self.side_spectrum(key, name)
        return vectors, values[: side_rank(self._factors[key])]

    def side_spectrum(self, key: str, name: str = "") -> tuple[torch.Tensor | None, torch.Tensor]:
        """One factor side as stored: eigenvectors (``size × rank``, None if diagonal), all eigenvalues."""
        record = self._factors[key]
        values = self._read(record["eigenvalues"])
        _check_values(values, self._where(record["eigenvalues"], f"eigenvalues of {name!r}"))
        vectors = None
        if "eigenvectors" in record:
            shard = self.path / self._files[record["eigenvectors"]]
            before = os.stat(shard)
            vectors = self._read(record["eigenvectors"])
            identity = unchanged_file_identity(before, os.stat(shard), record["eigenvectors"])
            if tuple(vectors.shape) != (record["size"], side_rank(record)) or values.shape != (record["size"],):
                raise GraftError(
                    f"Fisher cache {self.path}: factor {key} ({name!r}) has eigenvectors {tuple(vectors.shape)} and "
                    f"{values.shape[0]} eigenvalues; its manifest says size {record['size']}, rank {side_rank(record)}"
                )
            self._check_eigenvectors(vectors, self._where(record["eigenvectors"], f"eigenvectors of {name!r}"),
                                     identity)
        return vectors, values

    def _check_eigenvectors(self, vectors: torch.Tensor, where: str, identity: str | None = None) -> None:
        """The full orthonormality check, unless these very bytes already passed it (in this process or before).

        Keyed by :func:`orthonormal_digest` of the tensor as read (the bytes the merge then
        uses): hashing costs far less than the Gram, so a cache is checked in full once per
        machine, not once per merge
        (``$GRAFTMERGE_CACHE_DIR/orthonormal/``, :class:`~graftmerge.formats.user_cache.PassedChecks`).
        Once they passed, the unchanged shard's ``identity`` (:func:`unchanged_file_identity`)
        is recorded too, so later merges skip the hashing as well.
        """
        if identity is not None and (identity in self._orthonormal or identity in ORTHONORMAL_PASSED):
            return
        digest = orthonormal_digest(vectors)
        if digest not in self._orthonormal:
            if digest not in ORTHONORMAL_PASSED:
                check_orthonormal(vectors, where)
                ORTHONORMAL_PASSED.add(digest)
            self._orthonormal.add(digest)
        if identity is not None:
            ORTHONORMAL_PASSED.add(identity)
            self._orthonormal.add(identity)

    def check_fits(self, checkpoint: Checkpoint, partial: bool = False) -> None:
        """Refuse a cache made for another model (names or shapes differ).

        ``partial``: ``checkpoint`` may hold a subset of the cache's model (in-memory
        merges see only floating tensors); every tensor it does hold must fit.
        """
        cached = self.model_tensors
        actual = checkpoint.fingerprint()
        only_cache = [] if partial else sorted(set(cached) - set(actual))
        only_model = sorted(n for n in set(actual) - set(cached))
        if only_cache or only_model:
            detail = (
                f"{len(only_cache)} tensor(s) only in the cache (e.g. {only_cache[:3]})" if only_cache else ""
            ) + ("; " if only_cache and only_model else "") + (
                f"{len(only_model)} only in the model (e.g. {only_model[:3]})" if only_model else ""
            )
            raise GraftError(
                f"Fisher cache {self.path} was made for another model than {checkpoint.label} ({detail})"
            )
        for name, info in actual.items():
            if list(cached[name]["shape"]) != info["shape"]:
                raise GraftError(
                    f"Fisher cache {self.path} was made for another model: {name!r} has shape "
                    f"{tuple(cached[name]['shape'])} in the cache, {tuple(info['shape'])} in {checkpoint.label}"
                )
        for name in self.entries:
            if name not in actual and not partial:
                raise GraftError(f"Fisher cache {self.path} has an entry for unknown tensor {name!r}")

    def check_same_weights(self, checkpoint: TensorSource) -> None:
        """Refuse a cache estimated on other weights than ``checkpoint``'s, by content, wherever either lies.

        A model folder's tensors are hashed (``formats.model_content``, remembered per unchanged
        file) and compared with the manifest's ``model.weights_sha256``: the same weights in
        another folder or a Hub snapshot pass, a fine-tune of the same shapes is refused. Tensors
        in memory have no files to hash: names and shapes (``check_fits``) are all there is. A
        cache written before the digest was recorded, or a copy cast to other dtypes, cannot be
        compared either: one warning says so.
        """
        if not isinstance(checkpoint, Checkpoint):
            return
        recorded = self.manifest["model"].get("weights_sha256")
        if recorded is None:
            warn_once(f"Fisher cache {self.path} records no digest of its model's weights (written by an older "
                      f"graftmerge): only names and shapes tell it fits {checkpoint.label}; re-estimate it to have "
                      "the weights checked")
            return
        cast = sorted(n for n, info in checkpoint.tensors.items() if info.dtype != self.model_tensors[n]["dtype"])
        if cast:
            warn_once(f"{checkpoint.label} stores {cast[0]!r} as {checkpoint.tensors[cast[0]].dtype}, the model of "
                      f"Fisher cache {self.path} as {self.model_tensors[cast[0]]['dtype']}: a cast copy cannot be "
                      "compared by content, so only names and shapes were checked")
            return
        if weights_sha256(checkpoint) != recorded:
            raise GraftError(f"Fisher cache {self.path} was estimated on other weights than {checkpoint.label} "
                             "(same tensor names and shapes, other values: a fine-tune or another model); use the "
                             "cache estimated on this model, or estimate one with `graftmerge fisher estimate`")

    def pinned(self) -> dict[Path, FileIdentity]:
        """The manifest and every shard, with their identities when they were read (``file_identity``)."""
        pinned = {self.path / file: layout.identity for file, layout in self._layouts.items()}
        pinned[self.path / MANIFEST_NAME] = self._manifest_identity
        return pinned

    def file_stamps(self) -> list[tuple[str, int, int]]:
        """(resolved path, size, mtime) of the manifest and every shard: changes when the cache does."""
        stamps = []
        for file in sorted({*self._files.values(), MANIFEST_NAME}):
            stat = (self.path / file).stat()
            stamps.append((str((self.path / file).resolve()), stat.st_size, stat.st_mtime_ns))
        return stamps

    def content_stamps(self) -> list[tuple[str, int, int, str]]:
        """``file_stamps`` plus content: the manifest's sha256, each shard's sampled digest
        (``shard_sample_digest``)."""
        digests = {file: shard_sample_digest(layout) for file, layout in self._layouts.items()}
        digests[MANIFEST_NAME] = file_sha256(self.path / MANIFEST_NAME)
        return [(path, size, mtime, digests[file]) for file, (path, size, mtime) in
                zip(sorted({*self._files.values(), MANIFEST_NAME}), self.file_stamps())]

    def check_all_values(self, rows_per_block: int = 1 << 24) -> None:
        """Read every tensor once and check its values (what a pull can afford; a merge checks each read).

        Diagonals and eigenvalues finite and non-negative, eigenvectors finite (their
        orthonormality, an O(d³) Gram per side, is checked when a merge reads them).
        """
        for name in self.names("diagonal"):
            shape = self.model_tensors[name]["shape"]
            if math.prod(shape) <= rows_per_block or len(shape) < 2:
                self.diagonal(name)
                continue
            step = max(1, rows_per_block // max(1, math.prod(shape[1:])))
            for start in range(0, shape[0], step):
                self.diagonal(name, (start, min(start + step, shape[0])))
        for _, record in sorted(self._factors.items()):
            _check_values(self._read(record["eigenvalues"]), self._where(record["eigenvalues"], "eigenvalues"))
            if "eigenvectors" in record and not bool(torch.isfinite(self._read(record["eigenvectors"])).all()):
                raise GraftError(f"{self._where(record['eigenvectors'], 'eigenvectors')} contain NaN or Inf")


def side_rank(record: dict[str, Any]) -> int:
    """Eigenvectors a factor side keeps: its ``rank`` when truncated, else its full ``size``."""
    return int(record.get("rank", record["size"]))


def open_fisher_cache(path: str | os.PathLike) -> FisherCache:
    """Open a Fisher cache folder; raise GraftError if it is missing or not a cache."""
    return FisherCache(path)
