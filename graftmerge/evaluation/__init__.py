"""Judge a model on what it should keep (role ``old``) and what it should learn (role ``new``).

A tasks file names JSONL data or lm-evaluation-harness tasks (:func:`load_tasks`); an
:class:`Evaluator` binds it to a tokenizer and scores in-memory models; :func:`normalised`
and :func:`role_scores` put every metric on [0, 1], higher better, and average per role.
docs/evaluation.md describes the file format, the metrics and the normalisation.
"""

from graftmerge.evaluation.roles import normalised, role_scores
from graftmerge.evaluation.scoring import Evaluator, load_model_for_eval, load_tokenizer
from graftmerge.evaluation.tasks import Task, TaskSuite, load_tasks

__all__ = ["Evaluator", "Task", "TaskSuite", "load_model_for_eval", "load_tasks", "load_tokenizer", "normalised",
           "role_scores"]
