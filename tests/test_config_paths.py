"""Configs graftmerge writes rerun from any working directory: local paths absolute, Hub ids as written.

A sweep run from one folder with a config of relative paths writes ``best/mergekit_config.yml``;
``mergekit-yaml`` run on it from an unrelated folder (holding decoys with the same relative
names) gives the same bits. The rewriting itself is checked on every place mergekit and
graftmerge read a path from.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import yaml
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions
from transformers import AutoModelForCausalLM

from graftmerge.adapter import import_hook
from graftmerge.demo.tiny_models import save_tiny_model
from graftmerge.formats.checkpoint import Checkpoint
from graftmerge.pipeline.config_files import read_graft_config
from graftmerge.pipeline.config_paths import anchored_config, anchored_reference
from graftmerge.pipeline.sweep_eval import Evaluation, Judge, run_sweep_eval
from tests.helpers.runners import forget_process_state, run_cli


def tensors(folder: Path) -> dict[str, bytes]:
    checkpoint = Checkpoint(folder)
    return {name: checkpoint.read(name).contiguous().view(torch.uint8).numpy().tobytes() for name in checkpoint.tensors}


def test_a_sweeps_best_config_reruns_from_another_directory_to_the_same_bits(tied_models, tied_diag_cache,
                                                                             tmp_path, monkeypatch):
    project = tmp_path / "project"
    inputs = {"post": tied_models["post"], "donor": tied_models["donor"], "donor_ft": tied_models["donor_ft"],
              "fisher": tied_diag_cache}
    for key, folder in inputs.items():  # copies under the project: relative names that stay inside tmp_path
        shutil.copytree(folder, project / "inputs" / key)
    relative = {key: f"inputs/{key}" for key in inputs}
    (project / "graft.yml").write_text(
        f"merge_method: graft\nbase_model: {relative['post']}\nmodels:\n"
        f"  - model: {relative['donor']}\n    parameters: {{role: donor}}\n"
        f"  - model: {relative['donor_ft']}\n    parameters: {{role: donor_ft}}\n"
        f"parameters:\n  rho: 0.0\n  fisher: {relative['fisher']}\n"
        "dtype: float32\nout_dtype: bfloat16\n")
    monkeypatch.chdir(project)
    import_hook.install()
    forget_process_state()
    config, source, plan = read_graft_config("graft.yml")
    judge = Judge(lambda: AutoModelForCausalLM.from_pretrained("inputs/post", dtype=torch.float32),
                  lambda model, splits: {"t": {split: 0.5 for split in splits}},
                  lambda scores, split: {"old": 1.0, "new": 1.0})
    run_sweep_eval(config, source, plan, [0.5], [0.05], "sweep", MergeOptions(quiet=True),
                   Evaluation((), "none", {}), lambda: judge, tolerance=0.1)
    forget_process_state()
    written = yaml.safe_load((project / "sweep" / "best" / "mergekit_config.yml").read_text())
    at = project.resolve() / "inputs"
    assert written["base_model"] == str(at / "post")
    assert [entry["model"] for entry in written["models"]] == [str(at / "donor"), str(at / "donor_ft")]
    assert written["parameters"] == {"rho": 0.05, "fisher": str(at / "fisher"), "lambda": 0.5}
    elsewhere = tmp_path / "elsewhere"
    for key in ("post", "donor", "donor_ft"):  # the same relative names lead to other models from here
        save_tiny_model(elsewhere / relative[key], seed=99, tie_word_embeddings=True)
    result = run_cli("mergekit-yaml", str(project / "sweep" / "best" / "mergekit_config.yml"), "rerun",
                     cwd=elsewhere)
    assert result.returncode == 0, result.stderr[-3000:]
    assert tensors(elsewhere / "rerun") == tensors(project / "sweep" / "best")


@pytest.fixture
def folders(tmp_path, monkeypatch) -> Path:
    for name in ("post", "ft", "adapter", "fisher-a", "fisher-b", "tok", "odd+name@x"):
        (tmp_path / name).mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_every_local_path_becomes_absolute_and_hub_ids_stay(folders):
    data = {
        "merge_method": "fisher",
        "base_model": "./post",
        "models": [{"model": "ft+adapter", "parameters": {"fisher": "fisher-a", "weight": 2}},
                   {"model": "org/name@v1", "parameters": {"fisher": "org/cache"}},
                   {"model": {"model": {"path": "ft"}, "override_architecture": "LlamaForCausalLM"},
                    "parameters": {"fisher": "fisher-b"}}],
        "parameters": {"model_config": "post", "epsilon": 1e-30},
        "tokenizer": {"source": "tok", "tokens": {"<a>": {"source": {"kind": "model_token", "model": "ft",
                                                                      "token_id": 1}},
                                                  "<b>": {"source": "post"}, "<c>": {"source": {"kind": "zero"}}}},
        "dtype": "float32",
    }
    anchored = anchored_config(data)
    at = str(Path.cwd())
    assert list(anchored) == list(data)  # nothing added, order kept
    assert anchored["base_model"] == f"{at}/post"
    assert anchored["models"] == [
        {"model": f"{at}/ft+{at}/adapter", "parameters": {"fisher": f"{at}/fisher-a", "weight": 2}},
        {"model": "org/name@v1", "parameters": {"fisher": "org/cache"}},
        {"model": {"model": {"path": f"{at}/ft"}, "override_architecture": "LlamaForCausalLM"},
         "parameters": {"fisher": f"{at}/fisher-b"}}]
    assert anchored["parameters"] == {"model_config": f"{at}/post", "epsilon": 1e-30}
    assert anchored["tokenizer"] == {"source": f"{at}/tok", "tokens": {
        "<a>": {"source": {"kind": "model_token", "model": f"{at}/ft", "token_id": 1}},
        "<b>": {"source": f"{at}/post"}, "<c>": {"source": {"kind": "zero"}}}}
    assert data["base_model"] == "./post"  # the input is not changed
    MergeConfiguration.model_validate(anchored)  # still a config mergekit reads


def test_trusted_inputs_are_anchored_as_the_inputs_they_name(folders):
    """``trust_remote_code`` names inputs as written (``./post``, ``ft+adapter``): they must still match."""
    data = {"merge_method": "graft", "base_model": "./post", "models": [{"model": "ft+adapter"}],
            "parameters": {"trust_remote_code": ["./post", "ft+adapter", "org/name"], "rho": 0}}
    anchored = anchored_config(data)
    at = str(Path.cwd())
    assert anchored["parameters"] == {"trust_remote_code": [f"{at}/post", f"{at}/ft+{at}/adapter", "org/name"],
                                      "rho": 0}
    assert anchored["models"][0]["model"] == anchored["parameters"]["trust_remote_code"][1]
    assert anchored_config({**data, "parameters": {"trust_remote_code": "post"}})["parameters"] == {
        "trust_remote_code": f"{at}/post"}


def test_slices_modules_and_tokenizer_source(folders):
    data = {"merge_method": "linear", "tokenizer_source": "union",
            "slices": [{"sources": [{"model": "post", "layer_range": [0, 2]}, {"model": "ft", "layer_range": [0, 2]}]}],
            "modules": {"text": {"slices": [{"sources": [{"model": "ft@main", "layer_range": [0, 1]}]}]}}}
    anchored = anchored_config(data)
    assert anchored["tokenizer_source"] == "union"
    assert [s["model"] for s in anchored["slices"][0]["sources"]] == [f"{folders}/post", f"{folders}/ft"]
    assert anchored["modules"] == {"text": {"slices": [{"sources": [{"model": f"{folders}/ft@main",
                                                                      "layer_range": [0, 1]}]}]}}
    assert anchored_config({"merge_method": "linear", "tokenizer_source": "tok"})["tokenizer_source"] == \
        f"{folders}/tok"


def test_a_path_that_would_not_parse_as_a_string_is_written_as_a_mapping(folders):
    """``odd+name@x`` exists here; as a string mergekit would split it into a model, a LoRA and a revision."""
    written = anchored_reference({"model": {"path": "odd+name@x"}})
    assert written == {"model": {"path": f"{folders}/odd+name@x"}}
    assert anchored_reference("post@main") == f"{folders}/post@main"
    assert anchored_reference("missing-folder") == "missing-folder"  # not local: mergekit would ask the Hub
