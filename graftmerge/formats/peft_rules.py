"""PEFT's reading of a LoRA ``adapter_config.json``, reproduced: which fields it accepts, which modules it adapts, at what scaling.

- the fields: each one's effect on Δ is reproduced (``HANDLED_FIELDS``), has none on a
  trained adapter (``IGNORED_FIELDS``), or must be off (``REFUSED_FIELDS``): DoRA, a
  trained bias, initialisations that rewrite the base... (:func:`check_adapter_config`);
- the modules: :func:`peft_adapts` decides, exactly as PEFT matches them, whether a module
  carries factors (target_modules, exclude_modules, layers_to_transform / layers_pattern);
- the scaling: ``lora_alpha / r`` (``lora_alpha / √r`` with ``use_rslora``); r and alpha of
  a module come from ``rank_pattern`` / ``alpha_pattern`` when a key matches, by PEFT's
  rule (``(.*\\.)?(key)$`` on the module's name, first key in the file's order).

Every regular expression a config holds is matched in linear time
(:mod:`graftmerge.formats.bounded_regex`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from graftmerge.errors import GraftError
from graftmerge.formats.bounded_regex import (
    check_pattern,
    pattern_fullmatch,
    pattern_match,
    pattern_matches_start,
)

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


def _is_off(value: Any) -> bool:
    return value is None or value is False or value == {} or value == []


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


def under_modules_to_save(config: Mapping[str, Any], name: str) -> bool:
    """Whether ``name`` (a module or parameter) lies in a module PEFT saves whole (``modules_to_save``)."""
    modules = config.get("modules_to_save") or []
    parts = name.split(".")
    ancestors = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(a.endswith(m) for a in ancestors for m in modules)
