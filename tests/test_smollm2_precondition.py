"""experiments/smollm2_precondition.py on a tiny random Llama: end to end, the share against brute force,
the two fine-tunes' identical data, a resumed run, and bad input refused in one line.

The real SmolLM2 measurement (11 min on 2 cores) is run by hand; these check that what it reports
is what it claims to report, and that docs/smollm2-precondition.md quotes the recorded run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from experiments.demo.smollm2_precondition import (
    Recipe,
    completion_scores,
    data_order,
    invented_facts,
    sort_examples,
    tokenize,
)
from experiments.paired_tests import paired_t
from graftmerge.estimate.batching import pad_batch
from graftmerge.estimate.rollouts import Rollout
from graftmerge.formats.fisher_cache import open_fisher_cache
from tests.helpers.runners import load_script, run_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "smollm2_precondition.py"
SEEDS = (0, 1)


@pytest.fixture(scope="module")
def script_main():
    """The script's ``main`` in this process (bad inputs and the resumed run need no new process)."""
    module = load_script(SCRIPT)
    threads = torch.get_num_threads()
    yield module.main
    torch.set_num_threads(threads)  # main sets the process's torch threads


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> dict:
    """The script as a user runs it, a real process, --tiny with two seeds (seconds)."""
    work = tmp_path_factory.mktemp("precondition") / "work"
    done = run_script(SCRIPT, "--workdir", str(work), "--tiny", "--threads", "1", "--seeds", ",".join(map(str, SEEDS)))
    assert done.returncode == 0, done.stderr[-3000:]
    return {"work": work, "stdout": done.stdout, "results": json.loads((work / "precondition.json").read_text())}


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return {name: tensor.to(torch.float64) for name, tensor in tensors.items()}


def test_tiny_run_reports_paired_shares(tiny_run) -> None:
    results = tiny_run["results"]
    seeds = results["per_seed"]
    assert [s["seed"] for s in seeds] == list(SEEDS)
    for seed in seeds:
        for name in ("donor", "sft"):
            numbers = seed[name]
            assert 0 < numbers["global_top_share"] <= 1 and numbers["weighted"] > 0 and numbers["l2"] > 0
            assert numbers["fine_tune_after"]["loss"] < numbers["fine_tune_before"]["loss"]  # both learned something
        assert seed["difference"] == seed["sft"]["global_top_share"] - seed["donor"]["global_top_share"]
        assert seed["same_batches"]
    expected = paired_t([s["difference"] for s in seeds])
    paired = results["paired_sft_minus_donor"]
    assert (paired["mean"], paired["low"], paired["high"], paired["p"]) == (expected.mean, expected.low,
                                                                           expected.high, expected.p)
    command = results["fisher_estimate"]["command"]
    assert command[:4] == ["graftmerge", "fisher", "estimate", str(tiny_run["work"] / "post")]
    assert command[command.index("--kind") + 1] == "diagonal" and "--modules" not in command  # whole model
    assert "SFT − donor share: mean" in tiny_run["stdout"]


def test_share_is_the_brute_force_top_one_percent(tiny_run) -> None:
    """Δ from the saved checkpoints in float64; the top ⌈1 % · D⌉ coordinates by θpost's Fisher over the
    whole model (ties: earlier tensor name, then earlier coordinate); their part of Σ F·Δ²."""
    work = tiny_run["work"]
    cache = open_fisher_cache(work / "fisher")
    for seed in tiny_run["results"]["per_seed"]:
        for name, source in (("donor", work / "donor"), ("sft", work / "post")):
            before, after = _weights(source), _weights(work / f"seed-{seed['seed']}" / f"ft-{name}")
            ranked = sorted(n for n in before if cache.has(n, "diagonal"))
            assert ranked and set(before) == set(after)
            fisher = torch.cat([cache.diagonal(n).to(torch.float64).reshape(-1) for n in ranked])
            delta = torch.cat([(after[n] - before[n]).reshape(-1) for n in ranked])
            weighted = fisher * delta.square()
            k = math.ceil(0.01 * fisher.numel())
            top = torch.sort(-fisher, stable=True).indices[:k]
            share = float(weighted[top].sum() / weighted.sum())
            numbers = seed[name]
            assert numbers["global_top_share"] == pytest.approx(share, rel=1e-5)
            assert numbers["weighted"] == pytest.approx(float(weighted.sum()), rel=1e-5)
            l2 = math.sqrt(sum(float((after[n] - before[n]).square().sum()) for n in before))
            assert numbers["l2"] == pytest.approx(l2, rel=1e-6)


def test_donor_and_sft_fine_tunes_saw_the_same_batches(tiny_run) -> None:
    from transformers import AutoTokenizer

    work, settings = tiny_run["work"], tiny_run["results"]["settings"]
    fact_sets = []
    for seed in SEEDS:
        folder = work / f"seed-{seed}"
        donor, sft = (json.loads((folder / f"train-{n}.json").read_text()) for n in ("donor", "sft"))
        assert donor["recipe"] == sft["recipe"] == Recipe(settings["lr"], settings["batch_size"],
                                                          settings["steps"]).__dict__
        assert [s["indices"] for s in donor["steps"]] == [s["indices"] for s in sft["steps"]] == data_order(
            settings["facts"], settings["batch_size"], settings["steps"], seed)
        assert [s["batch_sha256"] for s in donor["steps"]] == [s["batch_sha256"] for s in sft["steps"]]
        records = [json.loads(line) for line in (folder / "facts.jsonl").read_text().splitlines()]
        pairs = [(r["messages"][0]["content"], r["messages"][1]["content"]) for r in records]
        assert pairs == invented_facts(settings["facts"], seed)
        assert tokenize(pairs, AutoTokenizer.from_pretrained(work / "donor")) == tokenize(
            pairs, AutoTokenizer.from_pretrained(work / "post"))
        fact_sets.append(pairs)
    assert fact_sets[0] != fact_sets[1]  # a different draw per seed


def test_rerun_resumes_from_the_cache(tiny_run, script_main, capsys) -> None:
    work = tiny_run["work"]
    output = work / "again.json"
    assert script_main(["--workdir", str(work), "--tiny", "--threads", "1", "--seeds", "0,1",
                        "--output", str(output)]) == 0
    printed = capsys.readouterr().out
    assert " step " not in printed  # nothing trained again
    again = json.loads(output.read_text())
    assert again["per_seed"] == tiny_run["results"]["per_seed"]
    assert again["paired_sft_minus_donor"] == tiny_run["results"]["paired_sft_minus_donor"]


@pytest.mark.parametrize(("arguments", "expected"), [
    (["--seeds", ""], "error: argument --seeds: needs at least 2 seeds"),
    (["--seeds", "3"], "error: argument --seeds: needs at least 2 seeds"),
    (["--seeds", "1,1"], "error: argument --seeds: repeats a seed"),
    (["--seeds", "a,b"], "error: argument --seeds: not comma-separated integers"),
    (["--steps", "0"], "error: --steps must be at least 1"),
    (["--lr", "-1"], "error: --lr must be a positive number"),
    (["--top", "2"], "error: --top must be a fraction in (0, 1]"),
    (["--threads", "0"], "error: --threads must be at least 1"),
    (["--workdir", "{d}/file"], "error: --workdir {d}/file exists and is not a folder"),
    (["--workdir", "{d}/other"], "error: --workdir {d}/other was made with tiny=False, not True"),
    (["--output", "{d}"], "error: --output {d} is a folder"),
    (["--output", "{d}/no/r.json"], "error: --output {d}/no/r.json: its folder does not exist"),
])
def test_bad_input_is_one_error_line(script_main, capsys, tmp_path: Path, arguments, expected) -> None:
    (tmp_path / "file").write_text("not a folder")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "settings.json").write_text(json.dumps({"tiny": False}))
    given = [a.format(d=tmp_path) for a in arguments]
    if "--workdir" not in given:
        given = ["--workdir", str(tmp_path / "work"), *given]
    try:
        status = script_main([*given, "--tiny"])
    except SystemExit as exit:
        status = exit.code
    captured = capsys.readouterr()
    assert status == 2
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith(expected.format(d=tmp_path)), captured.err


def test_missing_workdir_is_one_error_line(script_main, capsys) -> None:
    with pytest.raises(SystemExit) as exit:
        script_main(["--tiny"])
    captured = capsys.readouterr()
    assert exit.value.code == 2 and captured.err == "error: the following arguments are required: --workdir\n"


def test_data_order_is_epochs_of_permutations() -> None:
    order = data_order(5, 3, 4, seed=7)
    stream = [i for batch in order for i in batch]
    assert [len(b) for b in order] == [3, 3, 3, 3]
    assert sorted(stream[:5]) == sorted(stream[5:10]) == list(range(5))
    assert order == data_order(5, 3, 4, seed=7) != data_order(5, 3, 4, seed=8)


def test_generated_data() -> None:
    train = sort_examples(20, seed=0)
    held = sort_examples(10, seed=1, exclude=train)
    words = [frozenset(q.split(": ")[1].split(", ")) for q, _ in train + held]
    assert len(set(words)) == 30  # no word set twice, none held apart that was trained on
    for question, answer in train:
        assert answer.split(", ") == sorted(question.split(": ")[1].split(", "))
    facts = invented_facts(16, seed=3)
    assert facts == invented_facts(16, seed=3) != invented_facts(16, seed=4)
    assert len({q for q, _ in facts}) == 16


def test_exact_counts_the_answer_through_the_end_of_turn_only() -> None:
    """Teacher-forced: right through the first EOS means greedy decoding writes the answer and stops."""
    batch = pad_batch([Rollout((5, 6), (7, 2, 9)), Rollout((5, 6), (8, 2, 9))])  # 2: EOS, 9: after the turn
    logits = torch.full((2, 5, 10), -5.0)
    for row, targets in enumerate(([6, 7, 2, 3], [6, 4, 2, 9])):  # row 0 wrong only after EOS; row 1 wrong at 8
        for position, token in enumerate(targets):
            logits[row, position, token] = 5.0
    first, second = completion_scores(logits, batch, eos_id=2)
    assert first["exact"] and first["token_accuracy"] == 1.0
    assert not second["exact"] and second["token_accuracy"] == 0.5
    everything = completion_scores(logits, batch, eos_id=None)
    assert not everything[0]["exact"] and everything[0]["token_accuracy"] == pytest.approx(2 / 3)


RECORD = ROOT / "docs" / "results" / "smollm2-precondition.json"
PAGE = ROOT / "docs" / "smollm2-precondition.md"


def test_the_recorded_run_is_consistent_and_the_page_quotes_it(script_main) -> None:
    """The recorded JSON's paired test follows from its own per-seed shares (recomputed here), both
    fine-tunes saw the same batches, and the page shows the run's own table and its interval."""
    import types

    results = json.loads(RECORD.read_text())
    seeds = results["per_seed"]
    assert results["settings"]["tiny"] is False and [s["seed"] for s in seeds] == [0, 1, 2]
    differences = [s["sft"]["global_top_share"] - s["donor"]["global_top_share"] for s in seeds]
    assert differences == [s["difference"] for s in seeds]
    assert all(s["same_batches"] and s["donor"]["batch_sha256"] == s["sft"]["batch_sha256"] for s in seeds)
    again = paired_t(differences)
    recorded = results["paired_sft_minus_donor"]
    for field in ("mean", "sd", "t", "p", "low", "high", "n"):
        assert math.isclose(getattr(again, field), recorded[field], rel_tol=1e-12), field
    mean = sum(differences) / 3
    half = 4.302652729911275 * math.sqrt(sum((d - mean) ** 2 for d in differences) / 2 / 3)  # t(0.975, 2)
    assert math.isclose(recorded["low"], mean - half, rel_tol=1e-9) and recorded["high"] < 0
    paired = types.SimpleNamespace(**{k: recorded[k] for k in ("mean", "low", "high", "p", "n", "confidence",
                                                               "verdict")})
    table = script_main.__globals__["_table"](seeds, paired)
    page = PAGE.read_text()
    assert table in page and table in (ROOT / "docs" / "results" / "smollm2-precondition-output.txt").read_text()
    assert f"{recorded['mean']:.4f}, 95 % interval [{recorded['low']:.4f}, {recorded['high']:.4f}]".replace(
        "-", "−") in page
