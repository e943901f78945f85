"""One merge, one MergeRun: born when the merge starts, handed down to every tensor, gone when it ends.

* The per-tensor path only goes down: from mergekit's call of the merge method to the math
  and the readers of opened files, never back into config reading, Hub references, folder
  validation, the threshold pass or the user's cache.
* Nothing of a merge stays in the process: the registry mergekit's tasks find their run in
  is empty after a merge, whether it succeeded or failed.
* The run's id, which travels in the config mergekit sees, never reaches a written file and
  cannot be given by a user.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from mergekit.common import ModelReference
from mergekit.merge_methods import merge_state_dicts
from mergekit.merge_methods.base import TensorGroup

from graftmerge.errors import GraftError
from graftmerge.methods import graft as merge_method
from graftmerge.pipeline import graft
from tests.helpers.configs import graft_yaml
from tests.helpers.fisher_caches import write_mixed_cache
from tests.helpers.models import read_model
from tests.helpers.runners import error_line, run_cli


@pytest.fixture(scope="module")
def mixed_cache(tied_models, tmp_path_factory) -> Path:
    return write_mixed_cache(tmp_path_factory.mktemp("run-fisher") / "mixed", tied_models["post"])


def is_upward(module: str, qualname: str) -> bool:
    """Whether a call made while grafting one tensor goes back to where a merge starts: config, Hub, folders,
    the threshold pass (and its cached thresholds), mergekit's input checks. Reading the opened files is down,
    checks on what is read included (the Fisher cache's reader looks up its orthonormality record)."""
    if module.startswith("graftmerge.hub") or module in (
            "graftmerge.pipeline.mergekit_inputs", "graftmerge.pipeline.threshold_pass"):
        return True
    if module == "graftmerge.formats.output_folder":
        return qualname != "stage_reached"
    if module == "graftmerge.pipeline.graft_plan":  # only the opened inputs' per-tensor answers
        return not qualname.startswith(("GraftInputs.", "GraftPlan.")) or qualname in (
            "GraftInputs.open", "GraftInputs.from_sources", "GraftPlan.check")
    return False


@pytest.mark.parametrize("scope", ["global", "tensor"])
def test_the_per_tensor_path_only_goes_down(tmp_path, tied_models, mixed_cache, scope):
    m = tied_models
    config = tmp_path / "graft.yml"
    config.write_text(graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 0.5), (m["donor_ft2"], 1.0)], rho=0.02,
                                 fisher=mixed_cache, scope=scope))
    grafted, upward, depth = [], set(), [0]

    def profile(frame, event, _):
        if event not in ("call", "return"):
            return
        code, module = frame.f_code, frame.f_globals.get("__name__", "")
        if code is merge_method.GraftMergeMethod.merge_group.__code__:
            depth[0] += 1 if event == "call" else -1
            grafted.append(1) if event == "call" else None
        elif event == "call" and depth[0] and module.startswith("graftmerge") and is_upward(module, code.co_qualname):
            upward.add(f"{module}.{code.co_qualname}")

    sys.setprofile(profile)
    try:
        result = run_cli("mergekit-yaml", str(config), str(tmp_path / "out"))
    finally:
        sys.setprofile(None)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(grafted) == len([t for t in read_model(m["post"]).values() if t.is_floating_point()])
    assert not upward, sorted(upward)


def test_is_upward_sees_the_calls_the_kernel_made_before():
    """The checker itself: what a per-tensor call used to reach (a plan validated again, a folder resolved,
    the threshold looked up) counts as upward; the opened inputs' answers do not."""
    assert is_upward("graftmerge.pipeline.graft_plan", "resolve_model_folder")
    assert is_upward("graftmerge.pipeline.graft_plan", "open_inputs")
    assert is_upward("graftmerge.hub.models", "cached_model_folder")
    assert is_upward("graftmerge.pipeline.threshold_pass", "global_threshold")
    assert not is_upward("graftmerge.pipeline.graft_plan", "GraftInputs.tensor_fisher")
    assert not is_upward("graftmerge.formats.output_folder", "stage_reached")


def test_no_run_outlives_its_merge(tmp_path, tied_models, tied_diag_cache, monkeypatch):
    m = tied_models
    config = tmp_path / "graft.yml"
    config.write_text(graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 1.0)], rho=0.05, fisher=tied_diag_cache))
    seen = []
    original = graft.graft_tensor

    def graft_and_look(run, *args, **kwargs):
        seen.append(dict(merge_method._ACTIVE_RUNS))
        return original(run, *args, **kwargs)

    monkeypatch.setattr(merge_method, "graft_tensor", graft_and_look)
    assert run_cli("mergekit-yaml", str(config), str(tmp_path / "ok")).returncode == 0
    assert seen and all(len(active) == 1 for active in seen)  # one merge, registered while mergekit ran
    assert merge_method._ACTIVE_RUNS == {}

    def fail_on_third(run, name, *args, **kwargs):
        seen.append(name)
        if len(seen) == 3:
            raise GraftError(f"tensor {name!r}: refused for the test")
        return original(run, name, *args, **kwargs)

    seen.clear()
    monkeypatch.setattr(merge_method, "graft_tensor", fail_on_third)
    line = error_line(run_cli("mergekit-yaml", str(config), str(tmp_path / "failed")))
    assert line == f"error: tensor {seen[2]!r}: refused for the test"
    assert merge_method._ACTIVE_RUNS == {} and not (tmp_path / "failed").exists()


def test_the_run_id_stays_out_of_the_written_files(tmp_path, tied_models):
    m = tied_models
    config = tmp_path / "graft.yml"
    config.write_text(graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 1.0)], lam=0.5))
    assert run_cli("mergekit-yaml", str(config), str(tmp_path / "out")).returncode == 0
    assert (tmp_path / "out" / "mergekit_config.yml").read_text() == config.read_text()
    assert merge_method.RUN_PARAMETER not in (tmp_path / "out" / "README.md").read_text()


def test_a_run_id_cannot_be_given(tmp_path, tied_models):
    m = tied_models
    config = tmp_path / "graft.yml"
    config.write_text(graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 1.0)], extra_global="  graft_run: x\n"))
    assert "unknown graft parameter(s) graft_run" in error_line(run_cli("mergekit-yaml", str(config),
                                                                        str(tmp_path / "out")))
    models = [read_model(m[key]) for key in ("post", "donor", "donor_ft")]
    with pytest.raises(GraftError, match="graft_run is set by graftmerge itself"):
        merge_state_dicts(models, "graft", base=0, parameters={"graft_run": "x"})


def test_a_tensor_outside_a_merge_is_refused(tied_models):
    """mergekit's task for a model-folder input, run without a graft merge around it (say by a script that
    plans its own tasks): one GraftError, not a graft from inputs nobody validated."""
    tensors = [torch.zeros(2, 2), torch.ones(2, 2), torch.ones(2, 2)]
    ids = [ModelReference.parse(str(tied_models[key])) for key in ("post", "donor", "donor_ft")]
    group = TensorGroup.from_tensors(tensors, ids=ids, base_index=0, name="w")
    roles = {ids[1]: "donor", ids[2]: "donor_ft"}
    with pytest.raises(GraftError, match="outside a graft merge"):
        merge_method.graft_merge_method.merge_group(group, role=roles, weight={ids[2]: 1.0}, graft_run=None)
