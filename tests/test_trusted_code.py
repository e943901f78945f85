"""An input's own code runs only if the graft config trusts that input.

mergekit's ``--trust-remote-code`` is one switch for every input. A graft config is
refused (before mergekit reads any config) when an input's config files name code for
transformers to import (``auto_map``, ``custom_pipelines``) and the graft parameter
``trust_remote_code`` does not list that input. Delta folders never carry such fields.
Plus the real thing: ``mergekit-yaml --trust-remote-code`` in a process of its own,
with a donor whose planted module would write a marker file when imported.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from graftmerge.pipeline.delta_extract import extract_delta
from tests.helpers.configs import graft_yaml
from tests.helpers.models import copy_model, tree_digest
from tests.helpers.runners import run_cli, run_process

EVIL_MODULE = '''
from pathlib import Path
Path({marker!r}).write_text("the donor's code ran")
from transformers import Qwen3Config
class EvilConfig(Qwen3Config):
    pass
'''


def plant(folder: Path, file: str = "config.json", **fields) -> Path:
    """``fields`` added to ``folder/file`` (a JSON object), and a module that leaves a marker when imported."""
    path = folder / file
    config = json.loads(path.read_text()) if path.exists() else {}
    config.update(fields)
    path.write_text(json.dumps(config, indent=2))
    (folder / "evil.py").write_text(EVIL_MODULE.format(marker=str(folder / "MARKER")))
    return folder


AUTO_MAP = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}


def merge(tmp_path: Path, post, donor, fine_tunes, extra_global: str = "", models: str = "") -> tuple:
    """Run a graft config through the stock mergekit-yaml (in process); (result, output folder)."""
    config = graft_yaml(post, donor, fine_tunes, extra_global=extra_global)
    if models:
        config = config.replace("parameters:\n  lambda", f"{models}parameters:\n  lambda", 1)
    (tmp_path / "graft.yml").write_text(config)
    out = tmp_path / "merged"
    return run_cli("mergekit-yaml", str(tmp_path / "graft.yml"), str(out)), out


def one_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.stderr, lines
    return lines[0]


@pytest.mark.parametrize("role", ["donor", "donor_ft"])
def test_an_untrusted_input_that_names_code_is_refused(tmp_path, tied_models, role):
    inputs = {r: copy_model(tied_models[r], tmp_path / r) for r in ("post", "donor", "donor_ft")}
    if role == "donor":
        plant(inputs["donor"], auto_map=AUTO_MAP)
    else:
        plant(inputs["donor_ft"], custom_pipelines={"text-generation": {"impl": "evil.Pipeline"}})
    before = {r: tree_digest(folder) for r, folder in inputs.items()}
    result, out = merge(tmp_path, inputs["post"], inputs["donor"], [(inputs["donor_ft"], 1.0)])
    line = one_line(result)
    assert f"model {inputs[role]} (role {role})" in line, line
    assert f"trust_remote_code: [{inputs[role]}]" in line, line
    assert ("auto_map" if role == "donor" else "custom_pipelines") in line
    assert {r: tree_digest(folder) for r, folder in inputs.items()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["donor", "donor_ft", "graft.yml", "post"]  # no output
    assert not (inputs[role] / "MARKER").exists()


def test_a_tokenizer_config_naming_code_is_refused_too(tmp_path, tied_models):
    inputs = {r: copy_model(tied_models[r], tmp_path / r) for r in ("post", "donor", "donor_ft")}
    plant(inputs["post"], "tokenizer_config.json", auto_map={"AutoTokenizer": ["evil.EvilTokenizer", None]})
    result, _ = merge(tmp_path, inputs["post"], inputs["donor"], [(inputs["donor_ft"], 1.0)])
    line = one_line(result)
    assert f"model {inputs['post']} (base_model, the post model)" in line and "tokenizer_config.json: auto_map" in line


def test_a_delta_naming_code_is_refused_and_extract_writes_none(tmp_path, tied_models):
    donor = plant(copy_model(tied_models["donor"], tmp_path / "donor"), auto_map=AUTO_MAP,
                  custom_pipelines={"text-generation": {"impl": "evil.Pipeline"}})
    delta = extract_delta(donor, tied_models["donor_ft"], tmp_path / "delta", progress=False)
    written = json.loads((delta / "config.json").read_text())
    original = json.loads((donor / "config.json").read_text())
    assert "auto_map" not in written and "custom_pipelines" not in written
    assert written == {k: v for k, v in original.items() if k not in ("auto_map", "custom_pipelines")}
    assert not (delta / "evil.py").exists()
    # a delta handed over with the fields put back (by hand, or by another tool) is refused
    plant(delta, auto_map=AUTO_MAP)
    config = (f"merge_method: graft\nbase_model: {tied_models['post']}\nmodels:\n"
              f"  - model: {delta}\n    parameters: {{role: delta}}\ndtype: float32\n")
    (tmp_path / "graft.yml").write_text(config)
    line = one_line(run_cli("mergekit-yaml", str(tmp_path / "graft.yml"), str(tmp_path / "merged")))
    assert f"model {delta} (role delta)" in line and "auto_map" in line


def test_a_trusted_input_merges_like_one_without_the_fields(tmp_path, tied_models):
    post = plant(copy_model(tied_models["post"], tmp_path / "post"), auto_map=AUTO_MAP)
    result, out = merge(tmp_path, post, tied_models["donor"], [(tied_models["donor_ft"], 1.0)],
                        extra_global=f"  trust_remote_code: [{post}]\n")
    assert result.returncode == 0, result.stderr[-3000:]
    (tmp_path / "plain").mkdir()
    reference, reference_out = merge(tmp_path / "plain", tied_models["post"], tied_models["donor"],
                                     [(tied_models["donor_ft"], 1.0)])
    assert reference.returncode == 0, reference.stderr[-3000:]
    shards = sorted(p.name for p in reference_out.glob("*.safetensors"))
    assert shards and shards == sorted(p.name for p in out.glob("*.safetensors"))
    for name in shards:
        assert (out / name).read_bytes() == (reference_out / name).read_bytes()
    assert not (post / "MARKER").exists()  # trusted, but mergekit ran without --trust-remote-code


@pytest.mark.parametrize("value, phrase", [
    ("true", "lists the inputs whose own code may run"),
    ("[./somewhere-else]", "names './somewhere-else', which is not an input of this config"),
])
def test_trust_remote_code_must_name_inputs(tmp_path, tied_models, value, phrase):
    result, _ = merge(tmp_path, tied_models["post"], tied_models["donor"], [(tied_models["donor_ft"], 1.0)],
                      extra_global=f"  trust_remote_code: {value}\n")
    assert phrase in one_line(result)


def test_real_mergekit_yaml_with_trust_remote_code_does_not_run_a_donors_code(tmp_path, tied_models):
    post = copy_model(tied_models["post"], tmp_path / "post")
    donor = plant(copy_model(tied_models["donor"], tmp_path / "donor"), auto_map=AUTO_MAP)
    modules = {"HF_MODULES_CACHE": str(tmp_path / "hf-modules")}  # where transformers copies a folder's code
    config = graft_yaml(post, donor, [(tied_models["donor_ft"], 1.0)])
    (tmp_path / "graft.yml").write_text(config.replace("  lambda:", f"  trust_remote_code: [{post}]\n  lambda:"))
    result = run_process("mergekit-yaml", str(tmp_path / "graft.yml"), str(tmp_path / "merged"),
                         "--trust-remote-code", timeout=300, env=modules)
    line = one_line(result)
    assert f"model {donor} (role donor)" in line and "auto_map" in line, line
    assert not any(tmp_path.rglob("MARKER")) and not (tmp_path / "merged").exists()
    # the planted module is real: once the config trusts the donor too, mergekit imports it
    (tmp_path / "graft.yml").write_text(
        config.replace("  lambda:", f"  trust_remote_code: [{post}, {donor}]\n  lambda:")
    )
    run_process("mergekit-yaml", str(tmp_path / "graft.yml"), str(tmp_path / "trusted"), "--trust-remote-code",
                timeout=300, env=modules)
    assert (donor / "MARKER").read_text() == "the donor's code ran"
