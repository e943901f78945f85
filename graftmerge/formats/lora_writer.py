"""PEFT LoRA adapter folders, written: the folder :mod:`graftmerge.formats.lora_adapter` reads.

``graftmerge delta extract --rank K`` factors each weight's Δ and writes the factors in
the layout PEFT's ``save_pretrained`` uses, so ``PeftModel.from_pretrained(donor, folder)``
loads it (no missing or unexpected keys) and ``merge_and_unload()`` adds ``B·A`` back:

- which modules LoRA can adapt, and how, comes from the model itself, built from the
  donor's ``config.json`` on the meta device (nothing allocated, no remote code):
  ``nn.Linear`` (Δ = B·A), transformers' ``Conv1D`` (GPT-2, weights stored in × out:
  Δ = (B·A)ᵀ, ``fan_in_fan_out``) and ``nn.Embedding`` (``lora_embedding_A/B``,
  Δ = (B·A)ᵀ). Every other tensor (norms, biases, other parameters) has no LoRA form;
- ``lora_alpha = r`` for every module, so PEFT's scaling ``lora_alpha / r`` is exactly 1
  and ``B·A`` is Δ_K itself; a module whose rank is smaller (a weight narrower than K)
  gets its own r and alpha through ``rank_pattern`` / ``alpha_pattern``, keyed by its
  full name (regex-escaped, matched by PEFT's ``(.*\\.)?(key)$``);
- ``target_modules`` lists short names (``q_proj``) when they select exactly the written
  modules, else full module names: PEFT then creates no layer without factors.

``lora_manifest.json`` (written by the pipeline, last) records the sources and what
each tensor kept or lost; see docs/formats/delta-folder.md.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import save_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.pytorch_utils import Conv1D

from graftmerge.errors import GraftError
from graftmerge.formats.lora_adapter import CONFIG_NAME, KEY_PREFIX, WEIGHTS_NAME
from graftmerge.formats.transformers_logging import quiet_transformers

LORA_MANIFEST_NAME = "lora_manifest.json"  # graftmerge's record beside PEFT's two files; PEFT and the reader ignore it
LORA_FORMAT_NAME = "graftmerge.lora"
LORA_FORMAT_VERSION = 1
LINEAR, CONV1D, EMBEDDING = "linear", "conv1d", "embedding"
TRANSPOSED = frozenset({CONV1D, EMBEDDING})  # stored (in × out): PEFT's Δ is (B·A)ᵀ


@dataclass(frozen=True)
class ModelLayers:
    """What PEFT will see in the donor: every module's name, and the kind of each LoRA can adapt."""

    architecture: str  # the model class, e.g. Qwen3ForCausalLM
    parent_library: str  # its Python module, for the adapter's auto_mapping
    task_type: str | None  # CAUSAL_LM for a causal LM class
    prefix: str  # base_model_prefix: a checkpoint may name tensors without it (GPT-2's h.0...)
    modules: frozenset[str]  # every named module
    kinds: dict[str, str]  # module -> LINEAR / CONV1D / EMBEDDING
    embedding: str | None  # the input embedding's module
    tied: frozenset[str]  # modules whose weight is the input embedding's (a tied lm_head)

    def module_of(self, name: str) -> tuple[str, str] | None:
        """(PEFT's module name, kind) when tensor ``name`` is a weight LoRA can adapt, else None."""
        module, _, parameter = name.rpartition(".")
        if parameter != "weight":
            return None
        for candidate in (module, f"{self.prefix}.{module}"):
            if candidate in self.kinds and candidate not in self.tied:
                return candidate, self.kinds[candidate]
        return None

    def is_tied(self, name: str) -> bool:
        """Whether tensor ``name`` is the weight of a module tied to the input embedding."""
        module = name.rpartition(".")[0]
        return module in self.tied or f"{self.prefix}.{module}" in self.tied


def model_layers(folder: str | Path, label: str) -> ModelLayers:
    """The donor's modules, from its ``config.json``, built on the meta device (never its own code)."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise GraftError(f"{label} has no config.json; --rank needs it (PEFT adapts modules, and which "
                         "are Linear, Conv1D or Embedding layers comes from the model's config)")
    try:
        with quiet_transformers():
            config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
            named = (getattr(config, "architectures", None) or [None])[0]
            model_class = getattr(transformers, named, None) if isinstance(named, str) else None
            with torch.device("meta"):
                model = (model_class(config) if isinstance(model_class, type) and issubclass(
                    model_class, transformers.PreTrainedModel) else AutoModelForCausalLM.from_config(
                    config, trust_remote_code=False))
    except Exception as error:  # noqa: BLE001 - whatever stops transformers building the donor's model
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise GraftError(f"{label}: transformers cannot build the model its config.json describes ({first}); "
                         "--rank needs a model transformers knows (no remote code)") from error
    kinds = {}
    for name, module in model.named_modules():
        kind = (CONV1D if isinstance(module, Conv1D) else EMBEDDING if isinstance(module, nn.Embedding)
                else LINEAR if isinstance(module, nn.Linear) else None)
        if name and kind is not None:
            kinds[name] = kind
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    shared = [name for name, module in model.named_modules()
              if embedding is not None and getattr(module, "weight", None) is embedding.weight]
    tied = frozenset(name for name in shared if dict(model.named_modules())[name] is not embedding)
    return ModelLayers(
        architecture=type(model).__name__,
        parent_library=type(model).__module__,
        task_type="CAUSAL_LM" if type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() else None,
        prefix=getattr(model, "base_model_prefix", "") or "",
        modules=frozenset(n for n, _ in model.named_modules() if n),
        kinds=kinds,
        embedding=next((n for n in shared if n not in tied), None),
        tied=tied,
    )


@dataclass(frozen=True)
class LoraFactors:
    """One module's factors in PEFT's layout: ``a`` is r × in, ``b`` is out × r (B·A, or (B·A)ᵀ when transposed)."""

    module: str
    kind: str
    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        """The module's r."""
        return self.a.shape[0]


def factors_of(module: str, kind: str, left: torch.Tensor, right: torch.Tensor) -> LoraFactors:
    """PEFT's factors for a weight whose stored Δ is ``left @ right``: (A, B) = (right, left), transposed
    for Conv1D and Embedding (stored in × out, so B·A must be Δᵀ = rightᵀ·leftᵀ)."""
    if kind in TRANSPOSED:
        return LoraFactors(module, kind, a=left.T.contiguous(), b=right.T.contiguous())
    return LoraFactors(module, kind, a=right, b=left)


def target_modules(written: set[str], modules: frozenset[str]) -> list[str]:
    """Short names (``q_proj``) when PEFT's match selects exactly ``written`` among ``modules``, else full names."""
    short = sorted({name.rsplit(".", 1)[-1] for name in written})
    selected = {name for name in modules if any(name == s or name.endswith("." + s) for s in short)}
    return short if selected == written else sorted(written)


def adapter_config(factors: list[LoraFactors], layers: ModelLayers, base_model: str | None,
                   revision: str | None) -> dict[str, Any]:
    """``adapter_config.json``: plain LoRA, ``lora_alpha = r`` everywhere (scaling 1), other ranks by pattern."""
    ranks = Counter(f.rank for f in factors)
    rank = max(ranks, key=lambda r: (ranks[r], r))  # the most common rank; the others go to the patterns
    others = {re.escape(f.module): f.rank for f in factors if f.rank != rank}
    return {
        "peft_type": "LORA",
        "task_type": layers.task_type,
        "base_model_name_or_path": base_model,
        "revision": revision,
        "auto_mapping": {"base_model_class": layers.architecture, "parent_library": layers.parent_library},
        "r": rank,
        "lora_alpha": rank,
        "rank_pattern": others,
        "alpha_pattern": dict(others),
        "use_rslora": False,
        "target_modules": target_modules({f.module for f in factors}, layers.modules),
        "fan_in_fan_out": any(f.kind == CONV1D for f in factors),
        "bias": "none",
        "modules_to_save": None,
        "init_lora_weights": True,
        "lora_dropout": 0.0,
        "inference_mode": True,
    }


def write_lora_adapter(folder: Path, factors: list[LoraFactors], layers: ModelLayers, *, base_model: str | None,
                       revision: str | None, dtype: torch.dtype) -> dict[str, Any]:
    """Write ``adapter_model.safetensors`` and ``adapter_config.json`` into ``folder``; return the config.

    ``folder`` is a staging folder (:mod:`graftmerge.formats.output_folder` publishes it).
    """
    if not factors:
        raise GraftError("no weight LoRA can express has a nonzero Δ: there is no adapter to write")
    tensors = {}
    for f in factors:
        a_key, b_key = ("lora_embedding_A", "lora_embedding_B") if f.kind == EMBEDDING else (
            "lora_A.weight", "lora_B.weight")
        tensors[f"{KEY_PREFIX}{f.module}.{a_key}"] = f.a.to(dtype).contiguous()
        tensors[f"{KEY_PREFIX}{f.module}.{b_key}"] = f.b.to(dtype).contiguous()
    save_file(tensors, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
    config = adapter_config(factors, layers, base_model, revision)
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True))
    return config
