"""graft on several architectures mergekit knows, through stock mergekit CLIs and a
Fisher cache estimated by the real `graftmerge fisher estimate`: rho 0 against
task_arithmetic, diagonal and KFAC masks against a whole-model brute force.

The merges run through the stock `mergekit-multi` command (several merges per run, the
same `run_merge` as `mergekit-yaml`), in this process like the estimates (tests.helpers.runners.run_cli);
one of them also runs through `mergekit-yaml` and must give the same bits.

Biases, fused and transposed tensors are where masks go wrong, so Qwen2 (q/k/v biases)
and GPT-2 (Conv1D ``c_attn`` stored d_in × d_out, LayerNorm biases, learned positions)
run next to Llama and Qwen3, tied and untied.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from graftmerge.demo.tiny_models import make_graft_inputs
from graftmerge.formats.fisher_cache import open_fisher_cache
from graftmerge.pipeline.graft_plan import FineTune, GraftInputs, GraftPlan
from tests.helpers.configs import graft_yaml, task_arithmetic_yaml
from tests.helpers.estimation import (
    accumulate,
    brute_force_diagonal,
    brute_force_kfac,
    load,
    make_model,
    random_rollouts,
    relative_error,
    write_jsonl,
)
from tests.helpers.models import assert_within_one_ulp, read_model
from tests.helpers.references import BruteForceGraft, brute_force_graft
from tests.helpers.runners import run_cli

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 48, "vocab_size": 128}
CASES = [("llama", True), ("qwen3", True), ("qwen3", False), ("qwen2", False), ("gpt2", True)]
WITH_BIASES = {"qwen2", "gpt2"}
LAMBDA = 0.7
RHO = {"global": 0.01, "tensor": 0.03}
YAML_CHECK = "qwen2-untied"  # its KFAC merge also runs through `mergekit-yaml`


@dataclass
class Case:
    architecture: str
    tied: bool
    models: dict[str, Path]
    fisher: Path
    outputs: dict[str, Path]  # run name → output folder

    def brute_force(self, rho: float, scope: str, mask: str) -> BruteForceGraft:
        fine_tunes = [(self.models["donor_ft"], LAMBDA)]
        return brute_force_graft(self.models["post"], self.models["donor"], fine_tunes, self.fisher, rho, scope, mask)


def run_all(commands: dict[str, list[str]]) -> None:
    """Console scripts of this environment, one after the other, in this process."""
    for name, command in commands.items():
        result = run_cli(*command)
        assert result.returncode == 0, (name, result.stderr[-3000:])


def multi_merge_command(folder: Path, name: str, configs: dict[str, str]) -> list[str]:
    """One stock `mergekit-multi` process running many named merges: the same `run_merge` as
    `mergekit-yaml`, run once for many merges."""
    documents = [f"name: {merge}\n{config}" for merge, config in configs.items()]
    (folder / f"{name}.yml").write_text("---\n".join(documents))
    return ["mergekit-multi", str(folder / f"{name}.yml"), "--intermediate-dir", str(folder / "merges")]


def case_id(architecture: str, tied: bool) -> str:
    return f"{architecture}-{'tied' if tied else 'untied'}"


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, Case]:
    """Every architecture's models, estimated `--kind both` cache and merges, run up front:
    the estimates and the rho-0 merges, then the masked merges."""
    root = tmp_path_factory.mktemp("architectures")
    cases, estimates, unmasked, masked = {}, {}, {}, {}
    for architecture, tied in CASES:
        key = case_id(architecture, tied)
        folder = root / key
        m = make_graft_inputs(folder, seed=11, architecture=architecture, tie_word_embeddings=tied, **TINY)
        rollouts = write_jsonl(folder / "rollouts.jsonl", random_rollouts(8, seed=1, vocab=TINY["vocab_size"]))
        fisher = folder / "fisher" / "post-both"
        estimates[f"estimate-{key}"] = [
            "graftmerge", "fisher", "estimate", str(m["post"]), "-o", str(fisher), "--kind", "both",
            "--rollouts", str(rollouts), "--no-progress",
        ]  # fmt: skip
        fine_tunes = [(m["donor_ft"], LAMBDA)]
        unmasked[f"{key}-ta"] = task_arithmetic_yaml(m["post"], m["donor"], fine_tunes, "bfloat16")
        unmasked[f"{key}-rho0"] = graft_yaml(m["post"], m["donor"], fine_tunes, out_dtype="bfloat16")
        for scope in ("global", "tensor"):
            masked[f"{key}-diagonal-{scope}"] = graft_yaml(
                m["post"], m["donor"], fine_tunes, rho=RHO[scope], fisher=fisher, scope=scope, mask="diagonal"
            )
        masked[f"{key}-kfac-global"] = graft_yaml(
            m["post"], m["donor"], fine_tunes, rho=RHO["global"], fisher=fisher, mask="kfac"
        )
        runs = ("ta", "rho0", "diagonal-global", "diagonal-tensor", "kfac-global")
        cases[key] = Case(architecture, tied, m, fisher, {run: root / "merges" / f"{key}-{run}" for run in runs})
    run_all({**estimates, "unmasked": multi_merge_command(root, "unmasked", unmasked)})
    yaml_config = root / "yaml-check.yml"  # one masked merge through `mergekit-yaml` as well
    yaml_config.write_text(masked[f"{YAML_CHECK}-kfac-global"])
    yaml_run = ["mergekit-yaml", str(yaml_config), str(root / "yaml-check")]
    run_all({"masked": multi_merge_command(root, "masked", masked), "yaml": yaml_run})
    cases[YAML_CHECK].outputs["mergekit-yaml kfac-global"] = root / "yaml-check"
    return cases


@pytest.fixture(params=CASES, ids=[case_id(*c) for c in CASES])
def case(request, cases) -> Case:
    return cases[case_id(*request.param)]


def test_mergekit_multi_equals_mergekit_yaml(cases):
    """The merges below run in `mergekit-multi`; one of them through `mergekit-yaml` is identical."""
    outputs = cases[YAML_CHECK].outputs
    multi, single = read_model(outputs["kfac-global"]), read_model(outputs["mergekit-yaml kfac-global"])
    assert multi.keys() == single.keys()
    assert all(torch.equal(multi[name], single[name]) for name in multi)


def biases(names) -> list[str]:
    return sorted(n for n in names if n.endswith(".bias"))


def test_rho_zero_equals_task_arithmetic(case):
    graft, ta = read_model(case.outputs["rho0"]), read_model(case.outputs["ta"])
    post = read_model(case.models["post"])
    assert graft.keys() == post.keys()
    assert ("lm_head.weight" in graft) != case.tied
    assert_within_one_ulp(graft, ta)
    config = json.loads((case.outputs["rho0"] / "config.json").read_text())
    assert config["model_type"] == case.architecture and config["tie_word_embeddings"] is case.tied


def expected_kfac_names(case: Case, names: list[str]) -> set[str]:
    """Weights of nn.Linear / untied nn.Embedding modules; GPT-2's Conv1D weights are not Linear."""
    embedding = "transformer.wte.weight" if case.architecture == "gpt2" else "model.embed_tokens.weight"
    untied = set() if case.tied else {embedding, "lm_head.weight"}
    if case.architecture == "gpt2":
        return {"transformer.wpe.weight"} | untied
    return {n for n in names if n.endswith("_proj.weight")} | untied


def test_estimated_cache_scores_biases_diagonally_in_the_ranking(case):
    """Every tensor has a diagonal; biases only a diagonal, and they are ranked under either mask."""
    post = read_model(case.models["post"])
    fisher = open_fisher_cache(case.fisher)
    assert set(fisher.names("diagonal")) == set(post)
    assert set(fisher.names("kfac")) == expected_kfac_names(case, list(post))
    bias_names = biases(post)
    assert bool(bias_names) == (case.architecture in WITH_BIASES)
    for name in bias_names:
        assert fisher.representation(name) == "diagonal" and not fisher.has(name, "kfac")
        assert fisher.diagonal(name).shape == post[name].shape
        assert float(fisher.diagonal(name).sum()) > 0, name
    for mask in ("diagonal", "kfac"):
        plan = GraftPlan(str(case.models["post"]), str(case.models["donor"]),
                         (FineTune(str(case.models["donor_ft"]), LAMBDA),),
                         rho=0.01, fisher=str(case.fisher), mask=mask)  # fmt: skip
        inputs = GraftInputs.open(plan)
        assert inputs.ranked_names() == sorted(post)
        assert all(inputs.fisher_kind(name) == "diagonal" for name in bias_names)


def check_against_brute_force(case: Case, run: str, expected: BruteForceGraft, exact: bool) -> None:
    got, post = read_model(case.outputs[run]), read_model(case.models["post"])
    assert got.keys() == expected.expected.keys()
    for name, tensor in expected.expected.items():
        if exact or expected.kinds.get(name) != "kfac":
            assert torch.equal(got[name], tensor), (run, name)
        else:  # same masked pairs ⇒ equal up to matmul rounding; another set moves whole directions
            assert torch.allclose(got[name], tensor, atol=1e-6, rtol=0), (run, name)
    assert sum(int(mask.sum()) for mask in expected.masks.values()) > 0
    masked_biases = 0
    for name in biases(got):
        mask = expected.masks[name]
        masked_biases += int(mask.sum())
        assert torch.equal(got[name][mask], post[name][mask]), name  # masked: exactly zero delta
        assert not torch.equal(got[name][~mask], post[name][~mask]), name  # the rest grafted
    if case.architecture in WITH_BIASES:  # the bias checks above saw masked coordinates
        assert masked_biases > 0


@pytest.mark.parametrize("scope", ["global", "tensor"])
def test_diagonal_mask_equals_brute_force(case, scope):
    expected = case.brute_force(RHO[scope], scope, "diagonal")
    assert set(expected.kinds.values()) == {"diagonal"}
    check_against_brute_force(case, f"diagonal-{scope}", expected, exact=True)


def test_kfac_mask_equals_brute_force(case):
    expected = case.brute_force(RHO["global"], "global", "kfac")
    assert {n for n, kind in expected.kinds.items() if kind == "kfac"} == set(
        open_fisher_cache(case.fisher).names("kfac")
    )
    check_against_brute_force(case, "kfac-global", expected, exact=False)
    post, got = read_model(case.models["post"]), read_model(case.outputs["kfac-global"])
    for name, mask in expected.masks.items():  # a masked KFAC pair changes its weight
        if expected.kinds[name] == "kfac" and bool(mask.any()):
            delta = read_model(case.models["donor_ft"])[name] - read_model(case.models["donor"])[name]
            assert not torch.allclose(got[name] - post[name], LAMBDA * delta, atol=1e-6), name


@pytest.mark.parametrize("architecture", ["qwen2", "gpt2"])
def test_estimator_bias_fisher_equals_per_sequence_autograd(tmp_path, architecture):
    """Linear biases (Qwen2) and LayerNorm / Conv1D biases (GPT-2): Σ_n (∇L_n)² and KFAC sums exact."""
    model = load(make_model(tmp_path / "post", tied=False, architecture=architecture))
    rollouts = random_rollouts(5, seed=4)
    diagonal_reference = brute_force_diagonal(model, rollouts)
    diagonal, kfac = accumulate(model, rollouts, 3, kind="both", max_chunk_elements=300)
    bias_names = biases(diagonal)
    assert len(bias_names) >= 6
    assert set(diagonal) == set(diagonal_reference)
    for name, value in diagonal.items():
        assert relative_error(value, diagonal_reference[name]) < 1e-10, name
    kfac_reference = brute_force_kfac(model, rollouts)
    assert kfac and set(bias_names).isdisjoint(kfac)
    for name, (P, Q) in kfac.items():
        reference = kfac_reference[name.removesuffix(".weight")]
        reference_P = reference["P"]
        if P.ndim == 1 and reference_P.ndim == 2:  # lm_head: vocabulary side kept diagonal
            reference_P = reference_P.diagonal()
        assert relative_error(P, reference_P) < 1e-10, name
        assert relative_error(Q, reference["Q"]) < 1e-10, name
    # --kind kfac: the bias of a Linear with KFAC factors keeps its diagonal
    diagonal_only, _ = accumulate(model, rollouts, 3, kind="kfac")
    for name in bias_names:
        assert relative_error(diagonal_only[name], diagonal_reference[name]) < 1e-10, name
