"""Merge configs that graftmerge writes, with their local paths made absolute.

mergekit reads a model reference as a local path when that path exists from the current
directory, else as a Hugging Face Hub id; graftmerge reads ``fisher:`` and ``model_config:``
the same way. A config copied into an output folder (a sweep's ``best/mergekit_config.yml``)
with the paths as the user wrote them would rerun only from the directory the sweep ran
in. :func:`anchored_config` rewrites every path that exists locally as the absolute path
mergekit would have read, and leaves Hub ids and anything else as written.
"""

from __future__ import annotations

import os
from typing import Any

from mergekit.common import ModelPath, ModelReference

from graftmerge.pipeline.trusted_code import TRUST_PARAMETER

TOKENIZER_KEYWORDS = ("union", "base")  # tokenizer sources that name no model
PATH_PARAMETERS = ("fisher", "model_config")  # graft's and the data-aware methods' folders
# trust_remote_code names inputs as written in the config: anchored as those inputs are, so they still match


def anchored_path(path: str) -> str:
    """``path`` made absolute when it exists locally (as mergekit and graftmerge read it), else as written."""
    return os.path.abspath(path) if os.path.exists(path) else path


def _anchored_model_path(path: ModelPath) -> ModelPath:
    return ModelPath(path=anchored_path(path.path), revision=path.revision)


def _mapping(reference: ModelReference) -> dict:
    """The mapping form of a reference, which mergekit reads without splitting on ``+`` or ``@``."""

    def path(item: ModelPath) -> dict:
        return {"path": item.path, **({"revision": item.revision} if item.revision is not None else {})}

    result: dict[str, Any] = {"model": path(reference.model)}
    if reference.lora is not None:
        result["lora"] = path(reference.lora)
    if reference.override_architecture is not None:
        result["override_architecture"] = reference.override_architecture
    return result


def anchored_reference(value: Any) -> Any:
    """A model reference as written in YAML (``path``, ``path@rev``, ``base+adapter``, or its mapping), anchored.

    Written back as a string when the string form reads back the same, else as the mapping
    mergekit also accepts (an absolute path holding ``+`` or ``@`` would not parse as a string).
    """
    reference = ModelReference.model_validate(value)
    anchored = reference.model_copy(update={
        "model": _anchored_model_path(reference.model),
        "lora": _anchored_model_path(reference.lora) if reference.lora is not None else None,
    })
    if anchored == reference:
        return value
    text = str(anchored)
    if anchored.override_architecture is None and ModelReference.model_validate(text) == anchored:
        return text
    return _mapping(anchored)


def _anchored_label(name: Any) -> Any:
    """A ``trust_remote_code`` entry (an input as written in the config, or its folder), anchored as that input is."""
    if not isinstance(name, str):
        return name
    try:
        anchored = anchored_reference(name)
    except (ValueError, RuntimeError):  # not a reference mergekit would parse: at most a folder
        anchored = None
    return anchored if isinstance(anchored, str) else anchored_path(name)


def _anchored_parameters(parameters: Any) -> Any:
    if not isinstance(parameters, dict):
        return parameters
    result = {key: anchored_path(value) if key in PATH_PARAMETERS and isinstance(value, str) else value
              for key, value in parameters.items()}
    trusted = result.get(TRUST_PARAMETER)
    if trusted is not None:
        result[TRUST_PARAMETER] = ([_anchored_label(name) for name in trusted] if isinstance(trusted, list)
                                   else _anchored_label(trusted))
    return result


def _anchored_inputs(models: Any) -> Any:
    """``models:`` entries (or a slice's ``sources:``) with their model and path parameters anchored."""
    if not isinstance(models, list):
        return models
    return [{**entry, "model": anchored_reference(entry["model"]),
             **({"parameters": _anchored_parameters(entry["parameters"])} if "parameters" in entry else {})}
            if isinstance(entry, dict) and "model" in entry else entry
            for entry in models]


def _anchored_slices(slices: Any) -> Any:
    if not isinstance(slices, list):
        return slices
    return [{**item, "sources": _anchored_inputs(item["sources"])} if isinstance(item, dict) and "sources" in item
            else item for item in slices]


def _anchored_tokenizer_source(source: Any) -> Any:
    return source if source is None or source in TOKENIZER_KEYWORDS else anchored_reference(source)


def _anchored_tokenizer(tokenizer: Any) -> Any:
    """``tokenizer:``: its source, and each token's source model (a ``model_token`` mapping or a reference)."""
    if not isinstance(tokenizer, dict):
        return tokenizer
    result = dict(tokenizer)
    if "source" in result:
        result["source"] = _anchored_tokenizer_source(result["source"])
    tokens = result.get("tokens")
    if isinstance(tokens, dict):
        result["tokens"] = {name: _anchored_token(token) for name, token in tokens.items()}
    return result


def _anchored_token(token: Any) -> Any:
    source = token.get("source") if isinstance(token, dict) else None
    if source is None:
        return token
    if isinstance(source, dict) and "kind" in source:
        if "model" not in source:
            return token  # kind: zero
        return {**token, "source": {**source, "model": anchored_reference(source["model"])}}
    return {**token, "source": anchored_reference(source)}


def _anchored_module(module: Any) -> Any:
    if not isinstance(module, dict):
        return module
    result = dict(module)
    if "models" in result:
        result["models"] = _anchored_inputs(result["models"])
    if "slices" in result:
        result["slices"] = _anchored_slices(result["slices"])
    return result


def anchored_config(data: dict) -> dict:
    """A merge config's YAML data with every local path absolute: models, slices, modules, tokenizer, caches."""
    result = dict(data)
    if result.get("base_model") is not None:
        result["base_model"] = anchored_reference(result["base_model"])
    result["models"] = _anchored_inputs(result.get("models"))
    result["slices"] = _anchored_slices(result.get("slices"))
    if isinstance(result.get("modules"), dict):
        result["modules"] = {name: _anchored_module(module) for name, module in result["modules"].items()}
    result["tokenizer_source"] = _anchored_tokenizer_source(result.get("tokenizer_source"))
    result["tokenizer"] = _anchored_tokenizer(result.get("tokenizer"))
    result["parameters"] = _anchored_parameters(result.get("parameters"))
    return {key: value for key, value in result.items() if key in data or value is not None}
