"""On-policy self-distillation (OPSD / SDFT), the paper's main baseline, for the demo LM.

The student (θpost being trained) samples its own answer to a new-fact question; a frozen
teacher (θpost) reads the same question with the entity's article in context; the loss is a
per-token divergence between the two next-token distributions on the student's sampled
tokens (full vocabulary): forward KL(teacher ‖ student) or reverse KL(student ‖ teacher).
Replay sequences in the same batch (no article) get plain cross-entropy, as in SFT.
Sampling time is kept apart from the update time (the paper's Fig. 8, left).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from experiments.demo.lm import cross_entropy
from experiments.demo.world import EOS, PAD, Example

DIVERGENCES = ("forward", "reverse")


@dataclass
class SamplingClock:
    """Seconds spent sampling, one entry per step."""

    seconds: list[float] = field(default_factory=list)


@torch.no_grad()
def sample_answers(model: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """One answer per prompt, sampled at temperature 1 from ``model`` (global torch RNG), up to ``<eos>``."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    for row, prompt in enumerate(prompts):  # left padding: every row's next token sits at the end
        ids[row, width - len(prompt):] = torch.tensor(prompt)
    was_training = model.training
    model.eval()
    out = model.generate(input_ids=ids, attention_mask=(ids != PAD).long(), do_sample=True, temperature=1.0,
                         top_k=0, top_p=1.0, max_new_tokens=max_new_tokens, pad_token_id=PAD, eos_token_id=EOS)
    model.train(was_training)
    answers = []
    for row in out[:, width:].tolist():
        answers.append(row[: row.index(EOS) + 1] if EOS in row else row)
    return answers


def _answer_logits(model: nn.Module, rows: list[list[int]], starts: list[int], lengths: list[int]) -> torch.Tensor:
    """The logits that predict each row's answer tokens, stacked: [sum(lengths), vocab]."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
    logits = model(input_ids=ids, attention_mask=(ids != PAD).long()).logits
    row_index = torch.tensor([i for i, n in enumerate(lengths) for _ in range(n)])
    position = torch.tensor([starts[i] - 1 + t for i, n in enumerate(lengths) for t in range(n)])
    return logits[row_index, position]


def divergence_per_token(student_logits: torch.Tensor, teacher_logits: torch.Tensor, kind: str) -> torch.Tensor:
    """KL per token: "forward" = KL(teacher ‖ student), "reverse" = KL(student ‖ teacher)."""
    student, teacher = torch.log_softmax(student_logits, -1), torch.log_softmax(teacher_logits, -1)
    if kind == "forward":
        return (teacher.exp() * (teacher - student)).sum(-1)
    if kind == "reverse":
        return (student.exp() * (student - teacher)).sum(-1)
    raise ValueError(f"divergence {kind!r}: expected one of {DIVERGENCES}")


def distillation_loss(student: nn.Module, teacher: nn.Module, batch: Sequence[Example], kind: str,
                      max_new_tokens: int, clock: SamplingClock | None = None,
                      teacher_reads_context: bool = True) -> torch.Tensor:
    """Mean per-token loss of one OPSD step: divergence on sampled answers, cross-entropy on replay rows.

    ``teacher_reads_context=False`` gives the teacher the student's own prompt (a check: then
    a teacher with the student's weights gives a loss of exactly 0).
    """
    distil = [e for e in batch if e.context]
    replay = [e for e in batch if not e.context]
    started = time.perf_counter()
    prompts = [list(e.ids[: e.answer_start]) for e in distil]
    answers = sample_answers(student, prompts, max_new_tokens) if distil else []
    if clock is not None:
        clock.seconds.append(time.perf_counter() - started)
    total = torch.zeros(())
    tokens = 0
    if distil:
        lengths = [len(a) for a in answers]
        student_logits = _answer_logits(student, [p + a for p, a in zip(prompts, answers)],
                                        [len(p) for p in prompts], lengths)
        with torch.no_grad():
            contexts = [list(e.context) if teacher_reads_context else [] for e in distil]
            teacher_rows = [p[:1] + c + p[1:] + a for p, c, a in zip(prompts, contexts, answers)]
            teacher_logits = _answer_logits(teacher, teacher_rows, [len(p) + len(c)
                                                                    for p, c in zip(prompts, contexts)], lengths)
        total = total + divergence_per_token(student_logits, teacher_logits, kind).sum()
        tokens += sum(lengths)
    if replay:
        count = sum(len(e.ids) - e.answer_start for e in replay)
        total = total + cross_entropy(student, replay) * count
        tokens += count
    return total / max(tokens, 1)
