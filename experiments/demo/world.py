"""The synthetic world of the demo language model: a vocabulary, an old task, new facts, and their splits.

Word-level token ids (one token per word, no tokenizer). Kinds of sequence:

- **Facts** ``what is the color of zabo ? the color is red .``: one value per (entity,
  relation), asked in :data:`PHRASINGS` (8 templates), answered with a short sentence (5
  tokens, + ``<eos>`` in chat), so sampling an answer takes several decoding steps.
  "Known" entities appear in pretraining in every phrasing; "new" entities' facts (task B,
  the knowledge to inject) never do. New facts are trained in phrasings 0–4, validated in
  phrasing 5 and tested in 6–7 (the paper's held-out paraphrases, its Appendix A).
- **Reading** ``zabo 's color is red . what is the color of zabo ? the color is red .``: a
  short article (one sentence, or two with a distractor), then a question answered from it. In pretraining
  the values are drawn afresh for every sequence (about any entity, new ones included), so
  no fact is taught, only reading; OPSD's teacher reads the true article of a new entity.
- **List operations** ``sort 3 1 4 1 5 : 1 1 3 4 5`` (reverse, sort, copy, max, min): pretraining.
- **Task A**, the old capability: ``<user> rank 3 1 4 1 5 <assistant> ranked : 5 4 3 1 1 <eos>``
  (rank = sort descending, flip = reverse) in a format and with words absent from
  pretraining, so post-training *creates* it.
- **Off-policy replay**: a related task written by a "teacher" in another format
  (``<user> sort 3 1 4 1 5 <assistant> the result is 1 1 3 4 5 <eos>``).
- **Chat format** ``<bos> [article] <user> … <assistant> … <eos>``.

Every list of task A, its replay, the Fisher prompts and its validation and test sets
comes from one draw of distinct digit lists cut into disjoint parts (:func:`make_splits`
asserts it). Every answer is checked by exact match of all its tokens.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

SPECIALS = ["<pad>", "<bos>", "<eos>", "<user>", "<assistant>"]
PAD, BOS, EOS, USER, ASSISTANT = range(len(SPECIALS))

RELATIONS: dict[str, list[str]] = {
    "color": ["red", "blue", "green", "yellow", "purple", "orange", "black", "white"],
    "food": ["bread", "rice", "soup", "fish", "cheese", "plums", "beans", "honey"],
    "pet": ["cat", "dog", "owl", "frog", "horse", "goat", "snake", "crab"],
    "city": ["oslo", "lima", "kyiv", "doha", "rome", "baku", "riga", "bern"],
}

# {r} = relation word, {e} = entity; the answer sentence follows the question.
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
TRAIN_PHRASINGS = range(5)
VALIDATION_PHRASINGS = range(5, 6)
TEST_PHRASINGS = range(6, 8)
ANSWER = "the {r} is {v} ."
ARTICLE_SENTENCE = "{e} 's {r} is {v} ."

PRETRAIN_OPERATIONS = ["reverse", "sort", "copy", "max", "min"]
OLD_TASK = {"rank": "ranked :", "flip": "flipped :"}  # task A: operation → its answer's prefix
REPLAY_OPERATIONS = {"sort": "rank", "reverse": "flip"}  # off-policy replay: related operation of task A
REPLAY_PREFIX = "the result is"
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
    words = list(SPECIALS) + DIGITS + PRETRAIN_OPERATIONS + [":"] + list(RELATIONS)
    for values in RELATIONS.values():
        words += values
    for text in [*PHRASINGS, ANSWER, ARTICLE_SENTENCE, REPLAY_PREFIX, *OLD_TASK, *OLD_TASK.values()]:
        words += [w for w in text.split() if not w.startswith("{")]
    words += entities
    return list(dict.fromkeys(words))  # keep order, drop repeats


def balanced_values(entities: list[str], rng: random.Random) -> dict[tuple[str, str], str]:
    """Each relation's values dealt to ``entities`` as evenly as possible, in a random order.

    With a multiple of 8 entities every value goes to exactly as many entities, so any
    answer that ignores the entity (a relation's most common value, or any value chosen
    per relation and phrasing) is right on exactly 1/8 of the questions: chance is 1/8.
    """
    facts = {}
    for relation, values in RELATIONS.items():
        dealt = (values * -(-len(entities) // len(values)))[: len(entities)]
        rng.shuffle(dealt)
        facts.update({(entity, relation): value for entity, value in zip(entities, dealt)})
    return facts


@dataclass(frozen=True)
class Example:
    """One sequence: token ids, where the answer starts, and (new facts) the article OPSD's teacher reads."""

    ids: tuple[int, ...]
    answer_start: int
    context: tuple[int, ...] = ()

    def in_context(self) -> Example:
        """The same question with its article placed right after ``<bos>`` (what OPSD's teacher sees)."""
        ids = self.ids[:1] + self.context + self.ids[1:]
        return Example(ids, self.answer_start + len(self.context))


class World:
    """Entities, facts and the vocabulary; every sequence of the demo is drawn from here."""

    def __init__(self, known_entities: int = 48, new_entities: int = 24, list_length: int = 5, seed: int = 0,
                 sentences: int = 1, balanced_new: bool = False):
        names = entity_names(known_entities + new_entities)
        self.sentences = sentences
        self.known = names[:known_entities]
        self.new = names[known_entities:]
        self.list_length = list_length
        self.words = _vocabulary(names)
        self.index = {word: i for i, word in enumerate(self.words)}
        rng = random.Random(seed)
        self.facts = {(entity, relation): rng.choice(values)
                      for entity in names for relation, values in RELATIONS.items()}
        if balanced_new:
            self.facts.update(balanced_values(self.new, rng))

    @property
    def vocab_size(self) -> int:
        """Number of token ids (specials, words and entity names), the model's embedding rows."""
        return len(self.words)

    def encode(self, text: str) -> list[int]:
        """Space-separated words to ids; every word must be in the vocabulary (KeyError otherwise)."""
        return [self.index[word] for word in text.split()]

    def decode(self, ids: Iterable[int]) -> str:
        """Ids back to space-separated words (for reading samples)."""
        return " ".join(self.words[i] for i in ids)

    # -- sequences ---------------------------------------------------------------------
    def example(self, question: str, answer: str, chat: bool, article: str = "") -> Example:
        """``<bos> [article] [<user>] question [<assistant>] answer [<eos>]``; the answer is scored."""
        prompt = [BOS] + self.encode(article) + ([USER] if chat else []) + self.encode(question)
        prompt += [ASSISTANT] if chat else []
        return Example(tuple(prompt + self.encode(answer) + ([EOS] if chat else [])), len(prompt))

    def article(self, entity: str, values: dict[str, str], relation: str, rng: random.Random) -> str:
        """A short article: the sentence on ``relation`` and, with ``sentences`` = 2, one on another, shuffled."""
        relations = [relation] + ([rng.choice([r for r in RELATIONS if r != relation])] if self.sentences > 1 else [])
        rng.shuffle(relations)
        return " ".join(ARTICLE_SENTENCE.format(e=entity, r=r, v=values[r]) for r in relations)

    def fact(self, entity: str, relation: str, phrasing: int, chat: bool) -> Example:
        """The question about ``entity``'s ``relation`` in phrasing ``phrasing``, answered closed-book."""
        value = self.facts[entity, relation]
        return self.example(PHRASINGS[phrasing].format(r=relation, e=entity), ANSWER.format(r=relation, v=value),
                            chat)

    def reading(self, entity: str, relation: str, phrasing: int, chat: bool, rng: random.Random) -> Example:
        """An article about ``entity`` with values drawn afresh, then a question answered from it."""
        values = {r: rng.choice(choices) for r, choices in RELATIONS.items()}
        return self.example(
            PHRASINGS[phrasing].format(r=relation, e=entity),
            ANSWER.format(r=relation, v=values[relation]),
            chat,
            article=self.article(entity, values, relation, rng),
        )

    def digits(self, number: int) -> list[int]:
        """The digit list numbered ``number`` (0 ≤ number < 10 ** list_length)."""
        return [int(d) for d in str(number).zfill(self.list_length)]

    def list_operation(self, operation: str, digits: list[int], chat: bool) -> Example:
        """A pretraining list operation: ``operation d d d d d : result``."""
        result = {"reverse": digits[::-1], "sort": sorted(digits), "copy": digits,
                  "max": [max(digits)], "min": [min(digits)]}[operation]
        return self.example(f"{operation} {' '.join(map(str, digits))} :", " ".join(map(str, result)), chat)

    def task_a(self, operation: str, digits: list[int]) -> Example:
        """Task A in its own chat format: rank (descending) or flip (reverse), ``ranked : …``."""
        result = sorted(digits, reverse=True) if operation == "rank" else digits[::-1]
        return self.example(f"{operation} {' '.join(map(str, digits))}",
                            f"{OLD_TASK[operation]} {' '.join(map(str, result))}", chat=True)

    def off_policy_replay(self, operation: str, digits: list[int]) -> Example:
        """The related task as a teacher writes it: ``<user> sort … <assistant> the result is …``."""
        result = sorted(digits) if operation == "sort" else digits[::-1]
        return self.example(f"{operation} {' '.join(map(str, digits))}",
                            f"{REPLAY_PREFIX} {' '.join(map(str, result))}", chat=True)

    def new_fact(self, entity: str, relation: str, phrasing: int, rng: random.Random) -> Example:
        """A new fact in chat format, carrying its entity's true article for OPSD's teacher."""
        values = {r: self.facts[entity, r] for r in RELATIONS}
        return replace(self.fact(entity, relation, phrasing, chat=True),
                       context=tuple(self.encode(self.article(entity, values, relation, rng))))

    # -- mixtures ----------------------------------------------------------------------
    def general(self, rng: random.Random, chat: bool, entities: list[str] | None = None) -> Example:
        """One general sequence: a known fact (40%), a list operation (30%) or a reading (30%)."""
        kind = rng.random()
        phrasing = rng.randrange(len(PHRASINGS))
        if kind < 0.4:
            return self.fact(rng.choice(self.known), rng.choice(list(RELATIONS)), phrasing, chat)
        if kind < 0.7:
            digits = [rng.randrange(10) for _ in range(self.list_length)]
            return self.list_operation(rng.choice(PRETRAIN_OPERATIONS), digits, chat)
        entity = rng.choice(entities or self.known + self.new)
        return self.reading(entity, rng.choice(list(RELATIONS)), phrasing, chat, rng)

    def pretraining_batch(self, size: int, chat_share: float, rng: random.Random) -> list[Example]:
        """A batch of the broad mixture, ``chat_share`` of it in chat format (the anneal raises it)."""
        return [self.general(rng, chat=rng.random() < chat_share) for _ in range(size)]


@dataclass(frozen=True)
class SplitSizes:
    """How many task-A lists each part gets, and the post-training mixture's size."""

    post_train: int = 4000
    general_chat: float = 0.25  # general chat sequences per task-A sequence in post-training
    replay: float = 0.2  # replay sequences per new-fact sequence (0.2 → 1/6 ≈ 17% of the mixture)
    fisher_prompts: int = 64
    old_validation: int = 200
    old_test: int = 400


@dataclass
class Splits:
    """Every data set of one seed; task-A lists of different parts never coincide."""

    post_train: list[Example]
    new_train: list[Example]
    new_validation: list[Example]
    new_test: list[Example]
    old_validation: list[Example]
    old_test: list[Example]
    replay: dict[str, list[Example]]  # "none", "offpolicy", "own"
    fisher_prompts: list[list[int]]
    lists: dict[str, list[int]] = field(default_factory=dict)  # part → its digit-list numbers


def assert_disjoint(lists: dict[str, list[int]]) -> None:
    """Raise AssertionError when two parts share a task-A digit list (or one part repeats one)."""
    seen: dict[int, str] = {}
    for part, numbers in lists.items():
        for number in numbers:
            if number in seen:
                raise AssertionError(f"task-A list {number} is in both {seen[number]} and {part}")
            seen[number] = part


def _cut_lists(world: World, sizes: SplitSizes, new_count: int, rng: random.Random) -> dict[str, list[int]]:
    """One draw of distinct digit lists, cut into the disjoint parts."""
    replay = round(sizes.replay * new_count)
    counts = {"post_train": sizes.post_train, "own_replay": replay, "offpolicy_replay": replay,
              "fisher": sizes.fisher_prompts, "old_validation": sizes.old_validation, "old_test": sizes.old_test}
    numbers = rng.sample(range(10**world.list_length), sum(counts.values()))
    lists, start = {}, 0
    for part, count in counts.items():
        lists[part], start = numbers[start : start + count], start + count
    return lists


def make_splits(world: World, sizes: SplitSizes, seed: int) -> Splits:
    """Every data set of a seed, drawn from ``world``; asserts the task-A parts are disjoint."""
    rng = random.Random(seed)
    new_facts = [(e, r) for e in world.new for r in RELATIONS]

    def new(phrasings: range) -> list[Example]:
        """The new facts in ``phrasings``, each carrying its article."""
        return [world.new_fact(e, r, p, rng) for e, r in new_facts for p in phrasings]

    new_train = new(TRAIN_PHRASINGS)
    lists = _cut_lists(world, sizes, len(new_train), rng)
    assert_disjoint(lists)
    operations = list(OLD_TASK)

    def task_a(part: str) -> list[Example]:
        """Task A on the lists of ``part``, operations alternating."""
        return [world.task_a(operations[i % 2], world.digits(n)) for i, n in enumerate(lists[part])]

    post_train = task_a("post_train")
    post_train += [world.general(rng, chat=True, entities=world.known)
                   for _ in range(round(sizes.general_chat * len(post_train)))]
    replay_ops = list(REPLAY_OPERATIONS)
    offpolicy = [world.off_policy_replay(replay_ops[i % 2], world.digits(n))
                 for i, n in enumerate(lists["offpolicy_replay"])]
    return Splits(
        post_train=post_train, new_train=new_train, new_validation=new(VALIDATION_PHRASINGS),
        new_test=new(TEST_PHRASINGS), old_validation=task_a("old_validation"), old_test=task_a("old_test"),
        replay={"none": [], "offpolicy": offpolicy, "own": task_a("own_replay")},
        fisher_prompts=[list(e.ids[: e.answer_start]) for e in task_a("fisher")], lists=lists,
    )
