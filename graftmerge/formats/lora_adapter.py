"""PEFT LoRA adapter folders, read as deltas: Δ_W = scaling · B·A for every adapted weight.

A folder written by PEFT's ``save_pretrained``::

    adapter_config.json         the LoraConfig (r, lora_alpha, use_rslora, rank_pattern, ...)
    adapter_model.safetensors   base_model.model.<module>.lora_A.weight        r × in
                                base_model.model.<module>.lora_B.weight        out × r
                                base_model.model.<module>.lora_embedding_A     r × vocab
                                base_model.model.<module>.lora_embedding_B     dim × r
                                base_model.model.<name>                        full tensors: modules_to_save,
                                base_model.model.<module>.base_layer.weight    or an embedding's own weight

What PEFT's ``merge_and_unload()`` adds to each weight, reproduced here in float32 with
the same operations (so a base + adapter equals PEFT's float32 merge bit for bit):

- ``scaling = lora_alpha / r`` (``lora_alpha / √r`` with ``use_rslora``); r and alpha of
  a module come from ``rank_pattern`` / ``alpha_pattern`` when a key matches, by PEFT's
  rule (``(.*\\.)?(key)$`` on the module's name, first key in the file's order);
- ``nn.Linear``: ``(B @ A) * scaling``; GPT-2's ``Conv1D`` (weights stored in × out):
  ``(B @ A)ᵀ * scaling``, whatever ``fan_in_fan_out`` says (PEFT sets it per layer type);
  ``nn.Embedding``: ``(B @ A)ᵀ * scaling`` (A is r × vocab, B is dim × r);
- full tensors replace the model's (PEFT loads them over the base): Δ = saved − donor.

:func:`open_lora_adapter` checks the config and the safetensors header (no model needed),
:func:`open_lora_state_dict` the same for PEFT's state dict held in memory; factors are
accepted only on modules PEFT itself would adapt (:func:`peft_adapts`: target_modules,
exclude_modules, layers_to_transform / layers_pattern, exactly as PEFT matches them);
:func:`bind_adapter` checks that every target exists in a model with the right shape;
:class:`LoraDelta` (``role: delta``) and :class:`LoraFineTune` (``base+adapter``) present
the result as tensor sources keyed by the model's own parameter names.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from graftmerge.errors import GraftError
from graftmerge.formats.bounded_regex import (
    check_pattern,
    pattern_fullmatch,
    pattern_match,
    pattern_matches_start,
)
from graftmerge.formats.checkpoint import (
    SAFETENSORS_NAMES,
    FileIdentity,
    SafetensorsLayout,
    TensorInfo,
    TensorSource,
    file_identity,
    read_safetensors_layout,
    shard_sample_digest,
)
from graftmerge.formats.json_file import load_json_file

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."
FLOATING = ("F64", "F32", "F16", "BF16")
FACTOR_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<side>[AB])\.weight")
EMBEDDING_KEY = re.compile(r"(?P<module>.+)\.lora_embedding_(?P<side>[AB])")
BASE_LAYER_KEY = re.compile(r"(?P<module>.+)\.base_layer\.(?P<parameter>[^.]+)")
MAX_CLASS_NAME = 256  # auto_mapping / architectures names longer than this are no model class
# model_type -> transformers' Conv1D layers (weights stored in × out, so Δ = (B·A)ᵀ)
CONV1D_MODEL_TYPES = frozenset({"gpt2", "openai-gpt", "imagegpt", "decision_transformer"})
CONV1D_MODULES = frozenset({"c_attn", "q_attn", "c_fc", "c_proj"})
PLAIN_INITS = ("gaussian", "eva", "orthogonal")  # with true/false: inits that leave the base weights alone
# Fields whose meaning changes Δ: refused unless off (null, false, empty).
REFUSED_FIELDS = {
    "use_dora": "DoRA (Δ rescales every column by a learned magnitude)",
    "lora_bias": "a trained bias on lora_B",
    "layer_replication": "layer replication (it changes which layers exist)",
    "use_qalora": "QA-LoRA (an adapter for a quantised base)",
    "loftq_config": "LoftQ (an adapter that corrects a quantised base)",
    "megatron_config": "Megatron parallel layers",
    "trainable_token_indices": "trainable tokens (a sparse update of the embedding)",
    "target_parameters": "LoRA on bare parameters (e.g. MoE experts)",
    "alora_invocation_tokens": "activated LoRA (applied only after its invocation tokens)",
    "arrow_config": "Arrow routing between adapters",
    "use_bdlora": "block-diagonal LoRA",
    "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA",
    "kasa_config": "KaSA",
}
HANDLED_FIELDS = frozenset({
    "peft_type", "r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "fan_in_fan_out", "bias",
    "modules_to_save", "target_modules", "exclude_modules", "init_lora_weights", "auto_mapping",
    "layers_to_transform", "layers_pattern",
})
# Fields with no effect on a trained adapter's Δ (training, loading or bookkeeping only).
IGNORED_FIELDS = frozenset({
    "task_type", "base_model_name_or_path", "revision", "inference_mode", "peft_version", "lora_dropout",
    "megatron_core", "runtime_config", "qalora_group_size",
    "eva_config", "corda_config", "lora_ga_config", "ensure_weight_tying",
})


def is_lora_adapter(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` looks like a PEFT adapter (it has an ``adapter_config.json``)."""
    return Path(folder, CONFIG_NAME).is_file()


def _is_off(value: Any) -> bool:
    return value is None or value is False or value == {} or value == []


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


def check_adapter_config(config: dict[str, Any], where: str) -> None:
    """Every field of ``adapter_config.json`` is one whose effect on Δ is reproduced, ignored safely, or off."""
    if config.get("peft_type") != "LORA":
        raise GraftError(f"{where}: peft_type is {config.get('peft_type')!r}; only LoRA adapters graft "
                         "(LoHa, LoKr, IA³, prompt tuning... are not supported: merge them with PEFT first)")
    for field, what in REFUSED_FIELDS.items():
        if not _is_off(config.get(field)):
            raise GraftError(f"{where}: {field} = {json.dumps(config[field])[:80]} ({what}) is not supported; "
                             "merge the adapter with PEFT's merge_and_unload() and graft the merged model instead")
    unknown = sorted(f for f in config if f not in HANDLED_FIELDS | IGNORED_FIELDS | set(REFUSED_FIELDS)
                     and not _is_off(config[f]))
    if unknown:
        raise GraftError(f"{where}: unknown field {unknown[0]} = {json.dumps(config[unknown[0]])[:80]}: this "
                         "graftmerge knows PEFT's LoRA fields up to 0.21 and cannot tell whether it changes Δ")
    if config.get("bias", "none") != "none":
        raise GraftError(f"{where}: bias = {config['bias']!r} is not supported (the adapter trains biases PEFT "
                         "saves apart from Δ = B·A); only bias: \"none\" grafts")
    init = config.get("init_lora_weights", True)
    if not isinstance(init, bool) and init not in PLAIN_INITS:
        raise GraftError(f"{where}: init_lora_weights = {config['init_lora_weights']!r} rewrites or replaces the "
                         "base weights (PiSSA, OLoRA, CorDA, LoftQ, MiCA...); convert the adapter to a plain LoRA "
                         "(save_pretrained(path_initial_model_for_weight_conversion=...)) or merge it first")
    _check_numbers(config, where)
    _check_layers(config, where)
    _check_patterns(config, where)


def _check_numbers(config: dict[str, Any], where: str) -> None:
    """r, lora_alpha, the patterns and the name lists have the types PEFT gives them."""
    def number(value, positive_int: bool = False) -> bool:
        """A JSON number (a positive integer when asked), not a bool."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if positive_int:
            return type(value) is int and value > 0
        try:
            return math.isfinite(value)
        except OverflowError:  # an integer past float's range: PEFT's scaling could not hold it
            return False

    if not number(config.get("r"), positive_int=True):
        raise GraftError(f"{where}: r must be a positive integer, got {config.get('r')!r}")
    if not number(config.get("lora_alpha")):
        raise GraftError(f"{where}: lora_alpha must be a number, got {config.get('lora_alpha')!r}")
    for field in ("use_rslora", "fan_in_fan_out"):
        if not isinstance(config.get(field, False), bool):
            raise GraftError(f"{where}: {field} must be true or false, got {config[field]!r}")
    for field, positive in (("rank_pattern", True), ("alpha_pattern", False)):
        pattern = config.get(field) or {}
        if not isinstance(pattern, dict) or not all(number(v, positive) for v in pattern.values()):
            raise GraftError(f"{where}: {field} must map module names to {'ranks' if positive else 'numbers'}")
    for field in ("modules_to_save", "target_modules", "exclude_modules"):
        names = config.get(field)
        if names is not None and not isinstance(names, str) and not (
                isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise GraftError(f"{where}: {field} must be a name, a list of names or null")
    if isinstance(config.get("modules_to_save"), str):
        raise GraftError(f"{where}: modules_to_save must be a list of names")


def _check_patterns(config: Mapping[str, Any], where: str) -> None:
    """Every regular expression of the config compiles for linear-time matching (before any name is matched).

    One line naming the field and the pattern for one Python refuses, and for one that
    could run unboundedly (backreferences, lookaround...): see :mod:`graftmerge.formats.bounded_regex`.
    """
    for field in ("rank_pattern", "alpha_pattern"):
        for key in config.get(field) or {}:
            check_pattern(_key_pattern(key), where, f"{field} key {key!r}")
    for field in ("target_modules", "exclude_modules"):
        names = config.get(field)
        if isinstance(names, str) and not (field == "target_modules" and names == "all-linear"):
            check_pattern(names, where, f"{field} {names!r}")
    layers = config.get("layers_pattern") or []
    for pattern in [layers] if isinstance(layers, str) else layers:
        check_pattern(_layer_pattern(pattern), where, f"layers_pattern {pattern!r}", captures=True)


def _key_pattern(key: str) -> str:
    """PEFT's regex for a rank_pattern / alpha_pattern key: the key ends the name at a dot."""
    return rf"(.*\.)?({key})$"


def _layer_pattern(pattern: str) -> str:
    """PEFT's regex for a layers_pattern entry: the first ``<pattern>.<index>.`` that starts a name part."""
    return rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\."


def pattern_key(patterns: Mapping[str, Any], module: str, where: str, field: str = "rank_pattern") -> str | None:
    """PEFT's ``get_pattern_key``: the first key that matches the end of ``module`` at a dot, else None.

    Matched in time linear in the name (:mod:`graftmerge.formats.bounded_regex`).
    """
    for key in patterns:
        if pattern_matches_start(_key_pattern(key), module, where, f"{field} key {key!r}"):
            return key
    return None


def module_rank_alpha(config: Mapping[str, Any], module: str, where: str) -> tuple[int, float]:
    """(r, lora_alpha) of ``module``: the config's, or those of its rank_pattern / alpha_pattern key."""
    ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    rank_key = pattern_key(ranks, module, where, "rank_pattern")
    alpha_key = pattern_key(alphas, module, where, "alpha_pattern")
    return (ranks[rank_key] if rank_key is not None else config["r"],
            alphas[alpha_key] if alpha_key is not None else config["lora_alpha"])


def scaling_of(config: Mapping[str, Any], module: str, where: str) -> float:
    """PEFT's scaling of ``module``: ``lora_alpha / r``, or ``lora_alpha / √r`` with use_rslora."""
    rank, alpha = module_rank_alpha(config, module, where)
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _names_match(names: str | list[str] | None, module: str, where: str, field: str) -> bool:
    """PEFT's target_modules / exclude_modules rule: a regex matched whole, or a name equal to or ending the module."""
    if names is None:
        return False
    if isinstance(names, str):
        return pattern_fullmatch(names, module, where, f"{field} {names!r}")
    return module in names or any(module.endswith(f".{name}") for name in names)


def _check_layers(config: Mapping[str, Any], where: str) -> None:
    """layers_to_transform / layers_pattern have PEFT's types, in the combinations PEFT's LoraConfig accepts."""
    indexes, patterns = config.get("layers_to_transform"), config.get("layers_pattern")
    index = lambda value: type(value) is int  # noqa: E731 - a JSON integer, not a bool
    if indexes is not None and not index(indexes) and not (
            isinstance(indexes, list) and all(index(i) for i in indexes)):
        raise GraftError(f"{where}: layers_to_transform must be a layer index or a list of layer indices, "
                         f"got {json.dumps(indexes)[:80]}")
    if patterns is not None and not isinstance(patterns, str) and not (
            isinstance(patterns, list) and all(isinstance(p, str) for p in patterns)):
        raise GraftError(f"{where}: layers_pattern must be a name, a list of names or null, got "
                         f"{json.dumps(patterns)[:80]}")
    if patterns and indexes is None:
        raise GraftError(f"{where}: layers_pattern is set without layers_to_transform; PEFT refuses that config")
    targets = config.get("target_modules")
    if isinstance(targets, str) and (indexes is not None or patterns is not None):
        raise GraftError(f"{where}: layers_to_transform / layers_pattern with target_modules a string (a regular "
                         "expression, or all-linear); PEFT refuses that config")


def layer_index(config: Mapping[str, Any], module: str, where: str) -> int | None:
    """The layer index PEFT reads from a module's name for ``layers_to_transform``, or None (no index found).

    The index is a name part made of digits, never the last part. With ``layers_pattern``
    (a name or names, regular expressions; the first that matches wins): the part right after
    the first ``<pattern>`` that starts a name part; without: the first such part from the
    third part on (``model.layers.3.self_attn.q_proj`` → 3; ``layers.3.mlp`` has none).
    """
    patterns = config.get("layers_pattern")
    if not patterns:
        found = re.match(r".*?\.[^.]*\.(?P<index>\d+)\.", module)
        return int(found["index"]) if found else None
    for pattern in [patterns] if isinstance(patterns, str) else patterns:
        found = pattern_match(_layer_pattern(pattern), module, where, f"layers_pattern {pattern!r}")
        if found is not None:  # PEFT stops at the first pattern that matches, even one that captures no index
            return None if found.get("idx") is None else int(found["idx"])
    return None


def peft_adapts(config: Mapping[str, Any], module: str, where: str) -> bool:
    """Whether PEFT puts a LoRA layer on ``module`` (so loads its factors), modules_to_save aside.

    ``exclude_modules`` first; a regex ``target_modules`` matched whole; a module named in
    full in the list; else a list entry ending the name, and then, when
    ``layers_to_transform`` is set (an index, or a non-empty list), only modules whose
    :func:`layer_index` is one of those. ``target_modules`` null or ``all-linear`` stand
    for names PEFT derives from the model itself (null: by model type; all-linear, which
    PEFT allows without layers only): the layer rule applies to those names too.
    """
    if _names_match(config.get("exclude_modules"), module, where, "exclude_modules"):
        return False
    targets = config.get("target_modules")
    if isinstance(targets, str) and targets != "all-linear":
        return _names_match(targets, module, where, "target_modules")
    if isinstance(targets, list) and module in targets:
        return True
    if isinstance(targets, list) and not any(module.endswith(f".{name}") for name in targets):
        return False
    indexes = config.get("layers_to_transform")
    if indexes is None or indexes == []:
        return True
    index = layer_index(config, module, where)
    return index is not None and (index == indexes if isinstance(indexes, int) else index in indexes)


def _under_modules_to_save(config: Mapping[str, Any], name: str) -> bool:
    """Whether ``name`` (a module or parameter) lies in a module PEFT saves whole (``modules_to_save``)."""
    modules = config.get("modules_to_save") or []
    parts = name.split(".")
    ancestors = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(a.endswith(m) for a in ancestors for m in modules)


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
        elif _under_modules_to_save(config, name):
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
    if _under_modules_to_save(config, module):
        raise GraftError(f"{where}: module {module!r} has LoRA factors but is in modules_to_save; PEFT would not "
                         "load them")
    if not peft_adapts(config, module, where):
        raise GraftError(f"{where}: module {module!r} has LoRA factors but target_modules / exclude_modules / "
                         "layers_to_transform leave it out; PEFT would not load them")
    return LoraModule(module=module, a_key=sides["A"], b_key=sides["B"], embedding=is_embedding, rank=rank,
                      scaling=scaling_of(config, module, where), in_features=a[1], out_features=b[0])


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
        in the name's length (80,000 characters of ``ForA`` take half a minute).
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
