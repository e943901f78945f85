"""graft through mergekit's Python API: ``merge_state_dicts``, ``merge_tensors``, ``run_merge``.

Every result is compared bit for bit with the stock ``mergekit-yaml`` on the same inputs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mergekit.merge_methods import merge_state_dicts, merge_tensors

from graftmerge.errors import GraftError
from tests.helpers.configs import graft_yaml
from tests.helpers.fisher_caches import write_mixed_cache
from tests.helpers.models import assert_identical, read_model
from tests.helpers.runners import mergekit_yaml_model


@pytest.fixture(scope="module")
def mixed_cache(tied_models, tmp_path_factory) -> Path:
    return write_mixed_cache(tmp_path_factory.mktemp("api-fisher") / "mixed", tied_models["post"])


@pytest.mark.parametrize(
    "rho,scope,cache",
    [(0.0, "global", None), (0.02, "global", "diag"), (0.05, "tensor", "diag"), (0.01, "global", "mixed"),
     (0.03, "tensor", "mixed")],
)
def test_merge_state_dicts_equals_mergekit_yaml(tmp_path, tied_models, tied_diag_cache, mixed_cache, rho, scope, cache):
    m = tied_models
    fisher = {"diag": tied_diag_cache, "mixed": mixed_cache, None: None}[cache]
    fine_tunes = [(m["donor_ft"], 0.5), (m["donor_ft2"], 1.5)]
    expected = mergekit_yaml_model(
        tmp_path, graft_yaml(m["post"], m["donor"], fine_tunes, rho=rho, fisher=fisher, scope=scope, lam=0.8,
                             out_dtype="bfloat16"), "yaml"
    )
    parameters = {"weight": [1.0, 0.5, 1.5], "lambda": 0.8, "rho": rho, "rho_scope": scope}
    if fisher:
        parameters["fisher"] = str(fisher)
    got = merge_state_dicts(
        [read_model(m[key]) for key in ("post", "donor", "donor_ft", "donor_ft2")],  # roles by position
        "graft", base=0, parameters=parameters, dtype=torch.float32, out_dtype=torch.bfloat16,
    )
    assert_identical(got, expected)


def test_named_inputs_with_explicit_roles_in_any_order(tmp_path, tied_models, tied_diag_cache):
    m = tied_models
    expected = mergekit_yaml_model(
        tmp_path, graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 0.7)], rho=0.01, fisher=tied_diag_cache), "yaml"
    )
    models = {"ft": read_model(m["donor_ft"]), "post": read_model(m["post"]), "base": read_model(m["donor"])}
    got = merge_state_dicts(
        models, "graft", base="post", dtype=torch.float32,
        parameters={"role": {"ft": "donor_ft", "base": "donor"}, "weight": {"ft": 0.7, "base": 1.0},
                    "rho": 0.01, "fisher": str(tied_diag_cache)},
    )
    assert_identical(got, expected)


def test_modules_work_as_inputs(tied_models):
    """mergekit accepts nn.Modules; graft at ρ = 0 is θpost + λ(θft − θdonor) on each parameter."""
    from transformers import AutoModelForCausalLM

    post, donor, ft = (AutoModelForCausalLM.from_pretrained(tied_models[k]) for k in ("post", "donor", "donor_ft"))
    with torch.no_grad():
        merged = merge_state_dicts([post, donor, ft], "graft", base=0, parameters={"lambda": 0.5})
    for name, parameter in post.state_dict().items():
        expected = parameter + 0.5 * (ft.state_dict()[name] - donor.state_dict()[name])
        torch.testing.assert_close(merged[name], expected, rtol=0, atol=1e-6)


def test_run_merge_from_python_equals_mergekit_yaml(tmp_path, tied_models, mixed_cache):
    import yaml
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    m = tied_models
    config = graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 0.5)], rho=0.01, fisher=mixed_cache)
    expected = mergekit_yaml_model(tmp_path, config, "yaml")
    run_merge(MergeConfiguration.model_validate(yaml.safe_load(config)), str(tmp_path / "py"),
              options=MergeOptions(quiet=True))
    assert_identical(read_model(tmp_path / "py"), expected)
    bad = MergeConfiguration.model_validate(yaml.safe_load(config.replace("role: donor}", "role: teacher}")))
    with pytest.raises(GraftError, match="unknown role 'teacher'"):
        run_merge(bad, str(tmp_path / "bad"), options=MergeOptions(quiet=True))
    assert not (tmp_path / "bad").exists()


def test_strided_inputs_are_neither_mutated_nor_ranked_differently(tied_diag_cache, tied_models):
    """mergekit's own contract (its regression suite checks it for every method), with a mask too."""
    models = [read_model(tied_models[k]) for k in ("post", "donor", "donor_ft")]
    name = "model.layers.0.mlp.up_proj.weight"
    strided = [{n: (t.T.contiguous().T if t.ndim == 2 else t) for n, t in sd.items()} for sd in models]
    assert not strided[0][name].is_contiguous()
    copies = [{n: t.clone() for n, t in sd.items()} for sd in strided]
    parameters = {"rho": 0.02, "fisher": str(tied_diag_cache)}
    expected = merge_state_dicts(models, "graft", base=0, parameters=parameters)
    got = merge_state_dicts(strided, "graft", base=0, parameters=parameters)
    assert_identical(got, expected)
    for sd, before in zip(strided, copies):
        assert all(torch.equal(sd[n], before[n]) for n in sd)


def test_gradients_flow_at_rho_zero():
    post, donor, ft = (torch.randn(3, 2, requires_grad=True) for _ in range(3))
    merged = merge_tensors([post, donor, ft], "graft", base_index=0, parameters={"lambda": 0.25})
    merged.sum().backward()
    assert torch.equal(ft.grad, torch.full_like(ft, 0.25))
    assert torch.equal(donor.grad, torch.full_like(donor, -0.25))
    assert torch.equal(post.grad, torch.ones_like(post))


def _three(shape=(2, 3)) -> list[dict[str, torch.Tensor]]:
    return [{"w": torch.randn(shape)} for _ in range(3)]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"base": None}, "graft needs a base input"),
        ({"parameters": {"role": ["donor", ""]}}, r"input\(s\) 2 have no role while others do"),
        ({"parameters": {"role": ["donor", "donor"]}}, r"duplicate role donor \(2 inputs\)"),
        ({"parameters": {"role": ["donor_ft", "donor_ft"]}}, "donor_ft given without a donor"),
        ({"parameters": {"role": ["donor", "teacher"]}}, "unknown role 'teacher'"),
        ({"parameters": {"rho": 0.1}}, "rho > 0 needs `fisher:"),
        ({"parameters": {"rho": 1.5, "fisher": "x"}}, r"rho must be in \[0, 1\)"),
        ({"parameters": {"lambda": float("nan")}}, "lambda must be a finite number"),
        ({"parameters": {"rho_scope": "layer"}}, "rho_scope must be one of global, tensor"),
        ({"parameters": {"rho": 0.1, "fisher": "/nonexistent/cache"}}, "/nonexistent/cache"),
    ],
)
def test_bad_in_memory_inputs_get_one_clear_error(kwargs, message):
    options = {"base": 0, **kwargs}
    with pytest.raises(GraftError, match=message):
        merge_state_dicts(_three(), "graft", **options)


def test_roles_missing_from_a_mapping_are_named():
    with pytest.raises(ValueError, match=r"Missing role for input\(s\): \[2\]"):  # mergekit's own binding
        merge_state_dicts(_three(), "graft", base=0, parameters={"role": {1: "donor"}})


def test_cache_for_another_model_is_refused(tied_diag_cache):
    with pytest.raises(GraftError, match="was made for another model"):
        merge_state_dicts(_three(), "graft", base=0, parameters={"rho": 0.1, "fisher": str(tied_diag_cache)})
    wrong_shape = [{"model.norm.weight": torch.randn(7)} for _ in range(3)]
    with pytest.raises(GraftError, match="'model.norm.weight' has shape"):
        merge_state_dicts(wrong_shape, "graft", base=0, parameters={"rho": 0.1, "fisher": str(tied_diag_cache)})
