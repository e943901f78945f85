"""The synthetic world of the demo language model: a vocabulary, an old task and new facts.

Three kinds of sequence, all word-level token ids (one token per word, no tokenizer):

- **Facts** ``what is the color of zabo ? red``: entities have one value per relation,
  asked in :data:`PHRASINGS` (8 templates). "Known" entities appear in pretraining with
  every phrasing, which teaches the model that the phrasings ask the same thing.
  "New" entities (the knowledge to inject, task B) appear only in the new-task data:
  training uses phrasings 0–5, the test asks phrasings 6–7, which the model never saw
  for those entities, so memorised surface forms do not count (the paper's Appendix A).
- **List operations** ``sort 3 1 4 1 : 1 1 3 4``: reverse, sort, copy, max, min.
- **Chat format** ``<user> … <assistant> … <eos>``: what post-training uses.

Pretraining mixes everything, mostly in plain text; post-training is narrow: only
``sort`` and ``reverse`` in chat format (the old task A whose accuracy must survive).
The new task is fact QA about new entities in chat format, mixed with task-A replay.
Every answer is checked by exact match of all its tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SPECIALS = ["<pad>", "<bos>", "<eos>", "<user>", "<assistant>"]
PAD, BOS, EOS, USER, ASSISTANT = range(len(SPECIALS))

RELATIONS: dict[str, list[str]] = {
    "color": ["red", "blue", "green", "yellow", "purple", "orange", "black", "white"],
    "food": ["bread", "rice", "soup", "fish", "cheese", "plums", "beans", "honey"],
    "pet": ["cat", "dog", "owl", "frog", "horse", "goat", "snake", "crab"],
    "city": ["oslo", "lima", "kyiv", "doha", "rome", "baku", "riga", "bern"],
}

# {r} = relation word, {e} = entity; the answer follows the question.
PHRASINGS = [
    "what is the {r} of {e} ?",
    "{e} 's {r} is what ?",
    "tell me the {r} of {e} .",
    "which {r} does {e} have ?",
    "the {r} of {e} is ?",
    "name the {r} of {e} .",
    "for {e} , what is the {r} ?",
    "what {r} has {e} ?",
]
TRAIN_PHRASINGS = range(6)
HELD_OUT_PHRASINGS = range(6, 8)

LIST_OPERATIONS = ["reverse", "sort", "copy", "max", "min"]
OLD_TASK_OPERATIONS = ["sort", "reverse"]
DIGITS = [str(d) for d in range(10)]

_SYLLABLES = ["ka", "zo", "mi", "ru", "te", "vo", "shi", "la", "bo", "ne", "qui", "da", "fe", "po", "xu", "gi"]


def entity_names(count: int, seed: int = 1234) -> list[str]:
    """``count`` distinct invented two-syllable names (the same for every run)."""
    rng = random.Random(seed)
    names: list[str] = []
    while len(names) < count:
        name = rng.choice(_SYLLABLES) + rng.choice(_SYLLABLES)
        if name not in names:
            names.append(name)
    return names


def _vocabulary(entities: list[str]) -> list[str]:
    words = list(SPECIALS) + DIGITS + LIST_OPERATIONS + [":"] + list(RELATIONS)
    for values in RELATIONS.values():
        words += values
    for template in PHRASINGS:
        words += [w for w in template.split() if not w.startswith("{")]
    words += entities
    return list(dict.fromkeys(words))  # keep order, drop repeats


@dataclass(frozen=True)
class Example:
    """One sequence: token ids, and where the answer starts (scored positions: answer_start..end)."""

    ids: tuple[int, ...]
    answer_start: int


class World:
    """Entities, facts and the vocabulary; every data set of the demo is drawn from here."""

    def __init__(self, known_entities: int = 48, new_entities: int = 24, list_length: int = 5, seed: int = 0):
        names = entity_names(known_entities + new_entities)
        self.known = names[:known_entities]
        self.new = names[known_entities:]
        self.list_length = list_length
        self.words = _vocabulary(names)
        self.index = {word: i for i, word in enumerate(self.words)}
        rng = random.Random(seed)
        self.facts = {(entity, relation): rng.choice(values)
                      for entity in names for relation, values in RELATIONS.items()}

    @property
    def vocab_size(self) -> int:
        """Number of token ids (specials, words and entity names), the model's embedding rows."""
        return len(self.words)

    def encode(self, text: str) -> list[int]:
        """Space-separated words to ids; every word must be in the vocabulary (KeyError otherwise)."""
        return [self.index[word] for word in text.split()]

    def decode(self, ids) -> str:
        """Ids back to space-separated words (for reading samples)."""
        return " ".join(self.words[i] for i in ids)

    # -- sequences ---------------------------------------------------------------------
    def _example(self, question: str, answer: str, chat: bool) -> Example:
        prompt = [BOS] + ([USER] if chat else []) + self.encode(question) + ([ASSISTANT] if chat else [])
        answer_ids = self.encode(answer) + ([EOS] if chat else [])
        return Example(tuple(prompt + answer_ids), len(prompt))

    def fact(self, entity: str, relation: str, phrasing: int, chat: bool) -> Example:
        """The question about ``entity``'s ``relation`` in phrasing number ``phrasing``, answered with its value."""
        question = PHRASINGS[phrasing].format(r=relation, e=entity)
        return self._example(question, self.facts[entity, relation], chat)

    def list_operation(self, operation: str, rng: random.Random, chat: bool) -> Example:
        """``operation`` applied to a random list of ``list_length`` digits drawn from ``rng``."""
        digits = [rng.randrange(10) for _ in range(self.list_length)]
        result = {
            "reverse": digits[::-1],
            "sort": sorted(digits),
            "copy": digits,
            "max": [max(digits)],
            "min": [min(digits)],
        }[operation]
        question = f"{operation} {' '.join(map(str, digits))} :"
        return self._example(question, " ".join(map(str, result)), chat)

    # -- data sets ---------------------------------------------------------------------
    def pretraining(self, count: int, rng: random.Random) -> list[Example]:
        """Broad mixture: known-entity facts in every phrasing and all list operations, 20% chat."""
        examples = []
        for _ in range(count):
            chat = rng.random() < 0.2
            if rng.random() < 0.5:
                entity, relation = rng.choice(self.known), rng.choice(list(RELATIONS))
                examples.append(self.fact(entity, relation, rng.randrange(len(PHRASINGS)), chat))
            else:
                examples.append(self.list_operation(rng.choice(LIST_OPERATIONS), rng, chat))
        return examples

    def old_task(self, count: int, rng: random.Random) -> list[Example]:
        """Task A, the post-training task: sort and reverse in chat format."""
        return [self.list_operation(rng.choice(OLD_TASK_OPERATIONS), rng, chat=True) for _ in range(count)]

    def old_task_prompts(self, count: int, rng: random.Random) -> list[list[int]]:
        """Task-A prompts (no answer): what the retention Fisher's rollouts start from."""
        return [list(example.ids[: example.answer_start]) for example in self.old_task(count, rng)]

    def new_task_train(self) -> list[Example]:
        """Task B training pairs: every new fact in the training phrasings, chat format."""
        return [self.fact(entity, relation, phrasing, chat=True)
                for entity in self.new for relation in RELATIONS for phrasing in TRAIN_PHRASINGS]

    def new_task_test(self) -> list[Example]:
        """Task B test pairs: the same facts in held-out phrasings."""
        return [self.fact(entity, relation, phrasing, chat=True)
                for entity in self.new for relation in RELATIONS for phrasing in HELD_OUT_PHRASINGS]

    def new_task_mixture(self, replay: float, rng: random.Random) -> list[Example]:
        """Task-B pairs plus task-A replay (``replay`` = replay examples per task-B example)."""
        new = self.new_task_train()
        return new + self.old_task(round(replay * len(new)), rng)
