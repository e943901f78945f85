"""The demo LM's synthetic world and scorer: held-out phrasings, exact-match = greedy decoding."""

from __future__ import annotations

import random

import torch

from graftmerge.demo.lm import ModelSize, TrainSettings, build_model, score, train
from graftmerge.demo.world import EOS, HELD_OUT_PHRASINGS, PHRASINGS, TRAIN_PHRASINGS, World


def test_new_task_tests_only_held_out_phrasings_of_trained_facts() -> None:
    world = World(known_entities=6, new_entities=4)
    train, test = world.new_task_train(), world.new_task_test()
    assert not set(e.ids for e in train) & set(e.ids for e in test)
    assert len(train) == 4 * 4 * len(TRAIN_PHRASINGS) and len(test) == 4 * 4 * len(HELD_OUT_PHRASINGS)
    held_out_starts = {world.encode(PHRASINGS[p].split("{")[0])[0] for p in HELD_OUT_PHRASINGS}
    assert {e.ids[2] for e in test} <= held_out_starts  # <bos> <user> then the phrasing's first word
    pretraining = world.pretraining(500, random.Random(0))
    new_ids = {world.index[name] for name in world.new}
    assert not any(new_ids & set(e.ids) for e in pretraining), "new entities leaked into pretraining"
    for example in world.old_task(20, random.Random(1)):
        assert example.ids[-1] == EOS and world.decode(example.ids).split()[2] in ("sort", "reverse")


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
    model = build_model(ModelSize(hidden_size=32, num_hidden_layers=1, intermediate_size=64), world.vocab_size, 0)
    examples = world.old_task(30, random.Random(2)) + world.new_task_test()
    train(model, examples, TrainSettings(steps=100, learning_rate=3e-3, batch_size=16))  # some right, some not
    greedy = sum(_greedy_matches(model, e) for e in examples) / len(examples)
    assert 0 < greedy < 1
    assert score(model, examples, batch_size=7).accuracy == greedy
