"""An estimate checkpoint vouches only for what it checked (issue 36, class 5).

A checkpoint resumes only the run that wrote it, the model identified by content (a model
saved over the same path is another model; the same model elsewhere is the same), and the
samples kept with it only the same prompts (by content) and sampling settings. Everything
read back is checked before use: the payload's type and version, its seal, the batch
position, the counts against the batches before it, each sum's name, shape and dtype, and
its values. Every refusal is one ``error:`` line naming the checkpoint and what to do,
exit 2, no cache written; an honest resume gives the uninterrupted cache bit for bit. The
same checks under ``--fsdp`` are in tests/test_estimate_fsdp.py (the killed run's checkpoints).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from graftmerge.estimate import checkpointing
from graftmerge.estimate.checkpointing import checkpoint_folder
from graftmerge.estimate.run import EstimateSettings, estimate_fisher
from tests.helpers.estimation import caches_close, make_model, random_rollouts, write_jsonl
from tests.helpers.runners import error_line, run_cli

ARGS = ["--kind", "both", "--batch-size", "2", "--accumulator-dtype", "float64", "--checkpoint-every", "2",
        "--no-progress"]
SAMPLING = ["--samples-per-prompt", "2", "--max-new-tokens", "4", "--seed", "7"]


class Interrupt(KeyboardInterrupt):
    pass


def interrupted(settings: EstimateSettings, after: int) -> None:
    def stop(index: int) -> None:
        if index == after:
            raise Interrupt

    with pytest.raises(Interrupt):
        estimate_fisher(settings, after_batch=stop)


def settings(model: Path, output: Path, **options) -> EstimateSettings:
    return EstimateSettings(model=model, output=output, kind="both", batch_size=2, accumulator_dtype="float64",
                            progress=False, **options)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A model and rollouts (6 batches), the uninterrupted cache, and a run stopped after batch 3 (its checkpoint
    after 2 batches kept as ``pristine``); the same for ``--prompts`` (3 batches, checkpoint after 2)."""
    root = tmp_path_factory.mktemp("checkpoints")
    model = make_model(root / "model", tied=False)
    make_model(root / "other", tied=False, seed=1)  # the same shapes, other weights
    data = write_jsonl(root / "rollouts.jsonl", random_rollouts(11, seed=5))
    estimate_fisher(settings(model, root / "straight", rollouts=data))
    interrupted(settings(model, root / "stopped", rollouts=data, checkpoint_every=2), after=2)
    shutil.copytree(checkpoint_folder(root / "stopped"), root / "pristine")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in ([1, 2, 3], [4], [5, 6])))
    sampling = {"prompts": prompts, "samples_per_prompt": 2, "max_new_tokens": 4, "seed": 7}
    estimate_fisher(settings(model, root / "sampled-straight", **sampling))
    interrupted(settings(model, root / "sampled-stopped", checkpoint_every=2, **sampling), after=2)
    shutil.copytree(checkpoint_folder(root / "sampled-stopped"), root / "sampled-pristine")
    return {"root": root, "model": model, "other": root / "other", "data": data, "prompts": prompts}


def resume(tmp_path: Path, setup: dict, *, model: Path | None = None, pristine: str = "pristine",
           edit=None, extra=()) -> tuple:
    """The pristine checkpoint put beside a fresh OUT, edited by ``edit(folder)``, then the estimate run on it."""
    output = tmp_path / "fisher"
    folder = checkpoint_folder(output)
    shutil.copytree(setup["root"] / pristine, folder)
    if edit is not None:
        edit(folder)
    data = ["--rollouts", str(setup["data"])] if pristine == "pristine" else ["--prompts", str(setup["prompts"]),
                                                                              *SAMPLING]
    result = run_cli("graftmerge", "fisher", "estimate", str(model or setup["model"]), "-o", str(output),
                     *data, *ARGS, *extra)
    return result, output, folder


def resealed(change):
    """An edit that changes rank 0's payload and seals it again (what only validation can catch)."""
    def edit(folder: Path) -> None:
        file = folder / "rank00000.pt"
        payload = torch.load(file, weights_only=True)
        change(payload)
        payload["seal"] = checkpointing.seal(payload)
        torch.save(payload, file)
    return edit


def refused(result, output: Path, folder: Path, *expected: str) -> str:
    line = error_line(result)
    assert all(text in line for text in expected), line
    assert str(folder) in line and "--restart" in line, line
    assert not output.exists()
    return line


# -- controls ------------------------------------------------------------------------------


def test_an_honest_resume_gives_the_uninterrupted_cache_bit_for_bit(tmp_path, setup):
    result, output, folder = resume(tmp_path, setup)
    assert result.returncode == 0, result.stderr[-3000:]
    caches_close(setup["root"] / "straight", output, rtol=0)
    assert not folder.exists()


def test_an_honest_resume_of_sampled_rollouts_gives_the_uninterrupted_cache(tmp_path, setup):
    result, output, _ = resume(tmp_path, setup, pristine="sampled-pristine")
    assert result.returncode == 0, result.stderr[-3000:]
    caches_close(setup["root"] / "sampled-straight", output, rtol=0)


def test_restart_starts_over_from_an_edited_checkpoint(tmp_path, setup):
    result, output, _ = resume(tmp_path, setup, edit=resealed(lambda p: p.update(batches_done=99)),
                               extra=["--restart"])
    assert result.returncode == 0, result.stderr[-3000:]
    caches_close(setup["root"] / "straight", output, rtol=0)


# -- another model, other samples ------------------------------------------------------------


def test_a_model_saved_over_the_same_path_is_another_run(tmp_path, setup):
    model = shutil.copytree(setup["model"], tmp_path / "model")  # the checkpoint's model, elsewhere: it resumes
    result, output, folder = resume(tmp_path, setup, model=model)
    assert result.returncode == 0, result.stderr[-3000:]
    caches_close(setup["root"] / "straight", output, rtol=0)
    for file in setup["other"].iterdir():  # saved over it: same path, same shapes, other weights
        shutil.copy(file, model / file.name)
    (tmp_path / "again").mkdir()
    result, output, folder = resume(tmp_path / "again", setup, model=model)
    refused(result, output, folder, "belongs to a run with other settings", "model content")


@pytest.mark.parametrize("change", ["edited prompts", "other temperature", "edited samples"])
def test_kept_samples_of_other_prompts_or_settings_or_edited_are_refused(tmp_path, setup, change):
    if change == "edited prompts":
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text(setup["prompts"].read_text().replace("[4]", "[4, 5]"))
        result, output, folder = resume(tmp_path, {**setup, "prompts": prompts}, pristine="sampled-pristine")
        expected = "drawn from other prompts"
    elif change == "other temperature":
        result, output, folder = resume(tmp_path, setup, pristine="sampled-pristine", extra=["--temperature", "0.5"])
        expected = "drawn from other prompts"
    else:
        def edit(folder: Path) -> None:
            kept = folder / "rollouts.jsonl"
            kept.write_text(kept.read_text().replace('"completion_ids": [', '"completion_ids": [3, ', 1))
        result, output, folder = resume(tmp_path, setup, pristine="sampled-pristine", edit=edit)
        expected = "were edited since they were drawn"
    line = error_line(result)
    assert expected in line and "--restart" in line and str(folder) in line, line
    assert not output.exists()


# -- edited, damaged or foreign checkpoints ---------------------------------------------------


def _first_sum(payload, prefix):
    return next(k for k in sorted(payload["state"]) if k.startswith(prefix))


def _grow(payload):
    key = _first_sum(payload, "diagonal/")
    payload["state"][key] = torch.zeros(payload["state"][key].shape[0] + 1, *payload["state"][key].shape[1:],
                                        dtype=torch.float64)


def _set(prefix, value):
    def change(payload):
        key = _first_sum(payload, prefix)
        payload["state"][key].view(-1)[0] = value
    return change


def _break_cauchy_schwarz(payload):
    key = next(k for k in sorted(payload["state"]) if k.startswith("columns/") and payload["state"][k].dim() == 2)
    payload["state"][key][0, 1] = payload["state"][key][0, 1].abs() + 10 * payload["state"][key].diagonal().max()


EDITS = {
    "a sum of the wrong shape": (resealed(_grow), "this run's is"),
    "a sum of the wrong dtype": (resealed(lambda p: p["state"].update(
        {_first_sum(p, "diagonal/"): p["state"][_first_sum(p, "diagonal/")].float()})), "this run's is"),
    "a missing sum": (resealed(lambda p: p["state"].pop(_first_sum(p, "rows/"))), "lacks"),
    "an extra sum": (resealed(lambda p: p["state"].update({"diagonal/extra": torch.zeros(2, dtype=torch.float64)})),
                     "which this run does not sum"),
    "a negative diagonal sum": (resealed(_set("diagonal/", -1.0)), "negative value"),
    "a NaN sum": (resealed(_set("rows/", float("nan"))), "NaN or Inf"),
    "a factor no outer products sum to": (resealed(_break_cauchy_schwarz), "every sum of outer products keeps"),
    "missing counts": (resealed(lambda p: p["state"].pop("counts")), "lacks 'counts'"),
    "a sparse sum": (lambda folder: _sparse(folder), "damaged"),
    "edited counts": (resealed(lambda p: p["state"]["counts"].add_(1)), "are not the (sequences, tokens"),
    "an edited position": (resealed(lambda p: p.update(batches_done=4)), "are not the (sequences, tokens"),
    "a position past the end": (resealed(lambda p: p.update(batches_done=6)), "batches were done"),
    "a position as a string": (resealed(lambda p: p.update(batches_done="2")), "damaged"),
    "an edit left unsealed": (lambda folder: _unsealed(folder), "does not match its seal"),
    "a list, not a checkpoint": (lambda folder: torch.save([1, 2], folder / "rank00000.pt"),
                                 "not a graftmerge estimate checkpoint"),
    "a checkpoint of the old format": (lambda folder: _old_format(folder), "not a graftmerge estimate checkpoint"),
    "another version": (resealed(lambda p: p.update(version=3)), "has version 3"),
    "text": (lambda folder: (folder / "rank00000.pt").write_text("not a checkpoint"), "is unreadable"),
    "code to run": (lambda folder: (folder / "rank00000.pt").write_bytes(
        b"\x80\x04cos\nsystem\n\x8c\x04true\x85R."), "is unreadable"),
}


def _unsealed(folder: Path) -> None:
    payload = torch.load(folder / "rank00000.pt", weights_only=True)
    _set("diagonal/", 0.5)(payload)
    torch.save(payload, folder / "rank00000.pt")


def _sparse(folder: Path) -> None:
    payload = torch.load(folder / "rank00000.pt", weights_only=True)
    key = _first_sum(payload, "rows/")
    payload["state"][key] = payload["state"][key].to_sparse()
    torch.save(payload, folder / "rank00000.pt")


def _old_format(folder: Path) -> None:
    payload = torch.load(folder / "rank00000.pt", weights_only=True)
    torch.save({k: payload[k] for k in ("fingerprint", "batches_done", "state")}, folder / "rank00000.pt")


@pytest.mark.parametrize("case", sorted(EDITS))
def test_an_edited_damaged_or_foreign_checkpoint_is_one_line(tmp_path, setup, case):
    edit, expected = EDITS[case]
    result, output, folder = resume(tmp_path, setup, edit=edit)
    refused(result, output, folder, expected)


def test_honest_sums_pass_the_value_checks_and_only_their_kept_part_is_read():
    """Sums of outer products in float32 (two columns perfectly correlated, more rows than one strip) pass; the
    part below the diagonal blocks, which the sharded accumulator does not keep, is not read; one entry past
    Cauchy–Schwarz anywhere above the diagonal is refused."""
    x = torch.randn(64, checkpointing.STRIP_ROWS + 77, generator=torch.Generator().manual_seed(0))
    x[:, 1] = 3 * x[:, 0]
    total = x.T @ x
    assert checkpointing.sum_problem("columns/w", total) is None
    kept = torch.triu(total) - torch.tril(torch.full_like(total, 1e9), diagonal=-1)
    assert checkpointing.sum_problem("factor/columns/w", kept) is None
    kept[0, -1] = 2 * (total[0, 0] * total[-1, -1]).sqrt()
    assert "breaks" in checkpointing.sum_problem("factor/columns/w", kept)
    assert "negative value" in checkpointing.sum_problem("diagonal/w", -torch.ones(3))
