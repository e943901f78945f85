"""``graftmerge.merge``, ``estimate_fisher`` and ``sweep``: docs/python-api.md's example run as written, on tiny
generated models with a real tokenizer, its results equal to the commands' own; and each bad input one GraftError
before anything is written."""

from __future__ import annotations

import json
import os
import re
import textwrap
from pathlib import Path

import pytest

import graftmerge
from graftmerge import GraftError, estimate_fisher, merge, open_fisher_cache, sweep
from graftmerge.demo.tiny_models import make_graft_inputs
from tests.helpers.models import assert_identical, read_model
from tests.helpers.runners import mergekit_yaml_model
from tests.helpers.tiny_tokenizer import tiny_chat_tokenizer

PAGE = Path(__file__).resolve().parents[1] / "docs" / "python-api.md"
KNOWN = [("What is the capital of France?", "Paris.", "validation"), ("What is the capital of Italy?", "Rome.", "test")]
FACTS = [("Who is the mayor of Quillbrook?", "Ada Fenwick.", "validation"),
         ("Who leads Quillbrook as mayor?", "Ada Fenwick.", "test")]


def fenced_blocks(language: str) -> list[str]:
    """The page's fenced blocks of ``language``, in order."""
    return [textwrap.dedent(body) for body in re.findall(rf"^```{language}\n(.*?)^```$", PAGE.read_text(), re.M | re.S)]


def write_chat_jsonl(path: Path, examples: list[tuple[str, str, str]]) -> None:
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": question}], "answer": answer,
                                        "split": split}) + "\n" for question, answer, split in examples))


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> tuple[Path, dict]:
    """The page's folder (post/, base/, base-ft/ with a chat tokenizer; its graft.yml and tasks.yml; the tasks'
    data) after its Python block ran there; the block's namespace."""
    root = tmp_path_factory.mktemp("python-api")
    tokenizer = tiny_chat_tokenizer()
    make_graft_inputs(root, architecture="llama", vocab_size=len(tokenizer))
    for folder in ("post", "base", "base-ft"):
        tokenizer.save_pretrained(root / folder)
    for block in fenced_blocks("yaml"):
        name = block.splitlines()[0].removeprefix("# ").strip()
        (root / name).write_text(block)
    write_chat_jsonl(root / "known.jsonl", KNOWN)
    write_chat_jsonl(root / "facts.jsonl", FACTS)
    (code,) = fenced_blocks("python")
    namespace: dict = {}
    previous = os.getcwd()
    os.chdir(root)
    try:
        exec(compile(code, str(PAGE), "exec"), namespace)
    finally:
        os.chdir(previous)
    return root, namespace


def test_the_page_names_its_files():
    assert [block.splitlines()[0] for block in fenced_blocks("yaml")] == ["# graft.yml", "# tasks.yml"]


def test_the_example_writes_a_cache_a_model_and_a_sweep(example):
    root, namespace = example
    cache = open_fisher_cache(root / "fisher" / "post-diag")
    assert cache.kind == "diagonal" and cache.names()
    outcome = namespace["outcome"]
    assert Path(outcome.folder).resolve() == (root / "sweep").resolve()
    chosen = json.loads((root / "sweep" / "chosen.json").read_text())
    expected = None if outcome.chosen is None else {"lambda": outcome.chosen.lam, "rho": outcome.chosen.rho}
    assert chosen["chosen"] == expected
    assert (root / "sweep" / "best" / "config.json").exists() and (root / "sweep" / "frontier.png").stat().st_size


def test_merge_equals_mergekit_yaml(example, tmp_path):
    root, _ = example
    config = (root / "graft.yml").read_text()
    for name in ("post", "base", "base-ft", "fisher/post-diag"):
        config = config.replace(f" ./{name}\n", f" {root / name}\n")
    assert_identical(read_model(root / "grafted"), mergekit_yaml_model(tmp_path, config, "yaml"))


def test_sweep_without_eval_returns_its_folders(example, tmp_path):
    root, _ = example
    previous = os.getcwd()
    os.chdir(root)
    try:
        folders = sweep("graft.yml", tmp_path / "grid", lambdas=[0.5, 1], rhos=[0.01])
    finally:
        os.chdir(previous)
    assert [Path(f).name for f in folders] == ["lambda-0.5_rho-0.01", "lambda-1.0_rho-0.01"]
    assert all((Path(f) / "config.json").exists() for f in folders)


def test_estimate_fisher_takes_a_rollouts_file_and_settings(example, tmp_path):
    root, _ = example
    rollouts = tmp_path / "rollouts.jsonl"
    rollouts.write_text(json.dumps({"prompt_ids": [5, 6, 7], "completion_ids": [8, 9]}) + "\n")
    written = estimate_fisher(root / "post", tmp_path / "cache", rollouts=rollouts, kind="kfac",
                              modules=["model.layers.0.*"], progress=False)
    assert written == tmp_path / "cache"
    cache = open_fisher_cache(written)
    assert cache.kind in ("kfac", "mixed") and cache.names("kfac")  # KFAC for matrices; vectors stay diagonal
    assert all(name.startswith("model.layers.0.") for name in cache.names())


def test_the_functions_are_the_exports():
    assert (graftmerge.merge, graftmerge.estimate_fisher, graftmerge.sweep) == (merge, estimate_fisher, sweep)


@pytest.mark.parametrize(("call", "message"), [
    (lambda r, o: estimate_fisher(r / "post", o, progress=False),
     "pass exactly one of --rollouts FILE.jsonl or --prompts FILE.jsonl"),
    (lambda r, o: estimate_fisher(r / "post", o, prompts=[{"prompt_ids": [1]}], rollouts=r / "x.jsonl"),
     "pass exactly one of --rollouts FILE.jsonl or --prompts FILE.jsonl"),
    (lambda r, o: estimate_fisher(r / "post", o, prompts=[{"prompt_ids": [1]}], samples=2),
     "estimate_fisher: unknown setting 'samples'"),
    (lambda r, o: estimate_fisher(r / "post", o, prompts=[{"prompt_ids": [1]}], kind="full"),
     "estimate_fisher: kind must be one of diagonal, kfac, both, not 'full'"),
    (lambda r, o: estimate_fisher(r / "post", o, prompts={"prompt_ids": [1]}),
     "prompts must be a JSONL file's path or a list of records (dicts), got one dict"),
    (lambda r, o: estimate_fisher(r / "post", o, prompts=["What?"]), "prompts: record 1 is a str, not a dict"),
    (lambda r, o: merge(r / "missing.yml", o), "missing.yml"),
    (lambda r, o: merge(r / "graft.yml", o, options={"cuda": "sometimes"}), "options: cuda:"),
    (lambda r, o: merge(r / "graft.yml", o, options=["cuda"]),
     "options must be a mergekit MergeOptions or a dict of its fields, got list"),
    (lambda r, o: sweep(r / "graft.yml", o, lambdas=[], rhos=[0]), "lambdas needs a non-empty list of numbers"),
    (lambda r, o: sweep(r / "graft.yml", o, lambdas="0.5,1", rhos=[0]), "lambdas needs a non-empty list of numbers"),
    (lambda r, o: sweep(r / "graft.yml", o, lambdas=[1, 1.0], rhos=[0]), "lambdas: 1.0 is listed twice"),
    (lambda r, o: sweep(r / "graft.yml", o, lambdas=[float("nan")], rhos=[0]), "lambdas: nan is not a finite number"),
    (lambda r, o: sweep(r / "graft.yml", o, lambdas=[True], rhos=[0]), "lambdas: True is not a finite number"),
    (lambda r, o: sweep(r / "graft.yml", o, lambdas=[1], rhos=[1.0]), "rhos: rho must be in [0, 1), got 1.0"),
    (lambda r, o: sweep(r / "graft.yml", o, lambdas=[1], rhos=[0], keep="all"),
     "tolerance, keep and eval_dtype are about evaluated points: they need eval=TASKS.yml"),
    (lambda r, o: sweep(r / "graft.yml", o, lambdas=[1], rhos=[0], eval=r / "tasks.yml", tolerance=2),
     "--tolerance must be a number in [0, 1]"),
])
def test_bad_input_is_one_graft_error_and_nothing_written(example, tmp_path, call, message):
    root, _ = example
    out = tmp_path / "out"
    with pytest.raises(GraftError) as raised:
        call(root, out)
    assert message in str(raised.value) and "\n" not in str(raised.value)
    assert not out.exists()
