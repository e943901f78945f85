"""What one run of the LM demo's experiment is: sizes, schedules, and the grid every method gets.

Every method that produces an update (SFT of θpost, a fine-tune of each donor, OPSD of
θpost) is trained at every learning rate in ``learning_rates`` and snapshotted at every
epoch count in ``epochs``; every resulting update is merged at every λ in ``lambdas``
with every (mask, ρ) in ``masks`` (ρ = 0: no mask). So every method gets the same number
of configurations per update; :func:`updates` lists them and :func:`grid` the merges.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from experiments.demo.lm import ModelSize
from experiments.demo.world import SplitSizes

# where donors are saved: fraction of pretraining (the anneal starts at decay_start), or of post-training
DONORS = ("pre_anneal", "mid_anneal", "late", "end", "mid_post")
REPLAYS = ("none", "offpolicy", "own")
FOLDER_AT = "_from_"  # "graft@end" is written "graft_from_end" in folder and merge names


@dataclass(frozen=True)
class LmDemoSettings:
    """Everything that decides one experiment; QUICK, FULL and TINY below."""

    size: ModelSize = ModelSize(hidden_size=96, num_hidden_layers=3, intermediate_size=256)
    known_entities: int = 32
    new_entities: int = 12
    splits: SplitSizes = SplitSizes()
    batch_size: int = 32
    pretrain_steps: int = 1500
    pretrain_lr: float = 2e-3
    decay_start: float = 0.7  # warmup-stable-decay: the anneal is the last 30% of pretraining
    stable_chat: float = 0.1  # share of chat-format sequences before the anneal
    anneal_chat: float = 0.8  # and during it (chat-heavy anneal)
    post_steps: int = 800
    post_lr: float = 1e-3
    learning_rates: tuple[float, ...] = (3e-4, 1e-3)
    epochs: tuple[int, ...] = (10, 25)  # snapshots of one run per learning rate (constant rate after warm-up)
    donors: tuple[str, ...] = ("pre_anneal", "end")
    opsd: tuple[str, ...] = ("reverse",)  # OPSD divergences; () = no OPSD arm
    opsd_max_new_tokens: int = 8
    teacher_threshold: float = 0.9  # go/no-go: θpost's accuracy with the fact in context
    replay: str = "offpolicy"
    lambdas: tuple[float, ...] = (0.25, 0.5, 1.0, 1.5)
    masks: tuple[tuple[str | None, float], ...] = ((None, 0.0), ("diagonal", 0.01), ("kfac", 0.01))
    tolerances: tuple[float, ...] = (0.01, 0.05)  # old-task validation may drop this much below θpost
    seeds: tuple[int, ...] = (0,)
    fisher_samples: int = 2
    stats_top: float = 0.01  # Fig. 8 right: share of F·Δ² on the top 1% F coordinates
    notes: dict[str, str] = field(default_factory=dict)
    # pre-registration 2 (docs/demo-preregistration-2.md); the defaults are the first registration's setting
    registration: int = 1  # 2: scored by graftmerge.evaluation, chosen by graftmerge.math.frontier's rule
    balanced_new: bool = False  # deal each relation's values evenly to the new entities (chance = 1/8 exactly)
    pretrain_task_a: float = 0.0  # share of task-A sequences in the anneal's batches (post-training amplifies it)
    late_donor: float = 0.95  # where the "late" donor is saved, as a fraction of pretraining
    replays: tuple[str, ...] = ()  # several: every update run once per replay (chosen on validation like a rate)


FIRST_FULL = LmDemoSettings(  # registration 1's --full (run 2026-12-03; docs/results/demo-full-results.json)
    donors=("pre_anneal", "mid_anneal", "end", "mid_post"), opsd=("forward", "reverse"),
    masks=((None, 0.0), ("diagonal", 0.01), ("kfac", 0.001), ("kfac", 0.01)), seeds=(0, 1, 2),
)
# Pre-registration 2: a late and the end donor, task A partly in pretraining, replay "none" and "own" in
# every method's grid, λ from 0.1 to 3 and KFAC ρ up to 0.1, 16 new entities (2 per value per relation)
SECOND = dict(
    registration=2, balanced_new=True, new_entities=16, pretrain_task_a=0.1, donors=("late", "end"),
    opsd=("reverse",), replays=("none", "own"), epochs=(6, 16),
    lambdas=(0.1, 0.3, 1.0, 3.0), masks=((None, 0.0), ("kfac", 0.01), ("kfac", 0.03), ("kfac", 0.1)),
)
QUICK = LmDemoSettings(**{**SECOND, "replays": ("own",), "learning_rates": (1e-3,),
                           "masks": ((None, 0.0), ("kfac", 0.03), ("kfac", 0.1))})
FULL = LmDemoSettings(**SECOND, seeds=tuple(range(1, 13)))  # seed 0 was the pilot (docs/demo-preregistration-2.md)
TINY = LmDemoSettings(  # the test suite's size: every stage, seconds
    size=ModelSize(hidden_size=32, num_hidden_layers=1, intermediate_size=64),
    known_entities=6, new_entities=2,
    splits=SplitSizes(post_train=64, fisher_prompts=8, old_validation=16, old_test=16),
    batch_size=16, pretrain_steps=20, post_steps=8, learning_rates=(1e-3,), epochs=(1, 2),
    donors=("late", "end"), opsd=("forward",), opsd_max_new_tokens=4, teacher_threshold=0.0,
    lambdas=(0.0, 1.0), masks=((None, 0.0), ("kfac", 0.01)), tolerances=(0.05,),
    registration=2, balanced_new=True, pretrain_task_a=0.05, late_donor=0.9,
)


@dataclass(frozen=True)
class Update:
    """One trained update: which method, from which start, at which rate; snapshots at ``epochs``."""

    method: str  # "sft", "graft" (a donor fine-tune) or "opsd"
    start: str  # "post" or a donor in DONORS: the model trained
    learning_rate: float
    divergence: str = ""  # OPSD's
    replay: str = ""  # "": the settings' one replay; else this run's (settings.replays)

    @property
    def family(self) -> str:
        """The method and its donor or divergence: "sft", "graft@pre_anneal", "opsd-reverse"."""
        if self.method == "graft":
            return f"graft@{self.start}"
        return f"opsd-{self.divergence}" if self.method == "opsd" else "sft"

    def snapshot(self, epochs: int) -> str:
        """The folder name of this update's snapshot after ``epochs`` epochs (no "@": mergekit reads it)."""
        replay = f"-rp{self.replay}" if self.replay else ""
        return f"{self.family.replace('@', FOLDER_AT)}{replay}-lr{self.learning_rate:g}-e{epochs}"


def updates(settings: LmDemoSettings) -> list[Update]:
    """Every training run of one seed: SFT, each donor's fine-tune and each OPSD, at every rate."""
    runs = []
    for replay in settings.replays or ("",):
        for rate in settings.learning_rates:
            runs.append(Update("sft", "post", rate, replay=replay))
            runs += [Update("graft", donor, rate, replay=replay) for donor in settings.donors]
            runs += [Update("opsd", "post", rate, divergence, replay) for divergence in settings.opsd]
    return runs


def replay_of(settings: LmDemoSettings, update: Update) -> str:
    """What is mixed into this update's new facts: its own replay, else the settings' one."""
    return update.replay or settings.replay


def grid(settings: LmDemoSettings) -> list[tuple[float, str | None, float]]:
    """Every (λ, mask, ρ) merged for every update snapshot."""
    return [(lam, mask, rho) for lam in settings.lambdas for mask, rho in settings.masks]
