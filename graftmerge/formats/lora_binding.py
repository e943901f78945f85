"""A LoRA adapter bound to a model: each model tensor it changes, checked to exist with the shape Δ needs.

Where PEFT's ``merge_and_unload()`` adds an adapter's product, by layer type:
``nn.Linear``: ``(B @ A) * scaling``; GPT-2's ``Conv1D`` (weights stored in × out):
``(B @ A)ᵀ * scaling``, whatever ``fan_in_fan_out`` says (PEFT sets it per layer type);
``nn.Embedding``: ``(B @ A)ᵀ * scaling`` (A is r × vocab, B is dim × r). Full saved
tensors (``modules_to_save``, an embedding's base layer) replace the model's.
The model's ``config.json`` says which layers are Conv1D, which architecture the adapter
must have been trained on, and whether the model is quantised (refused).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graftmerge.errors import GraftError
from graftmerge.formats.checkpoint import TensorInfo
from graftmerge.formats.json_file import load_json_file
from graftmerge.formats.lora_adapter import LoraAdapter

MAX_CLASS_NAME = 256  # auto_mapping / architectures names longer than this are no model class
# model_type -> transformers' Conv1D layers (weights stored in × out, so Δ = (B·A)ᵀ)
CONV1D_MODEL_TYPES = frozenset({"gpt2", "openai-gpt", "imagegpt", "decision_transformer"})
CONV1D_MODULES = frozenset({"c_attn", "q_attn", "c_fc", "c_proj"})


@dataclass(frozen=True)
class AdaptedWeight:
    """One model tensor the adapter changes: by its factors, by a full saved tensor, or both."""

    parameter: str  # the model's tensor name
    module: str | None  # the LoRA module writing into it
    transposed: bool  # Δ = (B·A)ᵀ: an embedding, or a Conv1D weight stored in × out
    full_key: str | None  # a saved tensor PEFT loads over this one (modules_to_save, an embedding's base layer)


def _model_name(name: str, tensors: Mapping[str, TensorInfo]) -> str | None:
    """The model's tensor for PEFT's parameter ``name``: itself, or without the model prefix some checkpoints omit."""
    if name in tensors:
        return name
    stripped = name.split(".", 1)[1] if "." in name else None
    return stripped if stripped in tensors else None


def check_architecture(adapter: LoraAdapter, model_config: Mapping[str, Any], model_label: str) -> None:
    """The model class the adapter records (``auto_mapping``) is of the model's family, when both say."""
    recorded = (adapter.config.get("auto_mapping") or {}).get("base_model_class")
    architectures = model_config.get("architectures") or []
    if not isinstance(recorded, str) or not architectures:
        return

    def family(name: str) -> str:
        """``Qwen3ForCausalLM`` / ``Qwen3Model`` -> ``Qwen3``; ``GPT2LMHeadModel`` -> ``GPT2``.

        A name longer than any class name is compared whole: the suffix search is quadratic
        in the name's length.
        """
        if len(name) > MAX_CLASS_NAME:
            return name
        return re.sub(r"(For[A-Z]\w*|LMHeadModel|PreTrainedModel|Model)$", "", name)

    if family(recorded) not in {family(str(a)) for a in architectures}:
        shown = ", ".join(map(str, architectures))
        raise GraftError(f"{adapter.label} was trained on a {recorded[:MAX_CLASS_NAME]}, but {model_label} is a "
                         f"{shown[:MAX_CLASS_NAME]}: an adapter for another architecture")


def bind_adapter(adapter: LoraAdapter, tensors: Mapping[str, TensorInfo], model_config: Mapping[str, Any],
                 model_label: str) -> dict[str, AdaptedWeight]:
    """Each model tensor the adapter changes, checked to exist with the shape the adapter needs.

    ``model_config`` (the model's config.json) says which layers are Conv1D (GPT-2 family)
    and which architecture the adapter must have been trained on.
    """
    check_architecture(adapter, model_config, model_label)
    conv1d = model_config.get("model_type") in CONV1D_MODEL_TYPES
    bound: dict[str, AdaptedWeight] = {}
    for module, lora in adapter.modules.items():
        name = _model_name(f"{module}.weight", tensors)
        if name is None:
            tied = " (its lm_head is tied to the embeddings: adapt the embedding instead)" if module.endswith(
                "lm_head") and model_config.get("tie_word_embeddings", True) else ""
            raise GraftError(f"{adapter.label} adapts {module}, which {model_label} does not have{tied}; "
                             "an adapter for another architecture?")
        transposed = lora.embedding or (conv1d and module.rsplit(".", 1)[-1] in CONV1D_MODULES)
        shape = (lora.in_features, lora.out_features) if transposed else (lora.out_features, lora.in_features)
        if tensors[name].shape != shape:
            raise GraftError(
                f"{adapter.label}: {module} has lora_A {lora.rank}×{lora.in_features} and lora_B "
                f"{lora.out_features}×{lora.rank}, so Δ is {shape[0]}×{shape[1]}, but {name} in {model_label} is "
                f"{'×'.join(map(str, tensors[name].shape))}: the adapter was made for another model")
        bound[name] = AdaptedWeight(parameter=name, module=module, transposed=transposed, full_key=None)
    for parameter, key in adapter.full.items():
        name = _model_name(parameter, tensors)
        if name is None or tensors[name].shape != adapter.tensors[key].shape:
            found = "does not have it" if name is None else f"has it as {'×'.join(map(str, tensors[name].shape))}"
            raise GraftError(f"{adapter.label} stores {parameter} as "
                             f"{'×'.join(map(str, adapter.tensors[key].shape))}, but {model_label} {found}")
        previous = bound.get(name)
        bound[name] = AdaptedWeight(name, previous.module if previous else None,
                                    previous.transposed if previous else False, key)
    return bound


def model_config_of(folder: str | os.PathLike) -> dict[str, Any]:
    """A model folder's config.json (an empty dict when it has none, e.g. an in-memory model)."""
    file = Path(folder, "config.json")
    if not file.is_file():
        return {}
    config = load_json_file(file, "model config")
    return config if isinstance(config, dict) else {}


def check_float_model(model_config: Mapping[str, Any], model_label: str) -> None:
    """A LoRA is added to float weights: a quantised model (``quantization_config``) is refused."""
    if model_config.get("quantization_config") is not None:
        raise GraftError(f"{model_label} is quantised (quantization_config in its config.json); a LoRA grafts "
                         "onto float weights only: use the unquantised model")
