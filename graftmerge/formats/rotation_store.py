"""What the threshold pass keeps on disk for the merge right after it: Δ̃ = UᵀΔV, or the masked pairs.

Rotating a weight into its eigenbasis is the expensive part of a KFAC graft (two
large matmuls). The global threshold pass has to do it once for every weight; keeping
its result lets the merge reuse it and guarantees the merge ranks exactly the scores
the threshold was set on. Two forms:

- Δ̃ whole (``save``/``load``, 4 bytes per entry): the merge scores it again;
- the candidate pairs (``save_pairs``/``load_pairs``): only the pairs that may still be
  masked, with the eigenvector columns they touch; together with the final mask's
  positions (``keep_masks``), the merge removes the mask without the Fisher cache.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from graftmerge.math.projection import CandidatePairs

_PAIR_TENSORS = ("positions", "values", "rows", "columns", "left", "right")


class RotationStore:
    """One safetensors file per weight in ``folder`` (a scratch folder the caller removes)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, Path] = {}
        self._masks: dict[str, torch.Tensor] | None = None

    def _write(self, name: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
        file = self.folder / f"{len(self._files):05d}.safetensors"
        save_file({k: t.detach().to("cpu").contiguous() for k, t in tensors.items()}, str(file), metadata=metadata)
        self._files[name] = file

    def save(self, name: str, rotated: torch.Tensor) -> None:
        """Keep Δ̃ of ``name`` in a new file (on the CPU)."""
        self._write(name, {"rotated": rotated})

    def load(self, name: str, device: torch.device | str) -> torch.Tensor | None:
        """Δ̃ of ``name``, or None when the threshold pass did not keep it whole."""
        file = self._files.get(name)
        if file is None or not file.exists():
            return None
        with safe_open(str(file), framework="pt") as handle:
            if "rotated" not in handle.keys():  # noqa: SIM118 - safe_open has no __contains__
                return None
            return handle.get_tensor("rotated").to(device)

    def save_pairs(self, name: str, pairs: CandidatePairs) -> None:
        """Keep the candidate pairs of ``name`` in a new file (on the CPU)."""
        tensors = {key: getattr(pairs, key) for key in _PAIR_TENSORS if getattr(pairs, key) is not None}
        self._write(name, tensors, metadata={"shape": "x".join(map(str, pairs.shape))})

    def load_pairs(self, name: str, device: torch.device | str) -> CandidatePairs | None:
        """The candidate pairs of ``name``, or None when the threshold pass did not keep them."""
        file = self._files.get(name)
        if file is None or not file.exists():
            return None
        with safe_open(str(file), framework="pt") as handle:
            keys = set(handle.keys())
            if "positions" not in keys:
                return None
            shape = tuple(int(n) for n in handle.metadata()["shape"].split("x"))
            found = {key: handle.get_tensor(key).to(device) if key in keys else None for key in _PAIR_TENSORS}
        return CandidatePairs(shape=shape, **found)

    def keep_masks(self, masks: dict[str, torch.Tensor]) -> None:
        """The final mask of every tensor whose scores the pass kept (flat positions), once the threshold is known."""
        self._masks = masks

    @property
    def has_masks(self) -> bool:
        """Whether the pass that filled this store also recorded its final masks."""
        return self._masks is not None

    def masked_positions(self, name: str) -> torch.Tensor | None:
        """Flat positions the mask selects in ``name``; None when not kept (score it again)."""
        return None if self._masks is None else self._masks.get(name)
