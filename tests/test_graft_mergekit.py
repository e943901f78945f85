"""`graft` through the real, unmodified mergekit-yaml, against task_arithmetic and brute force.

Merges run mergekit-yaml's own click command in this process (tests.helpers.runners.run_cli); the tests
about the process itself (the .pth hook, start-up imports, the console script) run real
subprocesses (tests.helpers.runners.run_process); the threshold cache between runs, two real
processes forked past their imports (tests.helpers.warm_processes).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from graftmerge.formats.fisher_cache import open_fisher_cache
from tests.helpers.configs import graft_yaml, task_arithmetic_yaml
from tests.helpers.fisher_caches import write_diagonal_cache, write_mixed_cache
from tests.helpers.models import assert_within_one_ulp, read_model
from tests.helpers.references import brute_force_graft
from tests.helpers.runners import run_cli, run_process


def merge(tmp_path: Path, config: str, name: str = "out", *extra: str, tool=("mergekit-yaml",)) -> Path:
    file = tmp_path / f"{name}.yml"
    file.write_text(config)
    out = tmp_path / name
    result = run_cli(*tool, str(file), str(out), *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_stock_mergekit_knows_graft():
    code = "from mergekit import merge_methods; print(merge_methods.get('graft').spec.pretty_name)"
    result = run_process("python", "-c", code)
    assert result.returncode == 0 and result.stdout.strip() == "Graft", result.stderr


def test_registering_twice_is_harmless():
    from graftmerge.adapter import import_hook
    from graftmerge.adapter.registration import register_methods

    import_hook.install()
    import_hook.install()
    from mergekit import merge_methods

    register_methods()
    register_methods()
    names = [m.spec.name for m in merge_methods.registered_methods()]
    assert [names.count(name) for name in ("graft", "fisher", "regmean")] == [1, 1, 1]


def test_interpreter_startup_imports_nothing_heavy():
    code = "import sys; print(sorted(m for m in sys.modules if m.startswith(('torch', 'mergekit', 'graftmerge.'))))"
    result = run_process("python", "-c", code)
    assert result.stdout.strip() == "['graftmerge.adapter', 'graftmerge.adapter.import_hook']", result.stdout


@pytest.mark.parametrize("out_dtype", ["bfloat16", "float16"])
def test_rho_zero_equals_task_arithmetic(tmp_path, tied_models, out_dtype):
    m = tied_models
    fine_tunes = [(m["donor_ft"], 0.7)]
    graft = merge(tmp_path, graft_yaml(m["post"], m["donor"], fine_tunes, out_dtype=out_dtype), "graft")
    ta = merge(tmp_path, task_arithmetic_yaml(m["post"], m["donor"], fine_tunes, out_dtype), "ta")
    assert_within_one_ulp(read_model(graft), read_model(ta))
    assert json.loads((graft / "config.json").read_text())["tie_word_embeddings"] is True


def test_rho_zero_float32_differs_from_task_arithmetic_only_by_its_rounding(tmp_path, tied_models):
    """task_arithmetic rounds donor + (post − donor) + λ(ft − donor); graft adds λΔ to post."""
    m = tied_models
    graft = read_model(merge(tmp_path, graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 0.7)]), "graft"))
    ta = read_model(
        merge(tmp_path, task_arithmetic_yaml(m["post"], m["donor"], [(m["donor_ft"], 0.7)], "float32"), "ta")
    )
    inputs = [read_model(m[key]) for key in ("donor", "post", "donor_ft")]
    for name in graft:
        scale = torch.stack([graft[name].abs()] + [x[name].abs() for x in inputs]).amax(0)
        assert bool(((graft[name] - ta[name]).abs() <= 4 * torch.finfo(torch.float32).eps * scale).all()), name


def test_multi_delta_equals_task_arithmetic(tmp_path, tied_models):
    m = tied_models
    fine_tunes = [(m["donor_ft"], 0.5), (m["donor_ft2"], -0.25)]
    graft = merge(tmp_path, graft_yaml(m["post"], m["donor"], fine_tunes, lam=2.0, out_dtype="bfloat16"), "graft")
    doubled = [(p, 2.0 * w) for p, w in fine_tunes]
    ta = merge(tmp_path, task_arithmetic_yaml(m["post"], m["donor"], doubled, "bfloat16"), "ta")
    assert_within_one_ulp(read_model(graft), read_model(ta))


def test_untied_model_rho_zero_equals_task_arithmetic(tmp_path, untied_models):
    m = untied_models
    graft = merge(tmp_path, graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 1.0)], out_dtype="bfloat16"), "g")
    ta = merge(tmp_path, task_arithmetic_yaml(m["post"], m["donor"], [(m["donor_ft"], 1.0)], "bfloat16"), "t")
    outputs = read_model(graft)
    assert "lm_head.weight" in outputs
    assert_within_one_ulp(outputs, read_model(ta))


def quantized_inputs(root: Path, post: Path, seed: int = 0) -> dict[str, Path]:
    """Donor/fine-tune whose deltas are exact multiples of 1/4: scores tie massively."""
    generator = torch.Generator().manual_seed(seed)
    weights = read_model(post)
    paths = {}
    for role, make in {
        "donor": lambda t: torch.round(t * 64) / 64,
        "donor_ft": lambda t: torch.round(t * 64) / 64 + torch.randint(-2, 3, t.shape, generator=generator) / 4,
    }.items():
        folder = root / role
        folder.mkdir()
        (folder / "config.json").write_text((post / "config.json").read_text())
        save_file({n: make(t.float()).contiguous() for n, t in weights.items()}, str(folder / "model.safetensors"))
        paths[role] = folder
    return paths


@pytest.mark.parametrize("scope", ["global", "tensor"])
def test_diagonal_mask_equals_brute_force_with_ties(tmp_path, tied_models, scope):
    post = tied_models["post"]
    inputs = quantized_inputs(tmp_path, post)
    generator = torch.Generator().manual_seed(1)
    fisher = write_diagonal_cache(
        tmp_path / "fisher-ties", post,
        transform=lambda n, v: torch.randint(0, 3, v.shape, generator=generator).float(),
    )
    fine_tunes = [(inputs["donor_ft"], 0.5)]
    for rho in (0.003, 0.05, 0.3):
        out = merge(tmp_path, graft_yaml(post, inputs["donor"], fine_tunes, rho=rho, fisher=fisher, scope=scope),
                    f"out-{rho}")
        expected = brute_force_graft(post, inputs["donor"], fine_tunes, fisher, rho, scope).expected
        got = read_model(out)
        for name in expected:
            assert torch.equal(got[name], expected[name]), (rho, name)


def test_global_mask_on_continuous_scores_equals_brute_force(tmp_path, tied_models, tied_diag_cache):
    m = tied_models
    fine_tunes = [(m["donor_ft"], 0.5), (m["donor_ft2"], 1.0)]
    out = merge(tmp_path, graft_yaml(m["post"], m["donor"], fine_tunes, rho=0.01, fisher=tied_diag_cache))
    expected = brute_force_graft(m["post"], m["donor"], fine_tunes, tied_diag_cache, 0.01, "global").expected
    got = read_model(out)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_threshold_pass_is_cached_between_runs(tmp_path, tied_models, tied_diag_cache, warm_mergekit_yaml):
    """Two real `mergekit-yaml` processes (forked from a warm parent that never merged: nothing shared
    in memory): the second reads the first one's threshold from disk."""
    m = tied_models
    config = graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 0.3)], rho=0.02, fisher=tied_diag_cache)
    (tmp_path / "g.yml").write_text(config)
    first = warm_mergekit_yaml.run(str(tmp_path / "g.yml"), str(tmp_path / "a"))
    second = warm_mergekit_yaml.run(str(tmp_path / "g.yml"), str(tmp_path / "b"))
    assert first.returncode == second.returncode == 0, second.stderr
    assert "graft threshold: scoring" in first.stderr
    assert "graft threshold" not in second.stderr
    assert all(
        torch.equal(x, y) for x, y in zip(read_model(tmp_path / "a").values(), read_model(tmp_path / "b").values())
    )


def test_graftmerge_merge_equals_mergekit_yaml(tmp_path, tied_models, tied_diag_cache):
    m = tied_models
    config = graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 0.5)], rho=0.05, fisher=tied_diag_cache, scope="tensor")
    a = merge(tmp_path, config, "a")
    b = merge(tmp_path, config, "b", "--out-shard-size", "20K", tool=("graftmerge", "merge"))
    assert len(list(b.glob("*.safetensors"))) > 1  # mergekit options pass through
    a_w, b_w = read_model(a), read_model(b)
    assert all(torch.equal(a_w[n], b_w[n]) for n in a_w)


def test_rho_zero_leaves_delta_bit_for_bit(tmp_path, tied_models, tied_diag_cache):
    """ρ = 0 with a cache given: exactly θpost + Δ in float32."""
    m = tied_models
    out = merge(tmp_path, graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 0.5)], rho=0.0, fisher=tied_diag_cache))
    post, donor, ft = read_model(m["post"]), read_model(m["donor"]), read_model(m["donor_ft"])
    for name, tensor in read_model(out).items():
        assert torch.equal(tensor, post[name] + 0.5 * (ft[name] - donor[name]))


def test_retention_cost_non_increasing_in_rho(tmp_path, tied_models, tied_diag_cache):
    m = tied_models
    cache = open_fisher_cache(tied_diag_cache)
    post = read_model(m["post"])
    costs = []
    for rho in (0.0, 0.001, 0.01, 0.1, 0.5):
        out = read_model(merge(tmp_path, graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 1.0)], rho=rho,
                                                     fisher=tied_diag_cache), f"r{rho}"))
        costs.append(sum(float((cache.diagonal(n) * (out[n] - post[n]).square()).sum()) for n in post))
    assert all(a >= b for a, b in zip(costs, costs[1:])), costs
    assert costs[-1] < costs[0]


def test_help_teaches():
    result = run_process("graftmerge", "--help")  # the console script itself
    assert result.returncode == 0 and "merge" in result.stdout and "fisher" in result.stdout


if sys.platform == "linux":
    def test_hook_is_installed_in_site_packages():
        import site

        assert any(os.path.exists(os.path.join(p, "graftmerge_hook.pth")) for p in site.getsitepackages())


def test_example_configs_run_as_written(tmp_path, tied_models):
    """Every merge_configs/*.yml runs through mergekit-yaml next to the folders it names."""

    m = tied_models
    for link, target in (
        ("post", m["post"]),
        ("base", m["donor"]),
        ("base-ft", m["donor_ft"]),
        ("base-ft2", m["donor_ft2"]),
    ):
        (tmp_path / link).symlink_to(target)
    write_diagonal_cache(tmp_path / "fisher" / "post-diag", m["post"])
    write_mixed_cache(tmp_path / "fisher" / "post-kfac", m["post"])
    configs = sorted((Path(__file__).parent.parent / "merge_configs").glob("*.yml"))
    assert len(configs) >= 3
    for config in configs:
        result = run_cli("mergekit-yaml", str(config), str(tmp_path / f"out-{config.stem}"), cwd=tmp_path)
        assert result.returncode == 0, (config.name, result.stderr[-2000:])
        assert read_model(tmp_path / f"out-{config.stem}").keys() == read_model(m["post"]).keys()


def test_kernel_uses_the_validated_plan_and_one_threshold_pass(tmp_path, tied_models, tied_diag_cache, monkeypatch):
    """In-process mergekit-yaml: one threshold pass per merge; the kernel reuses it."""
    from click.testing import CliRunner
    from mergekit.scripts.run_yaml import main

    import graftmerge.pipeline.threshold_pass as threshold_pass
    from graftmerge.adapter import import_hook

    import_hook.install()
    calls = []
    original = threshold_pass.compute_global_threshold
    monkeypatch.setattr(
        threshold_pass, "compute_global_threshold", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    monkeypatch.setenv("GRAFTMERGE_CACHE_DIR", str(tmp_path / "threshold-cache"))
    m = tied_models
    config = tmp_path / "g.yml"
    config.write_text(graft_yaml(m["post"], m["donor"], [(m["donor_ft"], 0.25)], rho=0.03, fisher=tied_diag_cache,
                                 dtype="bfloat16"))
    result = CliRunner().invoke(main, [str(config), str(tmp_path / "out")])
    assert result.exit_code == 0, result.output[-2000:]
    assert len(calls) == 1
