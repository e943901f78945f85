"""Pre-registration 2 of `demo --lm`: balanced values, the world's tokenizer, selection, the gate, the verdicts.

Verdict cases are computed by hand: with 2 degrees of freedom Student's t has the tail
P(T > t) = ½ − t / (2 √(2 + t²)).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from pathlib import Path

import pytest
import torch

from experiments.demo.lm import ModelSize, TrainSettings, build_model, epoch_batches, score, train
from experiments.demo.lm_settings import FULL, QUICK, TINY, grid, updates
from experiments.demo.lm_tasks import world_tokenizer, write_task_files
from experiments.demo.lm_training import seed_world
from experiments.demo.lm_verdict import CHANCE, choose_point, donor_verdict, gate, interference, question, verdict
from experiments.demo.world import PHRASINGS, RELATIONS, World, balanced_values
from graftmerge.evaluation import Evaluator, load_tasks, role_scores


def _tail(t: float) -> float:
    """P(T > t) for 2 degrees of freedom, by the closed form."""
    return 0.5 - t / (2 * math.sqrt(2 + t * t))


@pytest.mark.parametrize("count", [16, 8, 13])
def test_new_values_are_dealt_evenly(count: int) -> None:
    facts = balanced_values([f"e{i}" for i in range(count)], random.Random(count))
    for relation, values in RELATIONS.items():
        dealt = Counter(facts[f"e{i}", relation] for i in range(count))
        assert set(dealt) <= set(values) and max(dealt.values()) - min(dealt.values(), default=0) <= 1
        assert sum(dealt.values()) == count and (count % 8 or len(dealt) == 8)


@pytest.mark.parametrize("seed", [0, 3])
def test_a_model_that_ignores_the_entity_scores_exactly_chance(seed: int) -> None:
    """Any answer chosen per (relation, phrasing) alone is right on exactly 1/8 of validation and of test."""
    world, splits = seed_world(FULL, seed)
    for examples in (splits.new_validation, splits.new_test):
        by_question: dict[tuple[str, int], Counter] = {}
        for example in examples:
            words = world.decode(example.ids).split()
            relation = next(r for r in RELATIONS if r in words)
            phrasing = next(i for i, p in enumerate(PHRASINGS)
                            if world.decode(example.ids[2 : example.answer_start - 1]) ==
                            p.format(r=relation, e=next(e for e in world.new if e in words)))
            by_question.setdefault((relation, phrasing), Counter())[words[-3]] += 1  # "... is VALUE . <eos>"
        for counts in by_question.values():  # every value equally often: any entity-blind guess gets 1/8
            assert len(counts) == 8 and len(set(counts.values())) == 1
        best_blind = sum(max(c.values()) for c in by_question.values()) / len(examples)
        assert best_blind == CHANCE


def test_the_world_tokenizer_renders_the_demo_chat_format_token_for_token(tmp_path: Path) -> None:
    world, splits = seed_world(TINY, 0)
    tokenizer = world_tokenizer(world)
    tasks, diagnostics = write_task_files(world, splits, tmp_path)
    evaluator = Evaluator(load_tasks(tasks), tokenizer, progress=False)
    for name, examples in (("task-a", splits.old_validation + splits.old_test),
                           ("new-facts", splits.new_validation + splits.new_test)):
        prepared = evaluator.prepared[name]
        assert len(prepared) == len(examples)
        for got, example in zip(prepared, examples):
            assert got.prompt_ids == example.ids[: example.answer_start]
            assert got.continuations == (example.ids[example.answer_start:],)
    choice = Evaluator(load_tasks(diagnostics), tokenizer, progress=False).prepared["new-facts-choice"]
    assert all(len(p.continuations) == 8 and p.continuations[p.target] == e.ids[e.answer_start:]
               for p, e in zip(choice, splits.new_validation + splits.new_test))


def test_the_evaluator_scores_the_demo_model_as_teacher_forcing_does(tmp_path: Path) -> None:
    """Greedy replies cut at the answer's length, through the chat template = teacher-forced exact match."""
    world, splits = seed_world(TINY, 0)
    tasks, _ = write_task_files(world, splits, tmp_path)
    suite = load_tasks(tasks)
    evaluator = Evaluator(suite, world_tokenizer(world), progress=False)
    torch.manual_seed(0)
    model = build_model(ModelSize(hidden_size=32, num_hidden_layers=1, intermediate_size=64), world.vocab_size, 0)
    taught = splits.old_validation[::2] + splits.new_validation[::2]  # half of validation: some right, some not
    train(model, epoch_batches(taught, 16, 0), TrainSettings(150, 1e-2))
    for split in ("validation", "test"):
        roles = role_scores(suite, evaluator.score(model, (split,)), split)
        expected = {role: score(model, getattr(splits, f"{role}_{split}")).accuracy for role in ("old", "new")}
        assert roles == expected
        if split == "validation":
            assert 0 < expected["old"] < 1 and 0 < expected["new"] < 1  # a case where the two could differ


def test_selection_is_the_sweep_rule_ties_to_smaller_lambda() -> None:
    post = {"old_validation": 0.9, "new_validation": 0.1}

    def point(name: str, old: float, new: float, lam: float, rho: float) -> dict:
        return {"name": name, "old_validation": old, "new_validation": new, "lam": lam, "rho": rho}

    keeps_more = point("keeps-more", 0.99, 0.5, 0.5, 0.1)
    smaller = point("smaller-lambda", 0.89, 0.5, 0.25, 0.1)
    forgets = point("forgets", 0.7, 0.9, 1.0, 0.0)
    # registration 1 broke ties by higher old-task validation; the sweep's rule (registration 2) by smaller λ, ρ
    assert choose_point([keeps_more, smaller, forgets], post, 0.01)["name"] == "smaller-lambda"
    assert choose_point([keeps_more, point("smaller-rho", 0.95, 0.5, 0.5, 0.03)], post, 0.01)["name"] == "smaller-rho"
    assert choose_point([forgets], post, 0.05)["name"] == "post"
    assert choose_point([forgets], post, 0.2)["name"] == "forgets"


def test_verdict_rules() -> None:
    def outcome(mean: float, holm_p: float | None, tost_p: float | None) -> dict:
        return {"mean": mean, "holm_p": holm_p, "tost_p": tost_p}

    assert verdict([outcome(0.1, 0.01, 0.5), outcome(0.02, 0.3, 0.2)]) == "positive"
    assert verdict([outcome(-0.1, 0.04, 0.5), outcome(0.0, 0.9, 0.01)]) == "negative"
    assert verdict([outcome(0.1, 0.01, 0.5), outcome(-0.1, 0.01, 0.5)]) == "inconclusive"  # contradictory
    assert verdict([outcome(0.01, 0.6, 0.01), outcome(-0.01, 0.7, 0.04)]) == "equivalent"
    assert verdict([outcome(0.01, 0.6, 0.01), outcome(-0.01, 0.7, 0.06)]) == "inconclusive"  # one τ only
    assert verdict([outcome(0.01, 0.06, 0.01), outcome(0.0, 0.5, 0.01)]) == "equivalent"
    assert verdict([outcome(0.1, None, None)]) == "too few seeds"


def test_question_by_hand() -> None:
    found = question({"0.01": [0.1, 0.2, 0.3], "0.05": [0.3, 0.4, 0.5]}, margin=0.05)
    first, second = found["per_tolerance"]
    assert first["p"] == pytest.approx(2 * _tail(0.2 / (0.1 / math.sqrt(3))), abs=1e-9)  # t = 3.464, p = 0.0742
    assert second["p"] == pytest.approx(2 * _tail(0.4 / (0.1 / math.sqrt(3))), abs=1e-9)  # t = 6.928, p = 0.0202
    assert second["holm_p"] == pytest.approx(2 * second["p"], abs=1e-9)  # Holm: smallest × 2, then × 1 (monotone)
    assert first["holm_p"] == pytest.approx(max(first["p"], 2 * second["p"]), abs=1e-9)
    assert found["verdict"] == "positive"  # 0.0404 < 0.05 at τ 0.05
    same = question({"0.01": [-0.01, 0.0, 0.01], "0.05": [-0.01, 0.0, 0.01]}, margin=0.05)
    t = 0.05 / (0.01 / math.sqrt(3))
    assert same["per_tolerance"][0]["tost_p"] == pytest.approx(_tail(t), abs=1e-9)
    assert same["verdict"] == "equivalent"
    assert question({"0.01": [0.1, 0.2, 0.3], "0.05": [0.0, 0.2, 0.4]})["verdict"] == "inconclusive"
    assert question({"0.01": [0.1]})["verdict"] == "too few seeds"


@pytest.mark.parametrize(("donors", "passed", "p"), [
    ([0.50, 0.51, 0.52], True, 0.0),  # −0.03 every seed: no spread
    ([0.52, 0.53, 0.54], False, 0.0),  # −0.01 every seed: significant but below the registered 0.02
    ([0.51, 0.51, 0.51], True, _tail(0.03 / (0.01 / math.sqrt(3)))),  # −0.02, −0.03, −0.04: t = −5.196
    ([0.53, 0.51, 0.49], False, _tail(0.03 / (0.03 / math.sqrt(3)))),  # 0, −0.03, −0.06: t = −1.732, p 0.113
    ([0.56, 0.57, 0.58], False, 1.0),  # donors write more
])
def test_gate_by_hand(donors: list[float], passed: bool, p: float) -> None:
    sft = [0.53, 0.54, 0.55]
    row = gate({"donors": dict(enumerate(donors)), "sft": dict(enumerate(sft))})
    assert row["passed"] is passed
    assert row["p"] == pytest.approx(p, abs=1e-9)
    assert gate({"donors": {0: 0.1}, "sft": {0: 0.5}})["passed"] is False  # one seed cannot pass


def test_registered_grids() -> None:
    """What docs/demo-preregistration-2.md registers: every method the same grid; the grid's reach; 12 seeds."""
    assert FULL.seeds == tuple(range(1, 13))  # seed 0 was the pilot: not among the registered seeds
    assert FULL.donors == ("late", "end") and FULL.replays == ("none", "own")
    assert min(FULL.lambdas) <= 0.1 < 1 < max(FULL.lambdas) and max(rho for _, rho in FULL.masks) >= 0.1
    assert FULL.balanced_new and FULL.new_entities % 8 == 0 and FULL.pretrain_task_a > 0
    assert {u.family for u in updates(FULL)} == {"sft", "graft@late", "graft@end", "opsd-reverse"}
    per_family = Counter(u.family for u in updates(FULL))
    assert set(per_family.values()) == {len(FULL.learning_rates) * len(FULL.replays)}
    assert len(updates(QUICK)) * len(QUICK.epochs) * len(grid(QUICK)) <= 200  # the quick run stays ≤ 5 min
    assert World(FULL.known_entities, FULL.new_entities, seed=0).facts != seed_world(FULL, 0)[0].facts


def _sft_point(name: str, old: float, new: float, lam: float = 1.0) -> dict:
    return {"name": name, "family": "sft", "replay": "none", "learning_rate": 1e-3, "epochs": 1, "lam": lam,
            "mask": None, "rho": 0.0, "old_validation": old, "new_validation": new}


def test_interference_gate_by_hand() -> None:
    """Plain SFT's best new-task score (0.9, forgetting task A) against its best within τ of θpost's task A."""
    post = {"old_validation": 1.0, "new_validation": 0.1}
    within = [0.6, 0.7, 0.5]  # gaps 0.3, 0.2, 0.4: mean 0.3, sd 0.1, t = 5.196
    evaluated = {seed: {"models": {"post": post},
                        "points": [_sft_point("forgets", 0.8, 0.9), _sft_point("keeps", 0.99, value),
                                   _sft_point("merged", 0.5, 1.0, lam=0.5)]}  # not plain SFT: ignored
                 for seed, value in enumerate(within)}
    row = interference(TINY, evaluated, None)
    assert row["diffs"] == pytest.approx([0.3, 0.2, 0.4]) and row["passed"]
    assert row["p"] == pytest.approx(_tail(0.3 / (0.1 / math.sqrt(3))), abs=1e-9)
    for result in evaluated.values():  # plain SFT keeps task A at its best: nothing for a merge to save
        result["points"][0]["old_validation"] = 0.97
    assert interference(TINY, evaluated, None)["diffs"] == [0.0, 0.0, 0.0]
    assert not interference(TINY, evaluated, None)["passed"]


def test_donor_verdict_needs_both_gates() -> None:
    passed, failed = {"passed": True}, {"passed": False}
    positive = {"verdict": "positive"}
    assert donor_verdict(positive, {"sensitivity": passed, "interference": passed}).startswith("reproduced")
    assert donor_verdict(positive, {"sensitivity": passed, "interference": failed}) == \
        "this setting cannot test it (gate failed: interference)"
    assert donor_verdict({"verdict": "equivalent"}, {"sensitivity": failed, "interference": failed}) == \
        "this setting cannot test it (gate failed: sensitivity, interference)"
    assert donor_verdict({"verdict": "negative"}, {"sensitivity": passed, "interference": passed}) == \
        "not reproduced: masked SFT beats the graft"
    assert donor_verdict({"verdict": "too few seeds"}, {"sensitivity": failed, "interference": failed}).startswith(
        "too few seeds")
