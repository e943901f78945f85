"""LoRA adapters inside mergekit's graph, without merging them into a model first.

mergekit loads every input of a config as a model folder, and merges a ``BASE+ADAPTER``
reference by loading the whole model into transformers and PEFT (``ModelReference.merged``).
graft needs neither: :mod:`graftmerge.formats.lora_sources` reads an adapter as a tensor
source. So before the merge, the config mergekit sees is rewritten and each LoRA input's
loader is put into mergekit's ``LoaderCache``:

- a ``role: delta`` adapter folder (no config.json of its own) becomes the reference
  ``POST+ADAPTER`` (mergekit reads the post model's config for it); its loader returns Δ;
- a ``BASE+ADAPTER`` donor_ft keeps its reference; its loader returns θft, the base with
  the adapter merged in as PEFT's ``merge_and_unload()`` would in float32;
- a donor implied by ``BASE+ADAPTER`` (none listed) is added with ``role: donor``.

The loaders are removed when the merge ends, whatever happens.

In memory (mergekit's ``merge_state_dicts``), every input is a state dict with the post
model's tensor names, so an adapter is handed over as one: :func:`lora_delta_state_dict`
turns PEFT's state dict and config into Δ under the model's names (the same checks and
the same arithmetic as a folder), and the graft recognises those tensors
(:class:`InMemoryDelta`) to rotate them from their factors as it would the folder's.

Low rank kept low: when a graft's whole Δ is one adapter (``role: delta``, nothing else),
every KFAC weight is rotated from the factors, ``Δ̃ = λ·s·(UᵀB)(AV)``, never from the
dense Δ (:func:`scored_delta`, which every scoring site of the pipeline calls, so the
threshold pass, the merge kernel, plan and sweep agree bit for bit).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from mergekit.common import ModelPath, ModelReference
from mergekit.config import InputModelDefinition
from mergekit.io.lazy_tensor_loader import ShardedTensorIndex, ShardInfo

from graftmerge.adapter import mergekit_compat
from graftmerge.errors import GraftError
from graftmerge.formats.checkpoint import InMemoryCheckpoint, TensorSource
from graftmerge.formats.lora_adapter import WEIGHTS_NAME, open_lora_state_dict
from graftmerge.formats.lora_binding import bind_adapter, check_float_model
from graftmerge.formats.lora_sources import LoraDelta, LoraFineTune
from graftmerge.math.finite import all_finite
from graftmerge.math.low_rank import low_rank_rotate
from graftmerge.math.projection import ScoredDelta, TensorFisher, score_delta
from graftmerge.pipeline.finite_values import adapter_problem, check_scores
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
    loaders = {reference: SourceLoader(source, str(source.adapter.path)) for reference, source in sources.items()}
    with mergekit_compat.loaders_in_cache(loaders):
        yield view


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
    lam = inputs.plan.delta_lambdas_for(name)[0]
    return low_rank_rotate(left.to(device), right.to(device), scale * lam, kfac.U, kfac.V)


def scored_delta(inputs: GraftInputs, name: str, delta: torch.Tensor, fisher: TensorFisher,
                 rows: tuple[int, int] | None = None, rotated: torch.Tensor | None = None) -> ScoredDelta:
    """``score_delta`` of one tensor (block) of a graft, Δ̃ from LoRA factors where :func:`low_rank_rotation` can."""
    if rotated is None:
        rotated = low_rank_rotation(inputs, name, fisher, rows, delta.device)
    scored = score_delta(delta, fisher, rotated)
    check_scores(inputs, name, scored.scores, rows, scored.rotated)  # NaN/Inf in Δ or Δ̃ never reaches a mask
    return scored


FACTORS_ATTRIBUTE = "graftmerge_lora_factors"  # (name, (B, A, scale)) on each Δ tensor lora_delta_state_dict made


def _state_dict_of(model: Any, what: str) -> Mapping[str, torch.Tensor]:
    """A module's state dict (its own tensors, detached), or ``model`` itself when it is one."""
    if isinstance(model, torch.nn.Module):
        return model.state_dict()
    if isinstance(model, Mapping) and all(isinstance(t, torch.Tensor) for t in model.values()):
        return model
    raise GraftError(f"{what} must be a state dict (name -> tensor) or a torch module, got {type(model).__name__}")


def _model_config_of(model: Any, model_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The model's config.json as a dict: ``model_config``, else a transformers model's own ``config``."""
    if model_config is None and hasattr(getattr(model, "config", None), "to_dict"):
        model_config = model.config.to_dict()
    if not isinstance(model_config, Mapping):
        raise GraftError("lora_delta_state_dict needs the model's config (model_config=, its config.json as a dict, "
                         "or pass the transformers model itself): it says which layers are GPT-2 Conv1D and "
                         "which architecture the adapter must fit")
    return dict(model_config)


def lora_delta_state_dict(adapter_state_dict: Mapping[str, torch.Tensor], adapter_config: Any, model: Any, *,
                          model_config: Mapping[str, Any] | None = None, donor: Any = None,
                          label: str = "adapter") -> dict[str, torch.Tensor]:
    """A PEFT LoRA adapter as ``merge_state_dicts`` takes a ``role: delta`` input: Δ under ``model``'s names.

    ``adapter_state_dict``: PEFT's keys (``get_peft_model_state_dict(peft_model)``, or the
    tensors of ``adapter_model.safetensors``); ``adapter_config``: ``adapter_config.json`` as
    a dict, or the ``LoraConfig`` (``peft_model.peft_config["default"]``). ``model``: the post
    model (a transformers model, or its state dict with ``model_config=``), for names, shapes,
    layer types and the architecture check. ``donor``: the model the adapter was trained on,
    needed only when it saves whole tensors (Δ = saved − donor).

    Checked and computed exactly as an adapter folder given ``role: delta`` (float32 Δ,
    ``scaling·B·A`` as PEFT computes it); a graft of the result equals the graft of the folder
    bit for bit, KFAC masks included (the graft rotates these tensors from their factors).
    Weights the adapter leaves alone are zeros that take no memory (expanded views);
    integer buffers are the model's own, as mergekit needs every input to agree on them.
    """
    tensors = _state_dict_of(model, "model")
    config = _model_config_of(model, model_config)
    adapter = open_lora_state_dict(adapter_state_dict, adapter_config, label)
    dtypes = {name: tensor.dtype for name, tensor in tensors.items()}
    post = InMemoryCheckpoint(dict(tensors), dtypes, "the model")
    donor_source = None
    if donor is not None:
        donor_tensors = _state_dict_of(donor, "donor")
        donor_source = InMemoryCheckpoint(dict(donor_tensors), {n: t.dtype for n, t in donor_tensors.items()},
                                          "the donor")
    check_float_model(config, "the model")
    delta = LoraDelta(adapter, bind_adapter(adapter, post.tensors, config, "the model"), post, donor_source, label)
    result = {}
    for name, info in post.tensors.items():
        device = tensors[name].device
        if not info.is_floating:
            result[name] = tensors[name]
            continue
        if name in delta.bound:
            result[name] = delta.read(name).to(device)
            if not all_finite(result[name]):  # a product or a float64 factor beyond float32's range
                raise GraftError(adapter_problem(delta, name))
        else:
            result[name] = torch.zeros((), device=device).expand(info.shape)
        factors = delta.low_rank_factors(name)
        if factors is not None:  # the factors travel with the tensor the caller hands merge_state_dicts
            setattr(result[name], FACTORS_ATTRIBUTE, (name, factors))
    return result


class InMemoryDelta(InMemoryCheckpoint):
    """A ``role: delta`` input of ``merge_state_dicts``: Δ tensors under the model's names, checked finite.

    Tensors made by :func:`lora_delta_state_dict` keep their LoRA factors
    (:meth:`low_rank_factors`), so a lone adapter is rotated from them, as from its folder.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype], label: str):
        super().__init__(tensors, dtypes, label)
        self.given = tensors
        for name, tensor in tensors.items():
            if not all_finite(tensor):
                raise GraftError(f"{label}: delta tensor {name!r} contains NaN or Inf")

    @property
    def checkpoint(self) -> InMemoryDelta:
        """The tensor source itself (as ``DeltaFolder.checkpoint`` is for a folder)."""
        return self

    def low_rank_factors(self, name: str) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """``LoraDelta.low_rank_factors`` of the adapter this tensor was made from, or None (a dense Δ)."""
        made = getattr(self.given[name], FACTORS_ATTRIBUTE, None)
        return made[1] if made is not None and made[0] == name else None
