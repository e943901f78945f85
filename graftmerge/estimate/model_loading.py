"""Load the post model and its tokenizer from a local folder, with one-line errors.

Every transformers load passes ``trust_remote_code`` explicitly (False unless the user
passed ``--trust-remote-code``), so transformers never asks on the terminal whether to
run a folder's own code: a folder that needs it is refused in one line instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.utils import logging as hf_logging

from graftmerge.errors import GraftError

DTYPES = {
    "auto": "auto",
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# What a model folder's own code can fail with when --trust-remote-code runs it.
LOAD_ERRORS = (ValueError, OSError, KeyError, ImportError, SyntaxError, AttributeError, TypeError)
TRUST_HINT = (
    "graftmerge runs a model folder's own code only if you pass --trust-remote-code "
    "(do so only for a model you trust)"
)


def _first_line(error: BaseException) -> str:
    """An exception's message as one line (transformers' are often paragraphs)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def _config_dict(folder: Path) -> dict[str, Any]:
    """config.json as a dict; GraftError if it is not a JSON object."""
    try:
        config = json.loads((folder / "config.json").read_bytes())
    except (OSError, ValueError, RecursionError, MemoryError) as error:  # ValueError: bad JSON, a too-long integer
        raise GraftError(f"{folder}/config.json is not a transformers config ({_first_line(error)})") from error
    if not isinstance(config, dict):
        raise GraftError(f"{folder}/config.json is not a transformers config (not a JSON object)")
    return config


def check_remote_code(folder: str | Path, trust_remote_code: bool = False) -> dict[str, Any]:
    """config.json of ``folder``; GraftError if loading it would run the folder's own code and that is not trusted.

    transformers needs a folder's code when ``model_type`` is not one it ships and
    ``auto_map`` names classes to import instead; a known ``model_type`` loads with
    transformers' own classes and ``auto_map`` is ignored.
    """
    folder = Path(folder)
    config = _config_dict(folder)
    auto_map = config.get("auto_map")
    model_type = config.get("model_type")
    if trust_remote_code or not auto_map or (isinstance(model_type, str) and model_type in CONFIG_MAPPING):
        return config
    named = ", ".join(sorted(map(str, auto_map)) if isinstance(auto_map, dict) else [str(auto_map)])
    raise GraftError(
        f"{folder} needs its own code to load (config.json's auto_map names {named}; model_type "
        f"{model_type!r} is not built into transformers); {TRUST_HINT}"
    )


def causal_lm_config(folder: str | Path, *, trust_remote_code: bool = False):
    """The folder's transformers config; GraftError unless it describes a causal LM.

    Never prompts: without ``trust_remote_code`` a config that needs the folder's own
    code is refused before transformers sees it.
    """
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise GraftError(f"{folder} is not a Hugging Face model folder (no config.json)")
    raw = check_remote_code(folder, trust_remote_code)
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except LOAD_ERRORS as error:
        raise GraftError(f"{folder}/config.json is not a transformers config ({_first_line(error)})") from error
    auto_map = raw.get("auto_map")
    custom_causal_lm = trust_remote_code and isinstance(auto_map, dict) and "AutoModelForCausalLM" in auto_map
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not custom_causal_lm:
        raise GraftError(
            f"{folder} is not a causal language model (model_type {config.model_type!r})"
        )
    return config


def load_causal_lm(
    folder: str | Path,
    *,
    dtype: str = "auto",
    device: torch.device | str = "cpu",
    attn_implementation: str = "sdpa",
    progress: bool = True,
    trust_remote_code: bool = False,
):
    """A ``transformers`` causal LM in eval mode; GraftError if the folder is not one."""
    if dtype not in DTYPES:
        raise GraftError(f"unknown --dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    config = causal_lm_config(folder, trust_remote_code=trust_remote_code)
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            folder, config=config, dtype=DTYPES[dtype], attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
        )
    except (*LOAD_ERRORS, RuntimeError) as error:
        raise GraftError(f"cannot load {folder} as a causal LM: {_first_line(error)}") from error
    finally:
        if not progress:
            hf_logging.enable_progress_bar()
    return model.to(device).eval()


def tokenizer_loader(folder: str | Path, *, trust_remote_code: bool = False):
    """A memoising callable returning the folder's tokenizer; it fails only when text needs one."""
    folder = Path(folder)
    loaded: list[Any] = []

    def load() -> Any:
        """The tokenizer, loaded on first call; GraftError if the folder has none."""
        if loaded:
            return loaded[0]
        if not any((folder / name).exists() for name in TOKENIZER_FILES):
            raise GraftError(
                f"{folder} has no tokenizer; text rollouts (prompt/completion, messages) need one, "
                "or pass pre-tokenised prompt_ids/completion_ids"
            )
        try:
            loaded.append(AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code))
        except LOAD_ERRORS as error:
            hint = f"; {TRUST_HINT}" if "trust_remote_code" in str(error) else ""
            raise GraftError(f"cannot load the tokenizer of {folder}: {_first_line(error)}{hint}") from error
        return loaded[0]

    return load
