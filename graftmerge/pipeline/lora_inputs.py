"""LoRA adapters inside mergekit's graph, without merging them into a model first.

mergekit loads every input of a config as a model folder, and merges a ``BASE+ADAPTER``
reference by loading the whole model into transformers and PEFT (``ModelReference.merged``).
graft needs neither: :mod:`graftmerge.formats.lora_adapter` reads an adapter as a tensor
source. So before the merge, the config mergekit sees is rewritten and each LoRA input's
loader is put into mergekit's ``LoaderCache``:

- a ``role: delta`` adapter folder (no config.json of its own) becomes the reference
  ``POST+ADAPTER`` (mergekit reads the post model's config for it); its loader returns Δ;
- a ``BASE+ADAPTER`` donor_ft keeps its reference; its loader returns θft, the base with
  the adapter merged in as PEFT's ``merge_and_unload()`` would in float32;
- a donor implied by ``BASE+ADAPTER`` (none listed) is added with ``role: donor``.

The loaders are removed when the merge ends, whatever happens.

Low rank kept low: when a graft's whole Δ is one adapter (``role: delta``, nothing else),
every KFAC weight is rotated from the factors, ``Δ̃ = λ·s·(UᵀB)(AV)``, never from the
dense Δ (:func:`scored_delta`, which every scoring site of the pipeline calls, so the
threshold pass, the merge kernel, plan and sweep agree bit for bit).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from mergekit.common import ModelPath, ModelReference
from mergekit.config import InputModelDefinition
from mergekit.io.lazy_tensor_loader import ShardedTensorIndex, ShardInfo
from mergekit.io.tasks import LoaderCache

from graftmerge.formats.checkpoint import TensorSource
from graftmerge.formats.lora_adapter import WEIGHTS_NAME, LoraDelta, LoraFineTune
from graftmerge.math.low_rank import low_rank_rotate
from graftmerge.math.projection import ScoredDelta, TensorFisher, score_delta
from graftmerge.pipeline.graft_plan import GraftInputs


class SourceLoader:
    """mergekit's ``LazyTensorLoader`` interface (``index``, ``get_tensor``, ``flush``) over a tensor source."""

    def __init__(self, source: TensorSource, base_path: str):
        self.source = source
        paths = {name: WEIGHTS_NAME for name in source.tensors}
        self.index = ShardedTensorIndex(base_path=base_path, is_safetensors=True, tensor_paths=paths,
                                        shards=[ShardInfo(WEIGHTS_NAME, list(paths))])

    def get_tensor(self, key: str, device: str = "cpu", aliases: list[str] | None = None,
                   raise_on_missing: bool = True) -> torch.Tensor | None:
        """Tensor ``key`` (or its first alias the source has) on ``device``, as the source computes it."""
        if key not in self.source.tensors:
            key = next((alias for alias in aliases or () if alias in self.source.tensors), key)
        if key not in self.source.tensors:
            if raise_on_missing:
                raise KeyError(key)
            return None
        return self.source.read(key).to(device)

    def flush(self) -> None:
        """Nothing is held between reads."""


def mergekit_view(config, inputs: GraftInputs) -> tuple[object, dict[ModelReference, TensorSource]]:
    """(the config as mergekit should see it, the tensor source behind each LoRA reference in it).

    ``config`` itself when it has no LoRA input. ``inputs`` were opened from the plan of
    ``config`` (donor_ft and delta inputs in config order).
    """
    fine_tunes, deltas = iter(inputs.fine_tunes), iter(inputs.deltas)
    delta_plans = iter(inputs.plan.deltas)
    models, sources, has_donor = [], {}, False
    for entry in config.models:
        role = (entry.parameters or {}).get("role")
        has_donor = has_donor or role == "donor"
        if role == "donor_ft":
            source = next(fine_tunes)
            if isinstance(source, LoraFineTune):
                sources[entry.model] = source
        elif role == "delta":
            source, folder = next(deltas), next(delta_plans).path
            if isinstance(source, LoraDelta):  # an adapter has no config.json: mergekit reads the post model's
                reference = ModelReference(model=config.base_model.model, lora=ModelPath(path=folder))
                entry = entry.model_copy(update={"model": reference})
                sources[reference] = source
        models.append(entry)
    if not sources:
        return config, {}
    if not has_donor and inputs.plan.donor is not None:
        models.append(InputModelDefinition(model=ModelReference(model=ModelPath(path=inputs.plan.donor)),
                                           parameters={"role": "donor"}))
    return config.model_copy(update={"models": models}), sources


@contextlib.contextmanager
def lora_inputs_in_mergekit(config, inputs: GraftInputs) -> Iterator[object]:
    """The config for mergekit, with each LoRA input's loader in mergekit's LoaderCache until the block ends."""
    view, sources = mergekit_view(config, inputs)
    loaders = LoaderCache().loaders  # one dict, shared by every thread's LoaderCache
    for reference, source in sources.items():
        base_path = str(source.adapter.path)
        loaders[reference] = SourceLoader(source, base_path)
    try:
        yield view
    finally:
        for reference in sources:
            loaders.pop(reference, None)


def low_rank_rotation(inputs: GraftInputs, name: str, fisher: TensorFisher, rows: tuple[int, int] | None,
                      device: torch.device | str) -> torch.Tensor | None:
    """Δ̃ = UᵀΔV of ``name`` from LoRA factors, ``λ·s·(UᵀB)(AV)``, when the graft's Δ is one adapter alone.

    None (rotate the dense Δ) for a diagonal Fisher, a row block, a float64 graft, any
    other term in Δ, or a weight the adapter stores whole.
    """
    if fisher.kfac is None or rows is not None or inputs.fine_tunes or len(inputs.deltas) != 1:
        return None
    if inputs.working_dtype(name) == torch.float64:
        return None
    factors = getattr(inputs.deltas[0], "low_rank_factors", None)  # a LoraDelta (or a plan's ReadOnce of one)
    found = factors(name) if factors is not None else None
    if found is None:
        return None
    left, right, scale = found
    kfac = fisher.kfac
    return low_rank_rotate(left.to(device), right.to(device), scale * inputs.plan.delta_lambdas[0], kfac.U, kfac.V)


def scored_delta(inputs: GraftInputs, name: str, delta: torch.Tensor, fisher: TensorFisher,
                 rows: tuple[int, int] | None = None, rotated: torch.Tensor | None = None) -> ScoredDelta:
    """``score_delta`` of one tensor (block) of a graft, Δ̃ from LoRA factors where :func:`low_rank_rotation` can."""
    if rotated is None:
        rotated = low_rank_rotation(inputs, name, fisher, rows, delta.device)
    return score_delta(delta, fisher, rotated)
