"""Load the post model and its tokenizer from a local folder, with one-line errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
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


def causal_lm_config(folder: str | Path):
    """The folder's transformers config; GraftError unless it describes a causal LM."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise GraftError(f"{folder} is not a Hugging Face model folder (no config.json)")
    try:
        config = AutoConfig.from_pretrained(folder)
    except (ValueError, OSError, KeyError) as error:
        raise GraftError(f"{folder}/config.json is not a transformers config ({error})") from error
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
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
):
    """A ``transformers`` causal LM in eval mode; GraftError if the folder is not one."""
    if dtype not in DTYPES:
        raise GraftError(f"unknown --dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    config = causal_lm_config(folder)
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            folder, config=config, dtype=DTYPES[dtype], attn_implementation=attn_implementation
        )
    except (ValueError, OSError, RuntimeError) as error:
        raise GraftError(
            f"cannot load {folder} as a causal LM: {str(error).splitlines()[0]}"
        ) from error
    finally:
        if not progress:
            hf_logging.enable_progress_bar()
    return model.to(device).eval()


def tokenizer_loader(folder: str | Path):
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
            loaded.append(AutoTokenizer.from_pretrained(folder))
        except (ValueError, OSError) as error:
            raise GraftError(
                f"cannot load the tokenizer of {folder}: {str(error).splitlines()[0]}"
            ) from error
        return loaded[0]

    return load
