"""Which inputs of a graft config may run their own code: none, unless the config's ``trust_remote_code`` names it.

mergekit's ``--trust-remote-code`` is one switch for every input; a graft config instead
lists the inputs whose config files may name code for transformers to import
(``auto_map``, ``custom_pipelines``), and any other input that names code is refused
before mergekit reads a config.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypeVar

from graftmerge.errors import GraftError
from graftmerge.hub.models import resolve_model_folder
from graftmerge.hub.untrusted import is_config_file, read_json_bytes, without_remote_code

TRUST_PARAMETER = "trust_remote_code"  # the inputs whose own code (config auto_map) may run
Plan = TypeVar("Plan")  # check_trusted_code hands back the plan it is given


def remote_code_fields(folder: str | os.PathLike) -> list[str]:
    """``"config.json: auto_map"``... for each config file at the top of ``folder`` that names code to import."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    found = []
    for name in names:
        path = Path(folder, name)
        if not is_config_file(name) or not path.is_file():
            continue
        try:
            _, removed = without_remote_code(read_json_bytes(path, str(path)), str(path))
        except GraftError:
            continue  # not a JSON object: transformers cannot read code names from it either
        found += [f"{name}: {field}" for field in removed]
    return found


def _config_inputs(config) -> list[tuple[str, str, str]]:
    """(input as written in the config, a folder of it, what it is) for every folder, base_model first.

    A ``BASE+ADAPTER`` reference has two folders, both listed under its label.
    """
    base = config.base_model.model
    inputs = [(str(config.base_model), resolve_model_folder(base.path, base.revision), "base_model, the post model")]
    for entry in config.models:
        role = f"role {(entry.parameters or {}).get('role')}"
        for part in (entry.model.model, entry.model.lora):
            if part is not None:
                inputs.append((str(entry.model), resolve_model_folder(part.path, part.revision), role))
    return inputs


def _trusted_inputs(config, inputs: list[tuple[str, str, str]]) -> set[str]:
    """The inputs the graft parameter ``trust_remote_code`` names (by path as written, or the same folder)."""
    value = dict(config.parameters or {}).get(TRUST_PARAMETER)
    if value is None:
        return set()
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(name, str) and name for name in names):
        raise GraftError(f"graft parameter {TRUST_PARAMETER} lists the inputs whose own code may run, by their path "
                         f"in this config (e.g. `{TRUST_PARAMETER}: [./post]`); got {value!r}")
    trusted = set()
    for name in names:
        same = [label for label, folder, _ in inputs if name == label
                or (os.path.isdir(name) and os.path.realpath(name) == os.path.realpath(folder))]
        if not same:
            raise GraftError(f"graft parameter {TRUST_PARAMETER} names {name!r}, which is not an input of this config "
                             f"(its inputs: {', '.join(dict.fromkeys(label for label, _, _ in inputs))})")
        trusted.update(same)
    return trusted


def check_trusted_code(config, plan: Plan) -> Plan:
    """``plan``, once no input names code to run (``auto_map``, ``custom_pipelines``) unless the config trusts it.

    mergekit's ``--trust-remote-code`` is one switch for every input: passed for your own
    post model, it would also run whatever code a donor or a delta (perhaps from the Hub)
    names. So a graft config lists the inputs whose code may run in the graft parameter
    ``trust_remote_code``; any other input whose config files name code is refused here,
    before mergekit reads a config.
    """
    inputs = _config_inputs(config)
    trusted = _trusted_inputs(config, inputs)
    for label, folder, what in inputs:
        fields = remote_code_fields(folder)
        if fields and label not in trusted:
            raise GraftError(
                f"model {label} ({what}): {', '.join(fields[:3])} names code for transformers to import, which "
                f"--trust-remote-code would run; add `{TRUST_PARAMETER}: [{label}]` under the graft's `parameters:` "
                "if you trust that model's code, or else remove the field from its config"
            )
    return plan
