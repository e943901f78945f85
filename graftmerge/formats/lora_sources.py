"""A LoRA adapter bound to a model, read as a tensor source keyed by the model's own parameter names.

:class:`LoraDelta` (``role: delta``) gives Δ; :class:`LoraFineTune` (``base+adapter``)
gives θft as PEFT's ``merge_and_unload()`` would save it. Both compute PEFT's product in
float32 with the same operations, so a base + adapter equals PEFT's float32 merge bit for
bit; a full saved tensor replaces the model's (PEFT loads it over the base), so its Δ is
``saved − donor``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

import torch

from graftmerge.errors import GraftError
from graftmerge.formats.checkpoint import FileIdentity, TensorInfo, TensorSource, file_identity
from graftmerge.formats.lora_adapter import CONFIG_NAME, LoraAdapter, open_lora_adapter
from graftmerge.formats.lora_binding import (
    AdaptedWeight,
    bind_adapter,
    check_float_model,
    model_config_of,
)


class _AdapterSource(TensorSource):
    """Shared by both views of an adapter: the model's tensor list, and each product computed once per tensor."""

    def __init__(self, adapter: LoraAdapter, bound: dict[str, AdaptedWeight], model: TensorSource, label: str):
        self.adapter = adapter
        self.bound = bound
        self.model = model
        self.label = label
        self.tensors = {
            name: TensorInfo(name=name, shape=info.shape, dtype="F32" if info.is_floating else info.dtype,
                             file=adapter.file)
            for name, info in model.tensors.items()
        }
        self._last: tuple[str, torch.Tensor] | None = None  # the last product read by rows

    def _product(self, name: str, rows: tuple[int, int] | None) -> torch.Tensor | None:
        """The LoRA product written into ``name`` (its rows), or None when no factors write there.

        Read by rows, the whole product is formed once and sliced, so every row block equals
        the same rows of a whole read bit for bit.
        """
        weight = self.bound.get(name)
        if weight is None or weight.module is None:
            return None
        if rows is None:
            return self.adapter.product(weight.module, weight.transposed)
        if self._last is None or self._last[0] != name:
            self._last = None
            self._last = (name, self.adapter.product(weight.module, weight.transposed))
        product = self._last[1][rows[0] : rows[1]]
        if rows[1] >= self._last[1].shape[0]:
            self._last = None
        return product

    def _saved(self, name: str, rows: tuple[int, int] | None) -> torch.Tensor | None:
        """The full tensor the adapter stores for ``name`` (its rows), float32; None when it stores none."""
        weight = self.bound.get(name)
        if weight is None or weight.full_key is None:
            return None
        tensor = self.adapter.read(weight.full_key).float()
        return tensor if rows is None else tensor[rows[0] : rows[1]]

    def pinned(self) -> dict[Path, FileIdentity]:
        """The model's files, the adapter's weights (as their header was read) and its config (as it is now)."""
        pinned = dict(self.model.pinned())
        if self.adapter.layout is not None and self.adapter.layout.identity is not None:
            pinned[self.adapter.layout.file] = self.adapter.layout.identity
            with contextlib.suppress(OSError):
                pinned[self.adapter.path / CONFIG_NAME] = file_identity(os.stat(self.adapter.path / CONFIG_NAME))
        return pinned

    def adapter_stamps(self) -> list[tuple[str, int, int, str]]:
        """The adapter's file stamps, plus one for how it was bound (which targets, transposed or not)."""
        binding = json.dumps(sorted((w.parameter, w.module, w.transposed, w.full_key) for w in self.bound.values()))
        return [*self.adapter.stamps(), ("binding", 0, 0, hashlib.sha256(binding.encode()).hexdigest())]


class LoraDelta(_AdapterSource):
    """``role: delta``: an adapter's Δ under the model's tensor names, float32; 0 for tensors it leaves alone.

    Full tensors (``modules_to_save``, an embedding's saved base layer) contribute
    ``saved − donor``, so they need the donor.
    """

    def __init__(self, adapter: LoraAdapter, bound: dict[str, AdaptedWeight], model: TensorSource,
                 donor: TensorSource | None, label: str):
        super().__init__(adapter, bound, model, label)
        full = sorted(w.parameter for w in bound.values() if w.full_key is not None)
        if full and donor is None:
            raise GraftError(f"{label} stores whole tensors ({', '.join(full[:3])}{' ...' if len(full) > 3 else ''}: "
                             "modules_to_save or an embedding's saved weight) and Δ = saved − donor needs the donor: "
                             "add the model the adapter was trained on with role donor (an embedding's weight is "
                             "saved because target_modules names it; save_embedding_layers=False leaves it out)")
        self.donor = donor

    @property
    def path(self) -> Path:
        """The adapter folder."""
        return self.adapter.path

    @property
    def checkpoint(self) -> LoraDelta:
        """The tensor source itself (what ``DeltaFolder.checkpoint`` is for a delta folder)."""
        return self

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Δ of tensor ``name`` (or its rows) in float32: zeros where the adapter does not write."""
        info = self.tensors[name]
        if not info.is_floating:  # mergekit needs every input to agree on these: the model's own
            return self.model.read(name, rows)
        saved, product = self._saved(name, rows), self._product(name, rows)
        delta = torch.sub(saved, self.donor.read(name, rows).float()) if saved is not None else None
        if product is None:
            return delta if delta is not None else torch.zeros(_rows_shape(info.shape, rows))
        return product if delta is None else torch.add(delta, product)

    def content_stamps(self) -> list[tuple[str, int, int, str]]:
        """The adapter's stamps (the donor, when used, is stamped as the plan's donor)."""
        return self.adapter_stamps()

    def low_rank_factors(self, name: str) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """``(L, R, s)`` with Δ of tensor ``name`` = ``s · L @ R`` (float32, the model's layout), or None.

        ``(B, A)``, or ``(Aᵀ, Bᵀ)`` for a transposed layer; rank-0 factors where the adapter
        does not write; None where it stores a whole tensor (Δ is not low-rank there).
        """
        info, weight = self.tensors[name], self.bound.get(name)
        if weight is not None and weight.full_key is not None or len(info.shape) != 2:
            return None
        if weight is None:
            return torch.zeros(info.shape[0], 0), torch.zeros(0, info.shape[1]), 1.0
        lora = self.adapter.modules[weight.module]
        a, b = self.adapter.read(lora.a_key).float(), self.adapter.read(lora.b_key).float()
        return (a.T, b.T, lora.scaling) if weight.transposed else (b, a, lora.scaling)


class LoraFineTune(_AdapterSource):
    """``model: ./base+./adapter``: θft as PEFT's ``merge_and_unload()`` of a float32 base saves it.

    θft = base + (B @ A)·scaling per adapted weight, saved tensors in place of the
    base's, every floating tensor float32: a folder merged that way, read here instead,
    gives the same bits.
    """

    def __init__(self, adapter: LoraAdapter, bound: dict[str, AdaptedWeight], base: TensorSource, label: str):
        super().__init__(adapter, bound, base, label)
        self.base = base

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """θft of tensor ``name`` (or its rows): float32 for floating tensors, the base's as stored otherwise."""
        if not self.tensors[name].is_floating:
            return self.base.read(name, rows)
        weight = self._saved(name, rows)
        weight = weight if weight is not None else self.base.read(name, rows).float()
        product = self._product(name, rows)
        return weight if product is None else torch.add(weight, product)  # PEFT: weight += Δ, in float32

    def content_stamps(self) -> list[tuple[str, int, int, str]]:
        """The base's shard stamps and the adapter's."""
        return [*self.base.content_stamps(), *self.adapter_stamps()]


def _rows_shape(shape: tuple[int, ...], rows: tuple[int, int] | None) -> tuple[int, ...]:
    return shape if rows is None else (rows[1] - rows[0], *shape[1:])


def open_lora_delta(path: str | os.PathLike, model: TensorSource, donor: TensorSource | None,
                    model_folder: str | os.PathLike | None, label: str | None = None) -> LoraDelta:
    """``role: delta``: an adapter folder opened and bound to ``model`` (the post model: names and shapes).

    ``model_folder`` holds the model's config.json (layer types, architecture); ``donor``
    is needed only when the adapter stores whole tensors.
    """
    adapter = open_lora_adapter(path, label)
    config = model_config_of(model_folder) if model_folder is not None else {}
    check_float_model(config, model.label)
    return LoraDelta(adapter, bind_adapter(adapter, model.tensors, config, model.label), model, donor, adapter.label)


def open_lora_fine_tune(adapter_path: str | os.PathLike, base: TensorSource, base_folder: str | os.PathLike,
                        label: str) -> LoraFineTune:
    """``model: BASE+ADAPTER``: the adapter opened, bound to ``base`` and presented as the merged θft."""
    adapter = open_lora_adapter(adapter_path, f"adapter {adapter_path}")
    config = model_config_of(base_folder)
    check_float_model(config, base.label)
    return LoraFineTune(adapter, bind_adapter(adapter, base.tensors, config, base.label), base, label)
