"""``merge_method: fisher`` and ``regmean`` through the stock mergekit-yaml, against dense float64 formulas.

Three architectures (Qwen3 with a tied head, Llama untied, GPT-2 with Conv1D weights stored
in × out), three models each, caches of kind both (tests/helpers/data_aware.py); the merges
run mergekit-yaml's own click command in this process, one merge a real subprocess.
"""

from __future__ import annotations

import pytest
import torch

from graftmerge.formats.fisher_cache import open_fisher_cache
from tests.helpers.data_aware import (
    ARCHITECTURES,
    config,
    dense_fisher,
    dense_regmean,
    input_side,
    make_models,
    write_both_cache,
)
from tests.helpers.models import read_model, tree_digest
from tests.helpers.runners import cli, mergekit_yaml_model, run_process

WEIGHTS = [1.0, 2.0, 0.5]


def zero_some(index: int):
    """Model 0's Fisher is zero on the first half of every tensor's entries, model 1's on the first quarter:
    a quarter of all coordinates has no Fisher in two of three models."""
    def zero(name, diagonal):
        flat = diagonal.reshape(-1)
        if index < 2:
            flat[: flat.numel() // (2 if index == 0 else 4)] = 0
        return diagonal
    return zero


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def inputs(request, tmp_path_factory):
    """(architecture key, model folders, cache folders, written factors, state dicts, diagonals)."""
    root = tmp_path_factory.mktemp(request.param)
    models = make_models(root, request.param)
    caches, factors = [], []
    for index, model in enumerate(models):
        caches.append(root / f"fisher{index}")
        factors.append(write_both_cache(caches[-1], model, seed=100 + index, zero=zero_some(index)))
    states = [read_model(m) for m in models]
    diagonals = [{name: open_fisher_cache(c).diagonal(name) for name in states[0]} for c in caches]
    digests = [tree_digest(m) for m in models] + [tree_digest(c) for c in caches]
    yield request.param, models, caches, factors, states, diagonals
    assert [tree_digest(m) for m in models] + [tree_digest(c) for c in caches] == digests  # inputs untouched


def assert_close(got: dict, expected: dict, rtol: float) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        scale = float(expected[name].abs().max())
        error = float((got[name].double() - expected[name]).abs().max())
        assert error <= rtol * scale, (name, error, scale)


MERGES = {"fisher": ("fisher", {}), "regmean-1": ("regmean", {"alpha": 1.0}),
          "regmean-0.5": ("regmean", {"alpha": 0.5})}


@pytest.fixture(scope="module")
def merged(inputs, tmp_path_factory):
    """Each merge of MERGES through mergekit-yaml, once per architecture: name → its tensors."""
    key, models, caches, *_ = inputs
    root = tmp_path_factory.mktemp(f"merged-{key}")
    return {label: mergekit_yaml_model(root, config(method, models, caches, WEIGHTS, **extra), label)
            for label, (method, extra) in MERGES.items()}


def test_fisher_equals_the_dense_formula(inputs, merged):
    key, models, caches, _, states, diagonals = inputs
    got = merged["fisher"]
    assert_close(got, dense_fisher(states, diagonals, WEIGHTS, 1e-30), rtol=2e-6)
    # where models 0 and 1 have no Fisher, model 2 alone decides
    name = next(n for n in states[0] if states[0][n].numel() > 8)
    quarter = states[0][name].numel() // 4
    assert torch.allclose(got[name].reshape(-1)[:quarter], states[2][name].reshape(-1)[:quarter], atol=1e-7)


def test_fisher_falls_back_to_the_plain_average_where_no_model_has_fisher(tmp_path, inputs):
    """ε = 0 and a coordinate whose Fisher is zero in every model: the weighted average there, exactly as the
    formula says, not 0/0."""
    key, models, caches, _, states, _ = inputs
    root = tmp_path / "caches"
    zeroed = []
    for index, model in enumerate(models):
        zeroed.append(root / f"z{index}")
        write_both_cache(zeroed[-1], model, seed=7 + index, zero=zero_some(0), only_diagonal=True)
    got = mergekit_yaml_model(tmp_path, config("fisher", models, zeroed, WEIGHTS, epsilon=0.0), "fallback")
    for name, tensor in got.items():
        half = tensor.numel() // 2
        plain = sum(w * s[name].double().reshape(-1)[:half] for w, s in zip(WEIGHTS, states)) / sum(WEIGHTS)
        assert torch.allclose(tensor.reshape(-1)[:half].double(), plain, rtol=1e-6, atol=1e-7), name
        assert torch.isfinite(tensor).all()


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_regmean_equals_the_dense_formula(inputs, merged, alpha):
    key, models, caches, factors, states, _ = inputs
    got = merged[f"regmean-{alpha:g}"]
    architecture = ARCHITECTURES[key][0]
    expected = dense_regmean(architecture, states, factors, WEIGHTS, alpha)
    assert_close(got, expected, rtol=1e-5)
    solved = [n for n in states[0] if n in factors[0] and input_side(architecture, n)]
    assert solved and any("embed" in n or "wte" in n for n in factors[0])  # embeddings had KFAC, and were averaged
    average = sum(w * s[solved[0]].double() for w, s in zip(WEIGHTS, states)) / sum(WEIGHTS)
    assert float((got[solved[0]].double() - average).abs().max()) > 1e-3  # the solve did something


def test_regmean_is_the_least_squares_merge_of_the_layers_outputs():
    """RegMean's defining property, from activations: with G_i = X_iᵀX_i (α = 1), W minimises
    Σ_i ‖X_i Wᵀ − X_i W_iᵀ‖², so the gradient Σ_i X_iᵀ X_i (W − W_i)ᵀ vanishes; for both layouts."""
    from graftmerge.math.regmean import regmean_solve

    generator = torch.Generator().manual_seed(0)
    activations = [torch.randn(40, 6, generator=generator, dtype=torch.float64) for _ in range(3)]
    weights = [torch.randn(5, 6, generator=generator, dtype=torch.float64) for _ in range(3)]  # Linear: out × in
    sides = []
    for x in activations:
        values, vectors = torch.linalg.eigh(x.T @ x)
        sides.append((vectors, values))
    merged_t = regmean_solve([w.T for w in weights], sides, [1.0, 1.0, 1.0], alpha=1.0)  # input-first
    gradient = sum(x.T @ x @ (merged_t - w.T) for x, w in zip(activations, weights))
    assert float(gradient.abs().max()) < 1e-9
    # α = 0: the Gram's diagonal only, i.e. each input column weighted by its own energy
    diag_t = regmean_solve([w.T for w in weights], sides, [1.0, 1.0, 1.0], alpha=0.0)
    energy = [(x * x).sum(0) for x in activations]
    expected = sum(e[:, None] * w.T for e, w in zip(energy, weights)) / sum(energy)[:, None]
    assert torch.allclose(diag_t, expected, rtol=1e-12, atol=1e-12)


def test_the_state_dict_api_is_bit_for_bit_the_cli(inputs, merged):
    from mergekit.merge_methods.api import merge_state_dicts

    key, models, caches, _, states, _ = inputs
    ids = ["a", "b", "c"]
    for label in ("fisher", "regmean-0.5"):
        method, extra = MERGES[label]
        parameters = {"fisher": dict(zip(ids, map(str, caches))), "weight": dict(zip(ids, WEIGHTS)), **extra}
        if method == "regmean":
            parameters["model_config"] = str(models[0])
        result = merge_state_dicts(dict(zip(ids, states)), method, parameters=parameters, dtype=torch.float32)
        assert result.keys() == merged[label].keys()
        for name in result:
            assert torch.equal(result[name], merged[label][name]), (method, name)


@pytest.mark.parametrize("inputs", ["gpt2"], indirect=True)  # one architecture is enough for the process path
def test_graftmerge_merge_and_a_real_mergekit_yaml_process(tmp_path, inputs):
    """The .pth hook registers both methods in a fresh interpreter; ``graftmerge merge`` is the same merge."""
    key, models, caches, _, _, _ = inputs
    text = config("regmean", models, caches, WEIGHTS, alpha=0.9)
    (tmp_path / "c.yml").write_text(text)
    process = run_process("mergekit-yaml", str(tmp_path / "c.yml"), str(tmp_path / "process"))
    assert process.returncode == 0, process.stderr[-3000:]
    assert "regmean: " in process.stderr and "linear weights solved" in process.stderr
    result = cli("merge", str(tmp_path / "c.yml"), str(tmp_path / "cli"))
    assert result.exit_code == 0, result.output
    first, second = read_model(tmp_path / "process"), read_model(tmp_path / "cli")
    assert all(torch.equal(first[n], second[n]) for n in first)
    assert_card(tmp_path / "process", "RegMean", "α = 0.9", caches)


def assert_card(folder, method_words: str, setting: str, caches) -> None:
    """Our card, parsed by huggingface_hub: a merge, its formula with its setting, every input's cache."""
    from huggingface_hub import ModelCard

    card = ModelCard.load(folder / "README.md")
    assert method_words in card.text and setting in card.text
    for cache in caches:
        assert str(cache) in card.text, cache
    assert card.data.base_model is None  # local folders only: not in any model tree, so no relation either
    assert getattr(card.data, "base_model_relation", None) is None


@pytest.mark.parametrize("inputs", ["llama-untied"], indirect=True)  # one architecture is enough for Python
def test_run_merge_from_python(tmp_path, inputs):
    import yaml
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    key, models, caches, _, states, diagonals = inputs
    parsed = MergeConfiguration.model_validate(yaml.safe_load(config("fisher", models, caches, WEIGHTS)))
    run_merge(parsed, str(tmp_path / "py"), options=MergeOptions(quiet=True))
    assert_close(read_model(tmp_path / "py"), dense_fisher(states, diagonals, WEIGHTS, 1e-30), rtol=2e-6)
    assert_card(tmp_path / "py", "Fisher merging", "ε = 1e-30", caches)


def test_stock_mergekit_knows_both_methods():
    code = ("from mergekit import merge_methods; "
            "print(merge_methods.get('fisher').spec.pretty_name, '|', merge_methods.get('regmean').spec.pretty_name)")
    result = run_process("python", "-c", code)
    assert result.returncode == 0 and result.stdout.strip() == "Fisher merging | RegMean", result.stderr


def test_regmean_with_caches_from_the_real_estimator(tmp_path):
    """Caches from ``graftmerge fisher estimate --kind both`` on different data per model: the merge uses
    G_i = X_iᵀX_i / T_i, the token mean of each Linear layer's inputs on model i's own rollouts (taken here
    from the activations, in float64), for q/k/v/o, the MLP and the untied lm_head; the embedding is averaged."""
    from tests.helpers.estimation import brute_force_kfac, load, make_model, random_rollouts, write_jsonl

    models, caches, grams = [], [], []
    for index in range(2):
        model = make_model(tmp_path / f"m{index}", tied=False, seed=20 + index)
        rollouts = random_rollouts(5 + 3 * index, seed=index, vocab=128)
        data = write_jsonl(tmp_path / f"r{index}.jsonl", rollouts)
        result = cli("fisher", "estimate", model, "-o", tmp_path / f"f{index}", "--kind", "both", "--rollouts", data,
                     "--dtype", "float64", "--accumulator-dtype", "float64", "--no-progress")
        assert result.exit_code == 0, result.output
        reference = brute_force_kfac(load(model), rollouts)
        grams.append({f"{name}.weight": (None, entry["Q"]) for name, entry in reference.items()})
        models.append(model)
        caches.append(tmp_path / f"f{index}")
    states = [read_model(m) for m in models]
    got = mergekit_yaml_model(tmp_path, config("regmean", models, caches, [1.0, 1.0], alpha=1.0), "merged")
    linear = {n for n in grams[0] if "embed" not in n}
    assert "lm_head.weight" in linear and any("q_proj" in n for n in linear)
    expected = dense_regmean("qwen3", states, [{n: g[n] for n in linear} for g in grams], [1.0, 1.0], 1.0)
    assert_close(got, expected, rtol=1e-4)
