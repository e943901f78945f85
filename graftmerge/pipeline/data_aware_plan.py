"""A ``fisher`` or ``regmean`` merge config, resolved and checked before any tensor is merged.

Both methods average N models with weights that come from data: each input names its own
Fisher cache (``parameters: {fisher: ./fisher/a}``), made for that very model. ``fisher``
reads the caches' diagonal entries; ``regmean`` reads the input side of their KFAC
entries, which is the layer's input Gram matrix (docs/data-aware-merges.md).
:class:`DataAwarePlan` is the pure description; :func:`open_caches` opens and checks it.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from graftmerge.errors import GraftError
from graftmerge.formats.checkpoint import TensorSource, hf_cache_origin
from graftmerge.formats.fisher_cache import FisherCache, open_fisher_cache
from graftmerge.formats.lora_writer import CONV1D, LINEAR, model_layers
from graftmerge.hub.models import resolve_model_folder
from graftmerge.math.regmean import check_alpha
from graftmerge.pipeline.graft_plan import resolve_fisher_folder

METHODS = ("fisher", "regmean")
MODEL_PARAMETERS = ("fisher", "weight")
GLOBAL_PARAMETERS = {"fisher": ("epsilon",), "regmean": ("alpha", "regmean_fallback", "model_config")}
DEFAULT_EPSILON = 1e-30  # a guard against 0/0, far below any Fisher an estimate writes
DEFAULT_ALPHA = 0.9  # RegMean's non-diagonal scale for language models
FALLBACKS = ("error", "average")  # regmean_fallback: a linear weight some cache has no KFAC entry for
INPUT_SIDES = {LINEAR: "columns", CONV1D: "rows"}  # the factor side that is the layer's input Gram


@dataclass(frozen=True)
class DataAwareInput:
    """One model of the average: its folder (None in memory), its Fisher cache and its weight."""

    label: str
    folder: str | None
    fisher: str
    weight: float = 1.0


@dataclass(frozen=True)
class DataAwarePlan:
    """θ = Fisher- or Gram-weighted average of ``inputs``; the method's own parameters."""

    method: str
    inputs: tuple[DataAwareInput, ...]
    epsilon: float = DEFAULT_EPSILON
    alpha: float = DEFAULT_ALPHA
    fallback: str = "error"
    model_config: str | None = None  # regmean: a folder whose config.json says which weights are Linear/Conv1D

    def check(self) -> None:
        """Parameter checks (no file is opened)."""
        if not self.inputs:
            raise GraftError(f"{self.method} needs at least one model under `models:`")
        for item in self.inputs:
            if not math.isfinite(item.weight) or item.weight < 0:
                raise GraftError(f"{self.method}: weight of model {item.label} must be a finite number ≥ 0, "
                                 f"got {item.weight}")
        if sum(item.weight for item in self.inputs) <= 0:
            raise GraftError(f"{self.method}: the models' weights sum to 0; give at least one a positive weight")
        if not math.isfinite(self.epsilon) or self.epsilon < 0:
            raise GraftError(f"fisher parameter epsilon must be a finite number ≥ 0, got {self.epsilon}")
        check_alpha(self.alpha)
        if self.fallback not in FALLBACKS:
            raise GraftError(f"regmean parameter regmean_fallback must be one of {', '.join(FALLBACKS)}, "
                             f"got {self.fallback!r}")

    @property
    def weights(self) -> list[float]:
        """Each input's weight, in config order."""
        return [item.weight for item in self.inputs]


def scalar(value, label: str, method: str):
    """A parameter's single value; per-layer gradients and filters are refused in one line."""
    if isinstance(value, list | dict) or hasattr(value, "filter"):
        raise GraftError(f"{method} parameter {label} must be a single value (per-layer gradients and filters "
                         "are not supported by this method)")
    return value


def number(value, label: str, method: str) -> float:
    """A parameter as a float, or one GraftError line naming it."""
    value = scalar(value, label, method)
    if isinstance(value, bool):
        raise GraftError(f"{method} parameter {label} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        raise GraftError(f"{method} parameter {label} must be a finite number, got {value!r}") from None


def build_plan(method: str, inputs: list[DataAwareInput], parameters: Mapping) -> DataAwarePlan:
    """The one place a DataAwarePlan is made from shared parameters (as a config writes or mergekit binds them)."""
    unknown = sorted(set(parameters) - set(GLOBAL_PARAMETERS[method]))
    if unknown:
        raise GraftError(f"unknown {method} parameter(s) {', '.join(unknown)}; known: "
                         f"{', '.join(GLOBAL_PARAMETERS[method])}")
    model_config = parameters.get("model_config")
    plan = DataAwarePlan(
        method=method,
        inputs=tuple(inputs),
        epsilon=number(parameters.get("epsilon", DEFAULT_EPSILON), "epsilon", method),
        alpha=number(parameters.get("alpha", DEFAULT_ALPHA), "alpha", method),
        fallback=str(scalar(parameters.get("regmean_fallback", "error"), "regmean_fallback", method)),
        model_config=None if model_config is None else str(scalar(model_config, "model_config", method)),
    )
    plan.check()
    return plan


def plan_from_merge_config(config, run_parameter: str) -> DataAwarePlan:
    """Validate a mergekit ``MergeConfiguration`` with ``merge_method: fisher`` or ``regmean``; no tensor IO."""
    method = config.merge_method
    if config.slices or config.modules or not config.models:
        raise GraftError(f"{method} configs list inputs under `models:` (slices and modules are not supported)")
    if config.base_model is not None:
        raise GraftError(f"{method} averages its models and has no base: remove `base_model:` and list every "
                         "model under `models:` with its own Fisher cache")
    parameters = {k: v for k, v in dict(config.parameters or {}).items() if k != run_parameter}
    inputs, seen = [], {}
    for entry in config.models:
        inputs.append(_config_input(method, entry))
        real = os.path.realpath(inputs[-1].folder)
        if real in seen:
            raise GraftError(f"model {inputs[-1].label} and model {seen[real]} are the same folder {real}; "
                             "each input is a different model")
        seen[real] = inputs[-1].label
    return build_plan(method, inputs, parameters)


def _config_input(method: str, entry) -> DataAwareInput:
    """One ``models:`` entry: a model folder with ``fisher:`` (its own cache) and an optional ``weight``."""
    label, model_parameters = str(entry.model), dict(entry.parameters or {})
    if entry.model.lora is not None:
        raise GraftError(f"model {label}: {method} takes model folders; merge the LoRA adapter into its base first")
    unknown = sorted(set(model_parameters) - set(MODEL_PARAMETERS))
    if unknown:
        raise GraftError(f"model {label}: unknown {method} parameter(s) {', '.join(unknown)}; known: fisher, weight")
    fisher = model_parameters.get("fisher")
    if fisher is None:
        raise GraftError(f"model {label} has no Fisher cache: {method} needs `parameters: {{fisher: <its cache>}}` "
                         "on every model (made by `graftmerge fisher estimate` on that model)")
    folder = resolve_model_folder(entry.model.model.path, entry.model.model.revision)
    weight = number(model_parameters.get("weight", 1.0), f"weight of {label}", method)
    return DataAwareInput(label, folder, str(scalar(fisher, f"fisher of {label}", method)), weight)


def plan_inputs(plan: DataAwarePlan) -> list[tuple[str, str]]:
    """(label, folder) of everything ``plan`` reads: OUT may be none of them (caches that do not resolve are left
    out: opening them says why)."""
    found = []
    for item in plan.inputs:
        if item.folder is not None:
            found.append((f"model {item.label}", item.folder))
        with contextlib.suppress(GraftError):
            found.append((f"Fisher cache of {item.label}", resolve_fisher_folder(item.fisher)))
    return found


def open_caches(plan: DataAwarePlan, models: list[TensorSource]) -> list[FisherCache]:
    """Each input's cache, opened and checked against its own model (``models``: the inputs, in plan order)."""
    caches = []
    for item, model in zip(plan.inputs, models):
        cache = open_fisher_cache(resolve_fisher_folder(item.fisher))
        check_cache_model(cache, model, item, partial=item.folder is None)
        caches.append(cache)
    return caches


def check_cache_model(cache: FisherCache, model: TensorSource, item: DataAwareInput, partial: bool = False) -> None:
    """The cache was made for this model: same tensor names and shapes (the cache's fingerprint), and the same
    weights by content (``FisherCache.check_same_weights``), wherever the model lies. A cache from before content
    digests were recorded falls back to where it records its model was (a local folder, or a Hub repo and
    revision), with a warning."""
    cache.check_fits(model, partial=partial)
    if item.folder is None:
        return
    cache.check_same_weights(model)  # by content; without a recorded digest it warns, and the place is checked
    recorded = cache.manifest["model"]
    if recorded.get("weights_sha256") is not None:
        return
    source, revision = recorded.get("source"), recorded.get("revision")
    if isinstance(source, str) and os.path.isabs(source) and os.path.isdir(source):
        if not os.path.samefile(source, item.folder):
            raise GraftError(f"Fisher cache {cache.path} was made for the model in {source}, not for model "
                             f"{item.label} ({item.folder}): give each model the cache estimated on it")
        return
    repo, snapshot = hf_cache_origin(Path(item.folder))
    hub_source = isinstance(source, str) and repo is not None and not os.path.isabs(source)
    if hub_source and (source != repo or (revision and snapshot and revision != snapshot)):
        raise GraftError(f"Fisher cache {cache.path} was made for {source}@{revision or '?'}, not for model "
                             f"{item.label} ({repo}@{snapshot}): give each model the cache estimated on it")


def regmean_layers(plan: DataAwarePlan, tensors: Mapping[str, object]) -> dict[str, str]:
    """Tensor name → the factor side holding its input Gram, for every Linear / Conv1D weight of the model.

    Built from the model's config.json on the meta device: a torch Linear is stored out × in
    (its input side is ``columns``), a GPT-2 Conv1D in × out (``rows``). Embeddings, tied
    heads, norms and biases are not listed: they are averaged.
    """
    folder = plan.model_config or next((item.folder for item in plan.inputs if item.folder is not None), None)
    if folder is None:
        raise GraftError("regmean on in-memory models needs the shared parameter model_config: a folder with the "
                         "models' config.json (it says which weights are Linear or Conv1D layers)")
    try:
        layers = model_layers(folder, f"model_config {folder}" if plan.model_config else f"model {folder}")
    except GraftError as error:  # its words are delta extract's; the same cause, this method's name
        raise GraftError(str(error).replace("--rank needs", "regmean needs")) from error
    found = {}
    for name in tensors:
        module = layers.module_of(name)
        if module is not None and module[1] in INPUT_SIDES:
            found[name] = INPUT_SIDES[module[1]]
    return found
