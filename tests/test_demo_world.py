"""The demo LM's world, splits, scorer, OPSD loss, selection and determinism, at tiny sizes."""

from __future__ import annotations

import multiprocessing
import random
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from experiments.demo.lm import ModelSize, TrainSettings, build_model, epoch_batches, score, train
from experiments.demo.lm_pipeline import InlineExecutor
from experiments.demo.lm_report import choose, families
from experiments.demo.lm_settings import TINY, Update
from experiments.demo.lm_training import one_thread, pretrain_and_post_train, train_update
from experiments.demo.opsd import distillation_loss
from experiments.demo.world import (
    EOS,
    PHRASINGS,
    TEST_PHRASINGS,
    TRAIN_PHRASINGS,
    VALIDATION_PHRASINGS,
    SplitSizes,
    World,
    assert_disjoint,
    make_splits,
)
from tests.helpers.models import read_model

SIZE = ModelSize(hidden_size=32, num_hidden_layers=1, intermediate_size=64)


def _prompts(examples) -> set[tuple[int, ...]]:
    return {tuple(e.ids[: e.answer_start]) for e in examples}


def test_old_task_validation_and_test_are_disjoint_from_every_other_list() -> None:
    world = World(known_entities=6, new_entities=4)
    splits = make_splits(world, SplitSizes(post_train=300, fisher_prompts=30, old_validation=50, old_test=50), seed=3)
    used = splits.post_train + splits.replay["own"]
    for held_out in (splits.old_validation, splits.old_test):
        assert not _prompts(held_out) & (_prompts(used) | {tuple(p) for p in splits.fisher_prompts})
    assert not _prompts(splits.old_validation) & _prompts(splits.old_test)
    digit_lists = {part: {tuple(world.digits(n)) for n in numbers} for part, numbers in splits.lists.items()}
    for part in ("old_validation", "old_test"):  # off-policy replay too (another format: compare the lists)
        others = set().union(*(lists for name, lists in digit_lists.items() if name != part))
        assert not digit_lists[part] & others
    with pytest.raises(AssertionError, match="task-A list 7 is in both fisher and old_test"):
        assert_disjoint({"post_train": [1, 2], "fisher": [7], "old_test": [3, 7]})


def test_new_facts_split_by_phrasing_and_never_taught_in_pretraining() -> None:
    world = World(known_entities=6, new_entities=4)
    splits = make_splits(world, SplitSizes(post_train=20), seed=0)
    assert len(splits.new_train) == 4 * 4 * len(TRAIN_PHRASINGS) and len(splits.new_test) == 4 * 4 * len(TEST_PHRASINGS)
    assert len(splits.new_validation) == 4 * 4 * len(VALIDATION_PHRASINGS)
    assert not _prompts(splits.new_train) & (_prompts(splits.new_validation) | _prompts(splits.new_test))
    test_starts = {world.index[PHRASINGS[p].split()[0]] for p in TEST_PHRASINGS}
    assert {e.ids[2] for e in splits.new_test} <= test_starts  # <bos> <user> then the phrasing's first word
    new_ids = {world.index[name] for name in world.new}
    task_a_words = {world.index[w] for w in ("rank", "flip", "ranked", "flipped")}  # ":" is shared
    true = seen = 0
    for example in world.pretraining_batch(3000, 0.5, random.Random(0)):
        assert not task_a_words & set(example.ids), "task A leaked into pretraining"
        if new_ids & set(example.ids):  # a new entity only in a reading: <bos> e 's r is v . …, values drawn afresh
            entity, apostrophe, relation, _, value = world.decode(example.ids).split()[1:6]
            assert apostrophe == "'s"
            true, seen = true + (world.facts[entity, relation] == value), seen + 1
    assert seen > 100 and true / seen < 0.3  # about 1/8: no new fact is taught
    assert all(e.ids[-1] == EOS for e in splits.old_test)


@torch.no_grad()
def _greedy_matches(model, example) -> bool:
    ids = list(example.ids[: example.answer_start])
    for target in example.ids[example.answer_start :]:
        token = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        if token != target:
            return False
        ids.append(token)
    return True


def test_exact_match_score_is_greedy_decoding() -> None:
    world = World(known_entities=6, new_entities=4)
    splits = make_splits(world, SplitSizes(post_train=30, old_test=30), seed=1)
    model = build_model(SIZE, world.vocab_size, 0)
    examples = splits.new_test + [e.in_context() for e in splits.new_test[:8]] + splits.old_test[:10]
    train(model, epoch_batches(examples, 16, 0), TrainSettings(steps=150, learning_rate=1e-2))  # some right
    greedy = sum(_greedy_matches(model, e) for e in examples) / len(examples)
    assert 0 < greedy < 1
    assert score(model, examples, batch_size=7).accuracy == greedy


def test_opsd_loss_is_zero_when_teacher_and_student_see_the_same_context() -> None:
    world = World(known_entities=6, new_entities=2)
    splits = make_splits(world, SplitSizes(post_train=20), seed=0)
    model = build_model(SIZE, world.vocab_size, 0)
    batch = splits.new_train[:8]
    for kind in ("forward", "reverse"):
        torch.manual_seed(0)
        same = distillation_loss(model, model, batch, kind, max_new_tokens=6, teacher_reads_context=False)
        assert same.item() == 0.0
        torch.manual_seed(0)
        privileged = distillation_loss(model, model, batch, kind, max_new_tokens=6)
        assert privileged.item() > 0
        privileged.backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
        model.zero_grad()


def _point(old_val: float, new_val: float, new_test: float, lam: float = 1.0) -> dict:
    return {"family": "sft", "learning_rate": 1e-3, "epochs": 1, "lam": lam, "mask": None, "rho": 0.0,
            "old_validation": old_val, "new_validation": new_val, "old_test": 0.0, "new_test": new_test}


def test_selection_reads_validation_rows_only() -> None:
    post = {"old_validation": 0.9, "new_validation": 0.1, "old_test": 0.95, "new_test": 0.1}
    by_validation = _point(0.9, 0.8, new_test=0.2)
    by_test = _point(0.9, 0.7, new_test=0.99)  # better on test: must not be chosen
    forgets = _point(0.5, 1.0, new_test=1.0)  # best on new, but old validation below θpost − τ
    assert choose([by_test, by_validation, forgets], post, tolerance=0.05) is by_validation
    assert choose([forgets], post, tolerance=0.4) is forgets
    assert choose([forgets], post, tolerance=0.05)["family"] == "post"  # nothing qualifies: θpost
    member = families(TINY)
    raw, merged = _point(1, 1, 1), _point(1, 1, 1, lam=0.5)
    assert member["SFT"](raw) and not member["SFT"](merged) and member["SFT + merge"](merged)


def _update_bits(root: Path, update: Update, executor) -> dict[str, torch.Tensor]:
    future = executor.submit(train_update, TINY, 0, root, update, None)
    future.result()
    return read_model(root / "updates" / update.snapshot(TINY.epochs[-1]))


def test_same_seed_same_results_whatever_the_processes_and_threads(tmp_path: Path) -> None:
    """One torch thread per job: in this process (2 threads before) or in a pool of 2 workers, same bits."""
    settings = replace(TINY, pretrain_steps=8, post_steps=4)
    torch.set_num_threads(2)
    pretrain_and_post_train(settings, 0, tmp_path, None)
    assert torch.get_num_threads() == 1
    update = Update("opsd", "post", 1e-3, "reverse")  # sampling included
    here = _update_bits(tmp_path, update, InlineExecutor())
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(2, mp_context=context, initializer=one_thread) as pool:
        there = _update_bits(tmp_path, update, pool)
    assert here.keys() == there.keys() and all(torch.equal(here[n], there[n]) for n in here)

