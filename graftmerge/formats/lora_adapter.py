"""PEFT LoRA adapter folders opened and checked: the config and every stored tensor, no model needed.

A folder written by PEFT's ``save_pretrained``::

    adapter_config.json         the LoraConfig (r, lora_alpha, use_rslora, rank_pattern, ...)
    adapter_model.safetensors   base_model.model.<module>.lora_A.weight        r × in
                                base_model.model.<module>.lora_B.weight        out × r
                                base_model.model.<module>.lora_embedding_A     r × vocab
                                base_model.model.<module>.lora_embedding_B     dim × r
                                base_model.model.<name>                        full tensors: modules_to_save,
                                base_model.model.<module>.base_layer.weight    or an embedding's own weight

:func:`open_lora_adapter` checks the config (:mod:`graftmerge.formats.peft_rules`) and the
safetensors header, :func:`open_lora_state_dict` the same for PEFT's state dict held in
memory; factors are accepted only on modules PEFT itself would adapt. Binding the result
to a model is :mod:`graftmerge.formats.lora_binding`; reading it as Δ or as a merged
fine-tune, :mod:`graftmerge.formats.lora_sources`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from graftmerge.errors import GraftError
from graftmerge.formats.checkpoint import (
    SAFETENSORS_NAMES,
    SafetensorsLayout,
    TensorInfo,
    read_safetensors_layout,
    shard_sample_digest,
)
from graftmerge.formats.json_file import load_json_file
from graftmerge.formats.peft_rules import (
    check_adapter_config,
    module_rank_alpha,
    peft_adapts,
    scaling_of,
    under_modules_to_save,
)

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."
FLOATING = ("F64", "F32", "F16", "BF16")
FACTOR_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<side>[AB])\.weight")
EMBEDDING_KEY = re.compile(r"(?P<module>.+)\.lora_embedding_(?P<side>[AB])")
BASE_LAYER_KEY = re.compile(r"(?P<module>.+)\.base_layer\.(?P<parameter>[^.]+)")


def is_lora_adapter(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` looks like a PEFT adapter (it has an ``adapter_config.json``)."""
    return Path(folder, CONFIG_NAME).is_file()


@dataclass(frozen=True)
class LoraModule:
    """One adapted module: where its factors are, its rank and its scaling."""

    module: str  # the module's name in the model, e.g. model.layers.0.self_attn.q_proj
    a_key: str
    b_key: str
    embedding: bool  # lora_embedding_A/B (Δ = (B·A)ᵀ)
    rank: int
    scaling: float
    in_features: int  # A's columns (the vocabulary for an embedding)
    out_features: int  # B's rows


@dataclass(frozen=True)
class LoraAdapter:
    """An opened adapter (a folder, or PEFT's state dict in memory): config and tensor list checked, tensors read on demand."""

    path: Path | None  # the folder; None for an adapter given in memory
    label: str
    config: dict[str, Any]
    tensors: Mapping[str, TensorInfo]  # every stored tensor by key, from the file's header or from memory
    modules: dict[str, LoraModule]  # by module name
    full: dict[str, str]  # the model's parameter name (as PEFT names it) -> key of a full saved tensor
    layout: SafetensorsLayout | None = None  # the file's checked header; None in memory
    state_dict: Mapping[str, torch.Tensor] | None = None  # the tensors themselves, for an adapter in memory

    @property
    def file(self) -> Path | None:
        """The adapter's safetensors file (None in memory)."""
        return self.layout.file if self.layout is not None else None

    def read(self, key: str) -> torch.Tensor:
        """One stored tensor, in its stored dtype; GraftError if it holds NaN or Inf."""
        if self.state_dict is not None:
            tensor = self.state_dict[key].detach()
        else:
            with safe_open(str(self.file), framework="pt") as handle:
                tensor = handle.get_tensor(key)
        if not bool(torch.isfinite(tensor).all()):
            raise GraftError(f"{self.file or self.label}: adapter tensor {key!r} contains NaN or Inf")
        return tensor

    def check_all_values(self) -> None:
        """Every stored tensor read once (what a pull checks before it keeps an adapter)."""
        for key in self.tensors:
            self.read(key)

    def product(self, module: str, transposed: bool) -> torch.Tensor:
        """PEFT's delta weight of ``module`` in float32: ``(B @ A)`` (transposed when asked) ``* scaling``."""
        lora = self.modules[module]
        product = self.read(lora.b_key).float() @ self.read(lora.a_key).float()
        return (product.T.contiguous() if transposed else product) * lora.scaling  # contiguous, as sources read

    def stamps(self) -> list[tuple[str, int, int, str]]:
        """(path, size, mtime_ns, content digest) of the config and the weights: identity for result caches."""
        if self.path is None or self.layout is None:
            raise GraftError(f"{self.label} is in memory: it has no files to identify it by")
        config = self.path / CONFIG_NAME
        stamps = []
        for file, digest in ((config, hashlib.sha256(config.read_bytes()).hexdigest()),
                             (self.file, shard_sample_digest(self.layout))):
            stat = file.stat()
            stamps.append((str(file.resolve()), stat.st_size, stat.st_mtime_ns, digest))
        return stamps


def open_lora_adapter(path: str | os.PathLike, label: str | None = None) -> LoraAdapter:
    """Open a PEFT LoRA folder: config and header checked, nothing refused left for later.

    GraftError (one line, naming the field or tensor) for anything whose Δ this reader
    cannot reproduce exactly: another PEFT method, DoRA, a trained bias, PiSSA-style
    initialisations that rewrite the base, unknown fields that are switched on, keys PEFT
    itself would not load, factors whose rank disagrees with the config.
    """
    path = Path(path)
    label = label or f"adapter {path}"
    if not path.is_dir():
        raise GraftError(f"{label}: folder {path} does not exist")
    config_file = path / CONFIG_NAME
    if not config_file.is_file():
        raise GraftError(f"{label}: {path} has no {CONFIG_NAME} (not a PEFT adapter folder)")
    config = load_json_file(config_file, "adapter config")
    if not isinstance(config, dict):
        raise GraftError(f"{config_file}: not a PEFT adapter config (not a JSON object)")
    check_adapter_config(config, str(config_file))
    weights = path / WEIGHTS_NAME
    if not weights.is_file():
        other = " (it has adapter_model.bin: re-save it with safe_serialization=True)" if (
            path / "adapter_model.bin").exists() else ""
        raise GraftError(f"{label}: no {WEIGHTS_NAME} in {path}{other}; graftmerge reads safetensors only")
    layout = read_safetensors_layout(weights)
    modules, full = _classify_keys(config, layout.tensors, str(weights))
    return LoraAdapter(path=path, label=label, config=config, tensors=layout.tensors, modules=modules, full=full,
                       layout=layout)


def plain_adapter_config(config: Any, label: str) -> dict[str, Any]:
    """An adapter config as ``adapter_config.json`` holds it, from a dict or a PEFT ``LoraConfig``.

    ``to_dict()`` of a config object; name sets become sorted lists (as PEFT's
    ``save_pretrained`` writes them), enum values their strings.
    """
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    if not isinstance(config, Mapping):
        raise GraftError(f"{label}: the adapter config must be a dict (what adapter_config.json holds) or a PEFT "
                         f"LoraConfig, got {type(config).__name__}")

    def plain(value: Any) -> Any:
        """A set of names as a sorted list; anything else JSON cannot hold is an error."""
        if isinstance(value, set | frozenset):
            return sorted(value)
        raise TypeError(f"{type(value).__name__} is not JSON")

    try:
        return json.loads(json.dumps(dict(config), default=plain))
    except (TypeError, ValueError) as error:
        raise GraftError(f"{label}: the adapter config holds a value adapter_config.json cannot ({error})") from None


def open_lora_state_dict(state_dict: Mapping[str, torch.Tensor], config: Any, label: str) -> LoraAdapter:
    """An adapter held in memory: PEFT's state dict (``get_peft_model_state_dict``, or the file's
    tensors) and its config, checked exactly as :func:`open_lora_adapter` checks a folder."""
    config = plain_adapter_config(config, label)
    check_adapter_config(config, label)
    if not isinstance(state_dict, Mapping):
        raise GraftError(f"{label}: the adapter's tensors must be a state dict (PEFT key -> tensor), got "
                         f"{type(state_dict).__name__}")
    tensors = {}
    for key, tensor in state_dict.items():
        if not isinstance(key, str) or not isinstance(tensor, torch.Tensor):
            raise GraftError(f"{label}: the adapter state dict must map PEFT's key names to tensors, got "
                             f"{key!r}: {type(tensor).__name__}")
        if tensor.dtype not in SAFETENSORS_NAMES:
            raise GraftError(f"{label}: tensor {key!r} is {tensor.dtype}; adapter tensors are floating point")
        tensors[key] = TensorInfo(name=key, shape=tuple(tensor.shape), dtype=SAFETENSORS_NAMES[tensor.dtype], file=None)
    modules, full = _classify_keys(config, tensors, label)
    return LoraAdapter(path=None, label=label, config=config, tensors=tensors, modules=modules, full=full,
                       state_dict=dict(state_dict))


def _classify_keys(config: dict[str, Any], tensors: Mapping[str, TensorInfo],
                   where: str) -> tuple[dict[str, LoraModule], dict[str, str]]:
    """Every key of the file: a LoRA factor, a full tensor PEFT loads over the base, or an error."""
    factors: dict[str, dict[str, str]] = {}
    embedding: dict[str, bool] = {}
    full: dict[str, str] = {}
    base_layers: set[str] = set()
    for key, info in sorted(tensors.items()):
        if not key.startswith(KEY_PREFIX):
            raise GraftError(f"{where}: tensor {key!r} does not start with {KEY_PREFIX!r}; PEFT would not load it "
                             "(not a file written by PEFT's save_pretrained)")
        if info.dtype not in FLOATING:
            raise GraftError(f"{where}: tensor {key!r} is stored as {info.dtype}; adapter tensors are floating point")
        name = key[len(KEY_PREFIX):]
        match = FACTOR_KEY.fullmatch(name) or EMBEDDING_KEY.fullmatch(name)
        base_layer = BASE_LAYER_KEY.fullmatch(name)
        if match:
            module = match["module"]
            if embedding.setdefault(module, match.re is EMBEDDING_KEY) != (match.re is EMBEDDING_KEY):
                raise GraftError(f"{where}: module {module!r} has both lora_A/B and lora_embedding_A/B factors")
            factors.setdefault(module, {})[match["side"]] = key
        elif ".lora_" in name or name.startswith("lora_"):
            raise GraftError(f"{where}: tensor {key!r} is not a plain LoRA factor (expected <module>.lora_A.weight, "
                             ".lora_B.weight, .lora_embedding_A or .lora_embedding_B without an adapter name)")
        elif base_layer:
            full[f"{base_layer['module']}.{base_layer['parameter']}"] = key
            base_layers.add(base_layer["module"])
        elif under_modules_to_save(config, name):
            full[name] = key
        else:
            raise GraftError(f"{where}: tensor {key!r} is neither a LoRA factor nor part of modules_to_save "
                             f"({config.get('modules_to_save')}); PEFT would not load it")
    modules = {m: _lora_module(config, m, sides, embedding[m], tensors, where) for m, sides in sorted(factors.items())}
    for module in sorted(base_layers - set(modules)):
        raise GraftError(f"{where}: {module}.base_layer is saved, but {module!r} has no LoRA factors; PEFT would not "
                         "load it")
    if not modules and not full:
        raise GraftError(f"{where}: the adapter holds no tensors")
    return modules, full


def _lora_module(config: dict[str, Any], module: str, sides: dict[str, str], is_embedding: bool,
                 tensors: Mapping[str, TensorInfo], where: str) -> LoraModule:
    """One module's factors, checked: both present, 2-D, ranks agreeing with each other and the config."""
    for side in "AB":
        if side not in sides:
            raise GraftError(f"{where}: module {module!r} has lora_{'B' if side == 'A' else 'A'} but no "
                             f"lora_{side}{'' if is_embedding else '.weight'}")
    a, b = tensors[sides["A"]].shape, tensors[sides["B"]].shape
    if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
        raise GraftError(f"{where}: module {module!r}: lora_A {list(a)} and lora_B {list(b)} are not r × in and "
                         "out × r with one r (only Linear, Conv1D and Embedding adapters graft)")
    rank, _ = module_rank_alpha(config, module, where)
    if a[0] != rank:
        raise GraftError(f"{where}: module {module!r} has rank {a[0]} but the config gives it r = {rank} "
                         "(r / rank_pattern); PEFT would refuse to load it")
    if under_modules_to_save(config, module):
        raise GraftError(f"{where}: module {module!r} has LoRA factors but is in modules_to_save; PEFT would not "
                         "load them")
    if not peft_adapts(config, module, where):
        raise GraftError(f"{where}: module {module!r} has LoRA factors but target_modules / exclude_modules / "
                         "layers_to_transform leave it out; PEFT would not load them")
    return LoraModule(module=module, a_key=sides["A"], b_key=sides["B"], embedding=is_embedding, rank=rank,
                      scaling=scaling_of(config, module, where), in_features=a[1], out_features=b[0])
