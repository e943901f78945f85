"""Δ̃ = UᵀΔV of KFAC weights, kept on disk between the threshold pass and the merge.

Rotating a weight into its eigenbasis is the expensive part of a KFAC graft (two
large matmuls). The global threshold pass has to do it once for every weight; keeping
Δ̃ lets the merge reuse it (reading 4 bytes per entry instead of ~2·(d_out + d_in)
FLOPs), and guarantees the merge ranks exactly the scores the threshold was set on.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


class RotationStore:
    """One safetensors file per weight in ``folder`` (a scratch folder the caller removes)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, Path] = {}

    def save(self, name: str, rotated: torch.Tensor) -> None:
        """Keep Δ̃ of ``name`` in a new file (on the CPU)."""
        file = self.folder / f"{len(self._files):05d}.safetensors"
        save_file({"rotated": rotated.detach().to("cpu").contiguous()}, str(file))
        self._files[name] = file

    def load(self, name: str, device: torch.device | str) -> torch.Tensor | None:
        """Δ̃ of ``name``, or None when the threshold pass did not keep it."""
        file = self._files.get(name)
        if file is None or not file.exists():
            return None
        with safe_open(str(file), framework="pt") as handle:
            return handle.get_tensor("rotated").to(device)
