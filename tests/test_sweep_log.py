"""`sweep --eval`'s DIR: the results log read back by one checking reader, and DIR left the user's.

Class 1 (docs/security.md, "A sweep's results log is read back checked"): every record read
back on resume goes through ``formats.sweep_log.parse_sweep_log``; an edited or damaged
record is one error naming the file and line, and DIR is left exactly as it was. Class 2
("DIR belongs to the user"): a results.jsonl that is not a sweep's, an empty one beside the
user's files, a linked one, the user's files in best/ or a kept folder, hidden files named
like the sweep's temporaries: refused or left alone, never truncated, deleted or written
through. A sweep killed (SIGKILL, a real process) around best/'s publication never leaves a
chosen.json that names another model than best/. Controls: honest resumes, a torn last
line, a header torn by a kill, a record repeated word for word, a killed run's scratch folder.
The sweep runs on the tiny models with the weight-reading judge of
tests/helpers/weight_judge.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from graftmerge.errors import GraftError
from graftmerge.formats.output_folder import STOP_ENV
from graftmerge.formats.results_log import ResultsLog, read_log
from graftmerge.formats.sweep_log import parse_sweep_log
from tests.helpers.models import tree_digest
from tests.helpers.weight_judge import WeightJudge, brute_force_choice, make_setup, records, sweep, without_seconds

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup(tied_models, tied_diag_cache, tmp_path_factory) -> dict:
    return make_setup(tmp_path_factory.mktemp("sweep-log"), tied_models, tied_diag_cache)


@pytest.fixture(scope="module")
def honest(setup) -> Path:
    """A finished sweep (τ 0.3, best/ only)."""
    out = setup["root"] / "honest"
    sweep(setup, out)
    return out


def copy_of(honest: Path, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(honest, out, symlinks=True)
    return out


def lines_of(out: Path) -> list[str]:
    return (out / "results.jsonl").read_text().splitlines(keepends=True)


def edit_record(out: Path, number: int, change) -> None:
    """Replace line ``number`` (1-based) with ``change(record)`` written as JSON."""
    lines = lines_of(out)
    record = json.loads(lines[number - 1])
    lines[number - 1] = json.dumps(change(record)) + "\n"
    (out / "results.jsonl").write_text("".join(lines))


def first_point(out: Path) -> int:
    return next(i for i, line in enumerate(lines_of(out), 1) if json.loads(line)["kind"] == "point")


def point_record(record: dict, **fields) -> dict:
    return {**record, **fields}


def roles_set(split: str, role: str, value):
    def change(record):
        record["roles"][split][role] = value
        return record
    return change


# What an edit of a point's record can be, each refused with the reason it gives.
BAD_RECORDS = {
    "missing-roles": (lambda r: {k: v for k, v in r.items() if k != "roles"}, "'roles' is missing"),
    "missing-seconds": (lambda r: {k: v for k, v in r.items() if k != "seconds"}, "'seconds' is missing"),
    "splits-number": (lambda r: point_record(r, splits=1), "'splits' is not a list"),
    "splits-unknown": (lambda r: point_record(r, splits=["train"]), "never scores"),
    "lambda-list": (lambda r: point_record(r, **{"lambda": [0.5]}), "must be numbers"),
    "lambda-bool": (lambda r: point_record(r, rho=False), "must be numbers"),
    "off-grid": (lambda r: point_record(r, **{"lambda": 0.75}), "not on this sweep's grid"),
    "string-role": (roles_set("validation", "new", "0.9"), "'0.9' is not a number"),
    "role-above-1": (roles_set("validation", "new", 1.5), "outside [0, 1]"),
    "role-below-0": (roles_set("validation", "old", -0.25), "outside [0, 1]"),
    "role-huge-int": (roles_set("validation", "old", 10 ** 400), "not a number"),
    "null-without-error": (roles_set("validation", "new", None), "no 'error'"),
    "unknown-role": (roles_set("validation", "newer", 0.5), "roles old and new"),
    "scores-list": (lambda r: point_record(r, scores=[1.0]), "'scores' is not an object"),
    "string-raw": (lambda r: point_record(r, scores={"keep": {"validation": "high"}}), "'high' is not a number"),
    "unscored-split": (lambda r: point_record(r, scores={"keep": {"test": 0.5}}), "was not scored"),
    "unknown-field": (lambda r: point_record(r, note="hand-edited"), "'note' is no sweep's"),
    "kind": (lambda r: point_record(r, kind="pointless"), "'kind' is 'pointless'"),
    "second-header": (lambda r: {"kind": "header"}, "a second header"),
    "not-object": (lambda r: [r], "not a JSON object"),
    "error-number": (lambda r: point_record(r, error=3), "'error' is not a message"),
    "negative-seconds": (lambda r: point_record(r, seconds=-1), "'seconds'"),
}


@pytest.mark.parametrize("case", sorted(BAD_RECORDS))
def test_the_reader_refuses_every_edited_record_naming_file_and_line(honest, tmp_path, case):
    out = copy_of(honest, tmp_path)
    number = first_point(out)
    change, reason = BAD_RECORDS[case]
    edit_record(out, number, change)
    raw = (out / "results.jsonl").read_bytes()
    header = json.loads(lines_of(out)[0])
    with pytest.raises(GraftError, match=f"line {number}: .*{re.escape(reason)}.*delete that line") as error:
        parse_sweep_log(raw, out / "results.jsonl", header)
    assert str(out / "results.jsonl") in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_literals_are_refused(honest, tmp_path, literal):
    """JSON has no NaN: the sweep writes null; Python's parser would take these literals."""
    out = copy_of(honest, tmp_path)
    number = first_point(out)
    lines = lines_of(out)
    record = json.loads(lines[number - 1])
    old = record["scores"]["keep"]["validation"]
    lines[number - 1] = lines[number - 1].replace(json.dumps(old), literal, 1)
    (out / "results.jsonl").write_text("".join(lines))
    with pytest.raises(GraftError, match=f"line {number}: .*not a number"):
        parse_sweep_log((out / "results.jsonl").read_bytes(), out / "results.jsonl", json.loads(lines[0]))


@pytest.mark.parametrize("case", ["role-above-1", "missing-roles", "string-role", "different-duplicate",
                                  "bad-json-line", "torn-not-a-record"])
def test_a_resumed_sweep_refuses_a_bad_record_and_leaves_dir_as_it_was(setup, honest, tmp_path, case):
    """Through run_sweep_eval: the impossible score is not chosen, a traceback is not given, nothing changes."""
    out = copy_of(honest, tmp_path)
    number = first_point(out)
    if case in BAD_RECORDS:
        edit_record(out, number, BAD_RECORDS[case][0])
    elif case == "different-duplicate":
        lines = lines_of(out)
        changed = json.loads(lines[number - 1])
        changed["roles"]["validation"]["new"] = 0.99  # a plausible score, but not the one first recorded
        (out / "results.jsonl").write_text("".join(lines) + json.dumps(changed) + "\n")
    elif case == "bad-json-line":
        lines = lines_of(out)
        lines.insert(number, "{not json\n")
        (out / "results.jsonl").write_text("".join(lines))
    else:  # a last line without newline that no record begins as: not a kill's doing
        with open(out / "results.jsonl", "a") as file:
            file.write("my own note")
    before = tree_digest(out)
    judge = WeightJudge(setup["models"])
    with pytest.raises(GraftError) as error:
        sweep(setup, out, judge=judge)
    message = str(error.value)
    assert str(out / "results.jsonl") in message and "line" in message and "\n" not in message
    if case == "different-duplicate":
        assert f"lines {number} and {len(lines) + 1}: two different records" in message
    assert tree_digest(out) == before and judge.calls == 0
    assert not list(tmp_path.glob(".out.*"))  # the lock is gone too


def test_a_record_repeated_word_for_word_counts_once(setup, honest, tmp_path):
    """Control: a duplicate identical in content is tolerated (it cannot change the choice)."""
    out = copy_of(honest, tmp_path)
    lines = lines_of(out)
    (out / "results.jsonl").write_text("".join(lines) + lines[first_point(out) - 1])
    judge = WeightJudge(setup["models"])
    sweep(setup, out, judge=judge)
    assert judge.calls == 0
    chosen = json.loads((out / "chosen.json").read_text())["chosen"]
    assert chosen == json.loads((honest / "chosen.json").read_text())["chosen"] == brute_force_choice(
        records(honest), 0.3)


def test_an_honest_resume_reads_back_every_record_unchanged(setup, honest, tmp_path):
    out = copy_of(honest, tmp_path)
    header = records(out)[0]
    with ResultsLog(out / "results.jsonl", lambda raw, path: parse_sweep_log(raw, path, header)) as log:
        assert log.records == records(honest)
    assert (out / "results.jsonl").read_bytes() == (honest / "results.jsonl").read_bytes()


# -- class 2: DIR belongs to the user ----------------------------------------------------------


@pytest.mark.parametrize("content", [b"my notes\n", b"hello", b'{"a": 1}\n', b'{"kind": "header"}\n',
                                     b'{"kind": "po', b"\n"])
def test_a_log_that_is_not_a_sweeps_is_never_truncated_nor_dir_taken(setup, tmp_path, content):
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.jsonl").write_bytes(content)
    with pytest.raises(GraftError, match="results.jsonl"):
        sweep(setup, out)
    assert (out / "results.jsonl").read_bytes() == content and os.listdir(out) == ["results.jsonl"]


@pytest.mark.parametrize("torn", ["empty", "torn-header"])
@pytest.mark.parametrize("others", [{"notes.txt": "mine"}, {"best/my-eval.csv": "a,b"}, {"chosen.json": "{}"}])
def test_an_empty_or_torn_log_beside_the_users_files_takes_nothing(setup, tmp_path, torn, others):
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.jsonl").write_bytes(b"" if torn == "empty" else b'{"kind": "header", "for')
    for name, text in others.items():
        (out / name).parent.mkdir(exist_ok=True)
        (out / name).write_text(text)
    before = tree_digest(out)
    with pytest.raises(GraftError, match="holds no sweep header .* choose a new folder"):
        sweep(setup, out)
    assert tree_digest(out) == before


@pytest.mark.parametrize("torn", ["empty", "torn-header"])
def test_a_log_a_kill_left_empty_or_torn_in_its_header_is_resumed(setup, honest, tmp_path, torn):
    """Control: the sweep's own start, cut short by a kill (nothing else in DIR but hidden files), resumes."""
    out = tmp_path / "out"
    out.mkdir()
    header = (honest / "results.jsonl").read_bytes().split(b"\n")[0]
    (out / "results.jsonl").write_bytes(b"" if torn == "empty" else header[:40])
    (out / ".DS_Store").write_text("the user's hidden file")
    sweep(setup, out)
    assert without_seconds(records(out)) == without_seconds(records(honest))
    assert (out / ".DS_Store").read_text() == "the user's hidden file"


@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_a_linked_log_is_never_written_through(setup, honest, tmp_path, link):
    out = copy_of(honest, tmp_path)
    target = tmp_path / "elsewhere.jsonl"
    lines = lines_of(out)
    target.write_text("".join(lines[:-1]) + lines[-1][:20])  # a torn last line a resume would cut off
    (out / "results.jsonl").unlink()
    (os.symlink if link == "symbolic" else os.link)(target, out / "results.jsonl")
    before = target.read_bytes()
    with pytest.raises(GraftError, match="never writes"):
        sweep(setup, out)
    assert target.read_bytes() == before


@pytest.mark.parametrize("keep, folder", [("best", "best"), ("all", "lambda-0.5_rho-0.0")])
@pytest.mark.parametrize("added", ["results.csv", ".hidden", "sub/notes.md"])
def test_files_the_user_added_to_a_model_folder_stop_the_rerun_before_any_work(setup, honest, tmp_path, keep,
                                                                              folder, added):
    out = copy_of(honest, tmp_path)
    if folder != "best":
        shutil.copytree(out / "best", out / folder)
    (out / folder / added).parent.mkdir(exist_ok=True)
    (out / folder / added).write_text("the user's")
    before = tree_digest(out)
    judge = WeightJudge(setup["models"])
    with pytest.raises(GraftError, match=f"{folder} holds .* which no merge writes"):
        sweep(setup, out, judge=judge, keep=keep)
    assert tree_digest(out) == before and judge.calls == 0


def test_hidden_files_named_like_temporaries_are_left_alone_a_killed_runs_scratch_is_not(setup, honest, tmp_path):
    out = copy_of(honest, tmp_path)
    users = {".scratch-mine/keep.txt": "a", ".notes.tmp-1": "b", ".chosen.json.tmp-999": "c",
             ".scratch.partial-notapid/x": "d", ".frontier.png.tmp-5.png": "e"}
    for name, text in users.items():
        (out / name).parent.mkdir(exist_ok=True)
        (out / name).write_text(text)
    dead = subprocess.Popen(["true"])
    dead.wait()
    leftover = out / f".scratch.partial-{dead.pid}-abcd1234"  # what a killed run of the sweep leaves
    (leftover / "models").mkdir(parents=True)
    sweep(setup, out, tolerance=1.0)
    assert all((out / name).read_text() == text for name, text in users.items())
    assert not leftover.exists()


# -- best/ and chosen.json stay a pair, whatever the moment of a kill ---------------------------

SWEEP_PROCESS = """
import json, sys
from pathlib import Path
from tests.helpers.weight_judge import sweep
setup = {key: Path(value) for key, value in json.loads(sys.argv[1]).items() if key != "models"}
setup["models"] = {key: Path(value) for key, value in json.loads(sys.argv[1])["models"].items()}
sweep(setup, Path(sys.argv[2]), tolerance=float(sys.argv[3]))
"""


def best_point(out: Path) -> dict:
    parameters = yaml.safe_load((out / "best" / "mergekit_config.yml").read_text())["parameters"]
    return {"lambda": parameters["lambda"], "rho": parameters["rho"]}


def run_until_stopped(setup: dict, out: Path, tolerance: float, stage: str, log: Path) -> subprocess.Popen:
    arguments = json.dumps({"root": str(setup["root"]), "config": str(setup["config"]), "tasks": str(setup["tasks"]),
                            "models": {k: str(v) for k, v in setup["models"].items()}})
    env = {**os.environ, STOP_ENV: stage, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with open(log, "w") as handle:
        process = subprocess.Popen([sys.executable, "-c", SWEEP_PROCESS, arguments, str(out), str(tolerance)],
                                   cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        state = Path(f"/proc/{process.pid}/stat").read_text().rpartition(")")[2].split()[0]
        assert process.poll() is None, log.read_text()[-3000:]
        if state == "T":
            return process
        time.sleep(0.05)
    process.kill()
    raise AssertionError("the sweep never reached " + stage)


@pytest.mark.parametrize("stage", ["publish-done"])  # best/ replaced, chosen.json not yet written
def test_a_rerun_with_another_tolerance_killed_around_best_never_leaves_a_mismatched_pair(setup, honest, tmp_path,
                                                                                         stage):
    out = copy_of(honest, tmp_path)
    assert best_point(out) == json.loads((out / "chosen.json").read_text())["chosen"]
    process = run_until_stopped(setup, out, 1.0, stage, tmp_path / "sweep.log")
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    chosen = out / "chosen.json"
    assert not chosen.exists()  # removed before best/ was touched, written again only after it
    sweep(setup, out, tolerance=1.0)  # the rerun finishes the choice
    expected = brute_force_choice(records(out), 1.0)
    assert best_point(out) == json.loads(chosen.read_text())["chosen"] == expected
    assert not list(tmp_path.glob(".out.*")) and not [p for p in os.listdir(out) if p.startswith(".")]


def test_read_log_reads_nothing_that_is_not_there(tmp_path):
    assert read_log(tmp_path / "results.jsonl", lambda raw, path: ([], 0)) is None
