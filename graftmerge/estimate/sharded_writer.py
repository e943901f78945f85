"""Write a Fisher cache (format v1) from many ranks: each its own shards, rank 0 the manifest last.

Every rank writes the tensors it owns into the one staging folder rank 0 opened (a
folder every node must see), in shard files named after the rank
(``fisher-rank00002-00001.safetensors``); then the ranks' records (which key is in
which file, the factor records, clamp counts) are gathered to rank 0, which writes
``fisher_manifest.json`` exactly as :class:`~graftmerge.formats.fisher_cache.FisherCacheWriter`
would and publishes the folder with one rename. A cache is therefore all there or not
at all; a merge reads it like any other.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from graftmerge import __version__
from graftmerge.errors import GraftError
from graftmerge.formats.checkpoint import Checkpoint, hf_cache_origin
from graftmerge.formats.fisher_cache import DEFAULT_SHARD_BYTES, FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME
from graftmerge.formats.model_content import weights_sha256
from graftmerge.math.eigenbasis import clamp_eigenvalues, symmetric_eigenbasis


def check_values(tensor: torch.Tensor, where: str) -> None:
    """GraftError unless every value is finite and non-negative (what a v1 reader demands)."""
    if tensor.numel() == 0:
        return
    low, high = (float(v) for v in torch.aminmax(tensor))
    if not (math.isfinite(low) and math.isfinite(high)):
        raise GraftError(f"{where} contains NaN or Inf")
    if low < 0:
        raise GraftError(f"{where} contains negative entries (min {low:.3g})")


class RankShardWriter:
    """One rank's tensors of the cache, written as shards into the shared staging folder."""

    def __init__(self, staging: Path, rank: int, max_shard_bytes: int = DEFAULT_SHARD_BYTES):
        self.staging, self.rank, self.max_shard_bytes = Path(staging), rank, max_shard_bytes
        self.files: dict[str, str] = {}
        self.factors: dict[str, dict[str, Any]] = {}
        self.clamped = 0
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards = 0

    def add_diagonal(self, name: str, tensor: torch.Tensor) -> None:
        """The diagonal Fisher of weight ``name`` (already divided), stored under its own name."""
        tensor = tensor.detach().to("cpu", torch.float32).contiguous()
        check_values(tensor, f"diagonal Fisher for {name!r}")
        self._store(name, tensor)

    def add_side(self, key: str, factor: torch.Tensor, where: str) -> None:
        """One KFAC side ``kfac/<weight>/<rows|columns>``: eigendecomposed in float64 (1-D: its own spectrum)."""
        factor = factor.detach().to("cpu", torch.float64)
        if not torch.isfinite(factor).all():
            raise GraftError(f"{where} contains NaN or Inf")
        vectors, values = (None, factor) if factor.ndim == 1 else symmetric_eigenbasis(factor)
        values, clamped = clamp_eigenvalues(values, where)
        self.clamped += clamped
        record: dict[str, Any] = {"eigenvalues": f"{key}/eigenvalues", "size": int(values.shape[0]), "clamped": clamped}
        self._store(f"{key}/eigenvalues", values.to(torch.float32).contiguous())
        if vectors is not None:
            self._store(f"{key}/eigenvectors", vectors.to(torch.float32).contiguous())
            record["eigenvectors"] = f"{key}/eigenvectors"
        self.factors[key] = record

    def _store(self, key: str, tensor: torch.Tensor) -> None:
        self._pending[key] = tensor
        self._pending_bytes += tensor.numel() * tensor.element_size()
        if self._pending_bytes >= self.max_shard_bytes:
            self.flush()

    def flush(self) -> None:
        """Write what is pending as this rank's next shard (temporary name, then rename)."""
        if not self._pending:
            return
        self._shards += 1
        shard = f"fisher-rank{self.rank:05d}-{self._shards:05d}.safetensors"
        save_file(self._pending, str(self.staging / (shard + ".tmp")), metadata={"format": "pt"})
        os.replace(self.staging / (shard + ".tmp"), self.staging / shard)
        self.files.update(dict.fromkeys(self._pending, shard))
        self._pending, self._pending_bytes = {}, 0

    def records(self) -> dict[str, Any]:
        """What rank 0 needs for the manifest: files, factor records, clamp count (call after :meth:`flush`)."""
        return {"files": self.files, "factors": self.factors, "clamped": self.clamped}


def model_record(model: Path, source: str | None, revision: str | None) -> dict[str, Any]:
    """The manifest's ``model``: where it came from and every tensor's name, shape and dtype."""
    checkpoint = Checkpoint(model, label="post model")
    guessed_source, guessed_revision = hf_cache_origin(checkpoint.folder)
    return {
        "source": source or guessed_source or str(checkpoint.folder.resolve()),
        "revision": revision or guessed_revision,
        "tensors": checkpoint.fingerprint(),
        "weights_sha256": weights_sha256(checkpoint),
    }


def write_manifest(staging: Path, *, model: dict[str, Any], estimator: dict[str, Any], counts: dict[str, Any],
                   entries: dict[str, dict[str, Any]], ranks: list[dict[str, Any]]) -> None:
    """``fisher_manifest.json`` from every rank's records, written last (temporary name, then rename)."""
    files: dict[str, str] = {}
    factors: dict[str, dict[str, Any]] = {}
    for part in ranks:
        files.update(part["files"])
        factors.update(part["factors"])
    kinds = {r for entry in entries.values() for r in ("diagonal", "kfac") if r in entry}
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "kind": kinds.pop() if len(kinds) == 1 else ("mixed" if kinds else "empty"),
        "graftmerge_version": __version__,
        "model": model,
        "estimator": estimator,
        "counts": counts,
        "clamped_eigenvalues": sum(part["clamped"] for part in ranks),
        "entries": entries,
        "factors": factors,
        "files": files,
    }
    (staging / (MANIFEST_NAME + ".tmp")).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(staging / (MANIFEST_NAME + ".tmp"), staging / MANIFEST_NAME)
