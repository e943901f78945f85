"""What mergekit itself reads of a graft config's inputs, checked before the merge starts.

mergekit loads every model a config names through transformers' ``AutoConfig`` (the
folder's ``config.json``) and looks its architecture up in its own table; inputs of
different architectures are refused unless ``--allow-crimes`` is passed. Left to
mergekit, a folder without ``config.json`` (a delta extracted from a configless donor),
an unreadable one, or another architecture's fails with mergekit's traceback after the
output folder is locked and the threshold pass has run. Here each such folder is
checked first, in one line naming the input: the same folders mergekit will read (the
post model, the donor, every donor_ft, the BASE of ``BASE+ADAPTER``, every ``role:
delta`` folder; not a LoRA adapter given role delta, which mergekit reads through the
post model's config, see :mod:`graftmerge.pipeline.lora_inputs`), the same lookup
(mergekit's ``arch_info_for_config``), the same rule (one architecture unless crimes
are allowed).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mergekit.architecture import arch_info_for_config
from transformers import AutoConfig

from graftmerge.errors import GraftError
from graftmerge.formats.json_file import load_json_file
from graftmerge.formats.lora_adapter import is_lora_adapter
from graftmerge.hub.models import resolve_model_folder

CONFIG_NAME = "config.json"


@dataclass(frozen=True)
class LoadedInput:
    """One folder mergekit reads a config from: the input as written, what it is, and the architecture found."""

    label: str
    what: str
    folder: str
    architecture: str  # config.json's `architectures[0]`
    model_type: str
    arch_info: object | None  # mergekit's ModelArchitecture, None when mergekit has to infer it


def mergekit_model_folders(config) -> list[tuple[str, str, str, str | None]]:
    """(input as written, its folder, what it is, its ``override_architecture``) for each folder whose config.json
    mergekit reads; base_model first."""
    base = config.base_model
    folders = [(str(base), resolve_model_folder(base.model.path, base.model.revision), "base_model, the post model",
                base.override_architecture)]
    for entry in config.models:
        role = (entry.parameters or {}).get("role")
        folder = resolve_model_folder(entry.model.model.path, entry.model.model.revision)
        if role == "delta" and entry.model.lora is None and is_lora_adapter(folder):
            continue  # mergekit is handed POST+ADAPTER: it reads the post model's config
        what = f"role {role}" if entry.model.lora is None else f"role {role}; mergekit reads its base's config"
        folders.append((str(entry.model), folder, what, entry.model.override_architecture))
    return folders


def _first_line(error: BaseException) -> str:
    """An exception's message as one short line (transformers' are often paragraphs)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def read_input_architecture(label: str, folder: str, what: str, trust_remote_code: bool = False,
                            override: str | None = None) -> LoadedInput:
    """The architecture mergekit will find for ``folder`` (``override``: the reference's ``override_architecture``,
    which mergekit puts in place of the config's); GraftError if mergekit could not load its config."""
    file = Path(folder) / CONFIG_NAME
    if not file.is_file():
        raise GraftError(
            f"model {label} ({what}): {folder} has no {CONFIG_NAME}, which mergekit reads to learn each input's "
            f"architecture; copy the {CONFIG_NAME} of the model it was made from (for a delta: its donor's) into it"
        )
    config = load_json_file(file, CONFIG_NAME, duplicates_ok=True)  # size, nesting, integers past Python's limit
    architectures = config.get("architectures") if isinstance(config, dict) else None
    architectures = [override] if override else architectures
    if not isinstance(architectures, list) or len(architectures) != 1 or not isinstance(architectures[0], str):
        raise GraftError(
            f"model {label} ({what}): {file} must name exactly one architecture in `architectures` "
            f'(as transformers writes it, e.g. ["LlamaForCausalLM"]); mergekit cannot merge it otherwise'
        )
    try:
        loaded = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
        loaded.architectures = architectures
        arch_info = arch_info_for_config(loaded)
    except Exception as error:  # transformers' and mergekit's own errors: any of them stops mergekit's merge
        raise GraftError(f"model {label} ({what}): mergekit cannot load {file} ({_first_line(error)})") from error
    return LoadedInput(label, what, folder, architectures[0], str(getattr(loaded, "model_type", "")), arch_info)


def check_mergekit_inputs(config, allow_crimes: bool = False, trust_remote_code: bool = False) -> list[LoadedInput]:
    """Every folder of ``config`` that mergekit loads as a model: a readable config.json, and (unless
    ``allow_crimes``, mergekit's ``--allow-crimes``) the architecture of ``base_model``, as mergekit compares them.

    Inputs whose architecture mergekit does not know are left to mergekit, which infers one from the tensors.
    """
    loaded = [read_input_architecture(label, folder, what, trust_remote_code, override)
              for label, folder, what, override in mergekit_model_folders(config)]
    post = loaded[0]
    for other in loaded[1:]:
        known = post.arch_info is not None and other.arch_info is not None
        if known and other.arch_info != post.arch_info and not allow_crimes:
            raise GraftError(
                f"model {other.label} ({other.what}) is a {other.architecture} ({other.model_type}) by its "
                f"{CONFIG_NAME}, but the post model {post.label} is a {post.architecture} ({post.model_type}); mergekit "
                "merges one architecture: give that input the post model's architecture, or pass --allow-crimes "
                "if you mean to mix them"
            )
    return loaded


@contextlib.contextmanager
def post_architecture(loaded: list[LoadedInput]) -> Iterator[None]:
    """While the block runs, mergekit's merge takes the post model's architecture when crimes mix several.

    With ``--allow-crimes`` and inputs of known, different architectures, mergekit 0.1.5
    uses the architecture of whichever input comes first in an unordered set: a run may
    plan the post model's tensor names or the foreign input's, by chance. A graft's
    inputs all hold the post model's tensors (names and shapes are checked), so the post
    model's architecture is the one that fits; nothing changes when the inputs agree.
    """
    infos = [item.arch_info for item in loaded]
    merge_module = sys.modules.get("mergekit.merge")  # imported by whoever calls run_merge (not here: the hook)
    if merge_module is None or any(info is None for info in infos) or all(info == infos[0] for info in infos):
        yield
        return
    original = merge_module.get_architecture_info
    merge_module.get_architecture_info = lambda config, options: infos[0]
    try:
        yield
    finally:
        merge_module.get_architecture_info = original
