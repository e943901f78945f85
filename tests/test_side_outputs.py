"""Side outputs (``--json``, ``--plot``, ``--save-rollouts``) are held to OUT's rule: never an input.

Every file a command writes beside its main output goes through one check
(``formats.output_folder.check_not_inputs``, via ``formats.output_file``): it may not be an
input, lie inside one (a model folder, a Fisher cache, a delta), or lie inside the folder
the command replaces. Each case is one ``error:`` line before any work, with every input
byte for byte as it was and nothing written. Controls: a path outside every input is
written whole, a link at the path is replaced (never written through), a hard link to an
input's file elsewhere is replaced without touching the input, and a user's file named
like a temporary is never touched.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from graftmerge.errors import GraftError
from graftmerge.estimate.rollouts import write_rollouts
from graftmerge.formats.output_file import check_output_file, write_output_file
from tests.helpers.configs import graft_yaml
from tests.helpers.estimation import make_model, random_rollouts
from tests.helpers.models import tree_digest
from tests.helpers.runners import cli, error_line, one_line_error, run_cli
from tests.helpers.tiny_tokenizer import save_tiny_chat_model


@pytest.fixture(scope="module")
def world(tmp_path_factory, tied_models, tied_diag_cache) -> dict:
    root = tmp_path_factory.mktemp("side-outputs")
    model = save_tiny_chat_model(root / "chat", architecture="llama", seed=1)
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "facts.jsonl").write_text(json.dumps({"prompt": "Hi?", "answer": "Hello.", "split": "validation"}) + "\n")
    (tasks / "tasks.yml").write_text("tasks:\n  - name: facts\n    role: new\n    data: facts.jsonl\n    metric: nll\n")
    config = root / "graft.yml"
    config.write_text(graft_yaml(tied_models["post"], tied_models["donor"], [(tied_models["donor_ft"], 1.0)],
                                 fisher=tied_diag_cache, rho=0.01))
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Say something."}) + "\n")
    tiny = make_model(root / "tiny")
    return {"root": root, "chat": model, "tasks": tasks / "tasks.yml", "data": tasks / "facts.jsonl",
            "config": config, "prompts": prompts, "tiny": tiny, "models": tied_models, "fisher": tied_diag_cache}


def digests(world: dict) -> dict:
    folders = {"chat": world["chat"], "tasks": world["tasks"].parent, "tiny": world["tiny"],
               "fisher": world["fisher"], **world["models"]}
    files = {name: world[name].read_bytes() for name in ("config", "prompts")}
    return {**{name: tree_digest(folder) for name, folder in folders.items()}, **files}


def refused(world: dict, args: list[str], expected: str, written: Path) -> str:
    before = digests(world)
    existed = written.exists()
    line = one_line_error(cli(*args))
    assert expected in line, line
    assert digests(world) == before
    assert written.exists() == existed
    return line


EVAL_CASES = {
    "a model file": (lambda w: w["chat"] / "config.json", "is inside the model"),
    "a new file in the model": (lambda w: w["chat"] / "scores.json", "is inside the model"),
    "a model file spelt through ..": (lambda w: w["chat"] / ".." / "chat" / "config.json", "is inside the model"),
    "the tasks file": (lambda w: w["tasks"], "is the tasks file"),
    "a data file": (lambda w: w["data"], "is the data file of task facts"),
}


@pytest.mark.parametrize("case", sorted(EVAL_CASES))
def test_eval_json_is_never_an_input(world, case):
    target, expected = EVAL_CASES[case]
    path = target(world)
    refused(world, ["eval", world["chat"], "--tasks", world["tasks"], "--json", path, "--no-progress"],
            f"--json {path} {expected}", path)


def test_eval_json_through_a_link_into_the_model_is_refused(world, tmp_path):
    link = tmp_path / "scores.json"
    link.symlink_to(world["chat"] / "tokenizer_config.json")
    refused(world, ["eval", world["chat"], "--tasks", world["tasks"], "--json", link, "--no-progress"],
            "is inside the model", link)
    assert link.is_symlink()


ESTIMATE_CASES = {
    "the prompts file": (lambda w: w["prompts"], "is the prompts file"),
    "a model file": (lambda w: w["tiny"] / "config.json", "is inside the model"),
    "the model folder": (lambda w: w["tiny"], "is the model"),
    "inside the output folder": (lambda w: w["root"] / "fisher-out" / "rollouts.jsonl", "is inside the output folder"),
}


@pytest.mark.parametrize("case", sorted(ESTIMATE_CASES))
def test_save_rollouts_is_never_an_input_nor_inside_the_output(world, case):
    target, expected = ESTIMATE_CASES[case]
    path = target(world)
    refused(world, ["fisher", "estimate", world["tiny"], "-o", world["root"] / "fisher-out", "--prompts",
                    world["prompts"], "--save-rollouts", path, "--no-progress"], f"--save-rollouts {path} {expected}",
            path)
    assert not (world["root"] / "fisher-out").exists()


@pytest.mark.parametrize("command", ["plan", "suggest"])
@pytest.mark.parametrize("case", ["config", "post", "fisher"])
def test_plan_and_suggest_json_are_never_an_input(world, command, case):
    path = {"config": world["config"], "post": world["models"]["post"] / "report.json",
            "fisher": world["fisher"] / "report.json"}[case]
    expected = {"config": "is the config", "post": "is inside the post model", "fisher": "is inside the Fisher cache"}
    extra = ["--rho", "0.01"] if command == "plan" else []
    refused(world, [command, world["config"], *extra, "--json", path, "--no-progress"],
            f"--json {path} {expected[case]}", path)


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_delta_stats_outputs_are_never_an_input(world, option):
    path = world["fisher"] / "stats.out"
    refused(world, ["delta", "stats", world["models"]["donor_ft"], "--fisher", world["fisher"], option, path],
            f"{option} {path} is inside the Fisher cache", path)


# -- controls -------------------------------------------------------------------------------------


def test_a_link_at_the_path_is_replaced_never_written_through(tmp_path):
    target = tmp_path / "someone-elses.json"
    target.write_text("theirs")
    link = tmp_path / "scores.json"
    link.symlink_to(target)
    write_output_file(link, b"{}", [], "--json")
    assert not link.is_symlink() and link.read_bytes() == b"{}" and target.read_text() == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scores.json", "someone-elses.json"]


def test_a_hard_link_to_an_input_file_elsewhere_is_replaced_without_touching_the_input(world, tmp_path):
    link = tmp_path / "scores.json"
    os.link(world["chat"] / "config.json", link)
    before = tree_digest(world["chat"])
    write_output_file(link, b"{}", [("model", world["chat"])], "--json")
    assert link.read_bytes() == b"{}" and tree_digest(world["chat"]) == before


def test_a_folder_is_no_file_name(tmp_path):
    with pytest.raises(GraftError, match="is a folder; give a file name"):
        check_output_file(tmp_path, [], "--json")


def test_writing_rollouts_never_touches_a_users_file_named_like_the_temporary(tmp_path):
    (tmp_path / "rollouts.jsonl.tmp").write_text("the user's")
    write_rollouts(tmp_path / "rollouts.jsonl", random_rollouts(3))
    assert (tmp_path / "rollouts.jsonl.tmp").read_text() == "the user's"
    assert len((tmp_path / "rollouts.jsonl").read_text().splitlines()) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rollouts.jsonl", "rollouts.jsonl.tmp"]


@pytest.mark.parametrize("script", ["mergekit-yaml", "graftmerge merge"])
def test_a_merge_never_replaces_the_folder_holding_its_config(world, tmp_path, script):
    """OUT may hold only files a merge writes, and a .yml is one: the config is an input all the same."""
    configs = tmp_path / "configs"
    configs.mkdir()
    config = configs / "graft.yml"
    config.write_text(world["config"].read_text())
    result = run_cli(*script.split(), str(config), str(configs))
    assert "contains the merge config" in error_line(result)
    assert os.listdir(configs) == ["graft.yml"] and config.read_text() == world["config"].read_text()


def test_the_demo_writes_only_into_a_new_or_empty_workdir(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "graft.yml").write_text("the user's config")
    assert "is not an empty folder" in one_line_error(cli("demo", "--workdir", work))
    assert os.listdir(work) == ["graft.yml"] and (work / "graft.yml").read_text() == "the user's config"


def test_mergekit_multi_never_fills_the_folder_holding_its_config(world, tmp_path):
    configs = tmp_path / "configs"
    configs.mkdir()
    config = configs / "multi.yml"
    config.write_text("name: first\n" + world["config"].read_text())
    result = run_cli("mergekit-multi", str(config), "--intermediate-dir", str(configs))
    assert "contains the merge config" in error_line(result)
    assert os.listdir(configs) == ["multi.yml"]
