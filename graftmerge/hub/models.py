"""Hub-id models of a mergekit config, pointed at their local Hugging Face cache snapshots.

:func:`resolve_model_folder` gives any model reference's local folder: the path itself,
or its cached snapshot; :func:`model_hub_id` goes the other way, for model cards.

mergekit resolves ``org/name`` by listing the repo on the Hub, which fails offline even
when the checkpoint is cached; replacing each such reference by its snapshot folder
before ``run_merge`` makes every merge method work from the cache.
A snapshot is used only if every entry in it is its own (no link planted to lead out of
the repo's ``blobs/``), and a revision must be one that cannot climb out of ``refs/``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from huggingface_hub import constants, snapshot_download
from mergekit.common import ModelPath, ModelReference
from pydantic import BaseModel

from graftmerge.errors import GraftError
from graftmerge.hub.cache_layout import snapshot_origin
from graftmerge.hub.references import check_revision, hub_reference_or_none
from graftmerge.hub.untrusted import check_snapshot_tree

# What mergekit itself downloads for a model (config, tokenizer, weights).
MODEL_FILE_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model"]


def cached_model_folder(path: str, revision: str | None) -> str | None:
    """The local snapshot of Hub model ``path@revision``, or None if ``path`` is local or not cached.

    Offline with no cached copy is an error that says what to download.
    """
    if os.path.exists(path) or hub_reference_or_none(path) is None:
        return None
    if revision is not None:
        check_revision(revision, f"model {path}@{revision}")  # it becomes a path in the cache (refs/<revision>)
    try:
        folder = snapshot_download(path, revision=revision, local_files_only=True, allow_patterns=MODEL_FILE_PATTERNS)
    except Exception:  # noqa: BLE001 - any failure means "no usable copy in the local cache"
        if constants.is_offline_mode():
            shown = path if revision is None else f"{path} --revision {revision}"
            raise GraftError(
                f"model {path}{'@' + revision if revision else ''} is not a local folder and not in the local "
                f"Hugging Face cache, and the Hub is offline (HF_HUB_OFFLINE=1): download it first "
                f"(`hf download {shown}`), or write a local folder as ./{path}"
            ) from None
        return None  # online: mergekit downloads it
    # mergekit reads (and copies tokenizer files out of) this folder: no planted link may lead out of the repo
    return str(check_snapshot_tree(Path(folder), f"model {path}{'@' + revision if revision else ''}"))


def localize_models(config: Any) -> Any:
    """``config`` with every cached Hub-id ``ModelReference`` (models, LoRAs) replaced by its folder."""
    def path(model_path: ModelPath) -> ModelPath:
        """The cached snapshot folder in place of a Hub id; local or uncached paths unchanged."""
        folder = cached_model_folder(model_path.path, model_path.revision)
        return model_path if folder is None else ModelPath(path=folder)

    def walk(value: Any) -> Any:
        """``value`` rebuilt only where a reference changed, so untouched parts stay identical objects."""
        if isinstance(value, ModelReference):
            model, lora = path(value.model), None if value.lora is None else path(value.lora)
            if model is value.model and lora is value.lora:
                return value
            return value.model_copy(update={"model": model, "lora": lora})
        if isinstance(value, BaseModel):
            updates = {}
            for name in type(value).model_fields:
                old = getattr(value, name)
                new = walk(old)
                if new is not old:
                    updates[name] = new
            return value.model_copy(update=updates) if updates else value
        if isinstance(value, list):
            items = [walk(v) for v in value]
            return items if any(a is not b for a, b in zip(items, value)) else value
        if isinstance(value, dict):
            items = {k: walk(v) for k, v in value.items()}
            return items if any(items[k] is not value[k] for k in value) else value
        return value

    return walk(config)


def resolve_model_folder(path: str, revision: str | None = None) -> str:
    """A local folder for a model reference: the path itself, or its snapshot in the HF cache (links checked)."""
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise GraftError(f"model {path} is a file; give the model's folder")
    looks_local = path.startswith((".", "/", "~")) or path.count("/") != 1
    if not looks_local:
        folder = cached_model_folder(path, revision)  # revision and planted links checked; offline: says what to get
        if folder is not None:
            return folder
        raise GraftError(
            f"model {path} is not a local folder and not in the local Hugging Face cache "
            f"(download it first: `hf download {path}`)"
        )
    raise GraftError(f"model folder {path} does not exist")


def model_hub_id(path: str) -> str | None:
    """The Hub id a model reference stands for, for a card's ``base_model``: a local folder that is a
    cached snapshot (``.../models--org--name/snapshots/<sha>`` → ``org/name``), a Hub id as written
    (``org/name``, ``org/name@rev``, ``hf://...``); None for a plain local folder or anything else."""
    if os.path.exists(path):
        origin = snapshot_origin(path)
        return origin[0] if origin is not None else None
    try:
        reference = hub_reference_or_none(path)
    except GraftError:  # a malformed revision: not a Hub id this card can name
        return None
    return reference.repo_id if reference is not None else None
