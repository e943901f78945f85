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

:func:`open_lora_adapter` checks the config and the safetensors header (no model needed);
:func:`bind_adapter` checks that every target exists in a model with the right shape;
:class:`LoraDelta` (``role: delta``) and :class:`LoraFineTune` (``base+adapter``) present
the result as tensor sources keyed by the model's own parameter names.
"""

from __future__ import annotations

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
from graftmerge.formats.checkpoint import (
    SafetensorsLayout,
    TensorInfo,
    TensorSource,
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
})
# Fields with no effect on a trained adapter's Δ (training, loading or bookkeeping only).
IGNORED_FIELDS = frozenset({
    "task_type", "base_model_name_or_path", "revision", "inference_mode", "peft_version", "lora_dropout",
    "layers_to_transform", "layers_pattern", "megatron_core", "runtime_config", "qalora_group_size",
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
    """An opened adapter folder: its config and header, checked; tensors read on demand."""

    path: Path
    label: str
    config: dict[str, Any]
    layout: SafetensorsLayout
    modules: dict[str, LoraModule]  # by module name
    full: dict[str, str]  # the model's parameter name (as PEFT names it) -> key of a full saved tensor

    @property
    def file(self) -> Path:
        """The adapter's safetensors file."""
        return self.layout.file

    def read(self, key: str) -> torch.Tensor:
        """One stored tensor, in its stored dtype; GraftError if it holds NaN or Inf."""
        with safe_open(str(self.file), framework="pt") as handle:
            tensor = handle.get_tensor(key)
        if not bool(torch.isfinite(tensor).all()):
            raise GraftError(f"{self.file}: adapter tensor {key!r} contains NaN or Inf")
        return tensor

    def product(self, module: str, transposed: bool) -> torch.Tensor:
        """PEFT's delta weight of ``module`` in float32: ``(B @ A)`` (transposed when asked) ``* scaling``."""
        lora = self.modules[module]
        product = self.read(lora.b_key).float() @ self.read(lora.a_key).float()
        return (product.T if transposed else product) * lora.scaling

    def stamps(self) -> list[tuple[str, int, int, str]]:
        """(path, size, mtime_ns, content digest) of the config and the weights: identity for result caches."""
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
    modules, full = _classify_keys(config, layout, str(weights))
    return LoraAdapter(path=path, label=label, config=config, layout=layout, modules=modules, full=full)


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


def _check_numbers(config: dict[str, Any], where: str) -> None:
    """r, lora_alpha, the patterns and the name lists have the types PEFT gives them."""
    def number(value, positive_int: bool = False) -> bool:
        """A JSON number (a positive integer when asked), not a bool."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        return (type(value) is int and value > 0) if positive_int else math.isfinite(value)

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


def pattern_key(patterns: Mapping[str, Any], module: str, where: str) -> str | None:
    """PEFT's ``get_pattern_key``: the first key that matches the end of ``module`` at a dot, else None."""
    for key in patterns:
        try:
            if re.match(rf"(.*\.)?({key})$", module):
                return key
        except re.error as error:
            raise GraftError(f"{where}: pattern {key!r} is not a valid regular expression ({error})") from None
    return None


def module_rank_alpha(config: Mapping[str, Any], module: str, where: str) -> tuple[int, float]:
    """(r, lora_alpha) of ``module``: the config's, or those of its rank_pattern / alpha_pattern key."""
    ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    rank_key, alpha_key = pattern_key(ranks, module, where), pattern_key(alphas, module, where)
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
        try:
            return re.fullmatch(names, module) is not None
        except re.error as error:
            raise GraftError(f"{where}: {field} {names!r} is not a valid regular expression ({error})") from None
    return module in names or any(module.endswith(f".{name}") for name in names)


def _under_modules_to_save(config: Mapping[str, Any], name: str) -> bool:
    """Whether ``name`` (a module or parameter) lies in a module PEFT saves whole (``modules_to_save``)."""
    modules = config.get("modules_to_save") or []
    parts = name.split(".")
    ancestors = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(a.endswith(m) for a in ancestors for m in modules)


def _classify_keys(config: dict[str, Any], layout: SafetensorsLayout,
                   where: str) -> tuple[dict[str, LoraModule], dict[str, str]]:
    """Every key of the file: a LoRA factor, a full tensor PEFT loads over the base, or an error."""
    factors: dict[str, dict[str, str]] = {}
    embedding: dict[str, bool] = {}
    full: dict[str, str] = {}
    base_layers: set[str] = set()
    for key, info in sorted(layout.tensors.items()):
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
    modules = {m: _lora_module(config, m, sides, embedding[m], layout, where) for m, sides in sorted(factors.items())}
    for module in sorted(base_layers - set(modules)):
        raise GraftError(f"{where}: {module}.base_layer is saved, but {module!r} has no LoRA factors; PEFT would not "
                         "load it")
    if not modules and not full:
        raise GraftError(f"{where}: the adapter holds no tensors")
    return modules, full


def _lora_module(config: dict[str, Any], module: str, sides: dict[str, str], is_embedding: bool,
                 layout: SafetensorsLayout, where: str) -> LoraModule:
    """One module's factors, checked: both present, 2-D, ranks agreeing with each other and the config."""
    for side in "AB":
        if side not in sides:
            raise GraftError(f"{where}: module {module!r} has lora_{'B' if side == 'A' else 'A'} but no "
                             f"lora_{side}{'' if is_embedding else '.weight'}")
    a, b = layout.tensors[sides["A"]].shape, layout.tensors[sides["B"]].shape
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
    targets, excluded = config.get("target_modules"), config.get("exclude_modules")
    if (targets not in (None, "all-linear") and not _names_match(targets, module, where, "target_modules")) \
            or _names_match(excluded, module, where, "exclude_modules"):
        raise GraftError(f"{where}: module {module!r} has LoRA factors but target_modules / exclude_modules "
                         "leave it out; PEFT would not load them")
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
        """``Qwen3ForCausalLM`` / ``Qwen3Model`` -> ``Qwen3``; ``GPT2LMHeadModel`` -> ``GPT2``."""
        return re.sub(r"(For[A-Z]\w*|LMHeadModel|PreTrainedModel|Model)$", "", name)

    if family(recorded) not in {family(str(a)) for a in architectures}:
        raise GraftError(f"{adapter.label} was trained on a {recorded}, but {model_label} is a "
                         f"{', '.join(map(str, architectures))}: an adapter for another architecture")


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
        if name is None or tensors[name].shape != adapter.layout.tensors[key].shape:
            found = "does not have it" if name is None else f"has it as {'×'.join(map(str, tensors[name].shape))}"
            raise GraftError(f"{adapter.label} stores {parameter} as "
                             f"{'×'.join(map(str, adapter.layout.tensors[key].shape))}, but {model_label} {found}")
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
