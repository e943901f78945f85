"""The paper's minimal model (§3), run numerically: why grafting forgets less than SFT.

Two linear-regression tasks, ``x ~ D_T``, ``y = β_Tᵀx`` (T ∈ {A, B}), fitted by a gated
mixture of two linear experts::

    ŷ(x) = g(x)·w_Aᵀx + (1 − g(x))·w_Bᵀx,    g(x) = σ(φᵀx),    θ = (w_A, w_B, φ)

With squared loss ``L_B = ½·E_B[(ŷ − y)²]`` and a gate that is constant (= ε) on task-B
inputs, ``∇_{w_A} L_B = ε·Σ_B r_B`` and ``∇_{w_B} L_B = (1 − ε)·Σ_B r_B`` with
``r_B = ε w_A + (1 − ε) w_B − β_B``: fine-tuning on B writes to the task-A expert in the
ratio ε/(1 − ε) (Eq. 1). A post-trained model routes more of B through expert A
(ε_P > ε_D), so its SFT damages task A more than an update learned on the donor.

The setting is built so that ε_D < ε_P arises from training, not by hand:

* **Data.** ``x ~ N(μ_T, σ²I)`` in ``dim`` dimensions; ‖μ_A‖ = ‖μ_B‖ = ``mean_norm`` and
  cos(μ_A, μ_B) = ``mean_cosine`` > 0 — the two domains share a component, as related
  text does. A linear gate separates them along μ_A − μ_B. β_A, β_B ~ N(0, I/dim).
* **Pretraining (donor θ_D).** Full-batch gradient descent on the 50/50 mixture of A and
  B from a small random init, stopped early (``pretrain_steps``), best of
  ``pretrain_restarts`` inits by pretraining loss. Its targets are ``(β_T + s·ξ_T)ᵀx``
  with ξ_T ~ N(0, I/dim) projected off span(μ_A, μ_B), s = ``pretrain_shift``: the
  donor knows both tasks only roughly — the fine structure of task B is genuinely new
  knowledge, as the paper's new tasks are — but it learns the assignment (gate ≈ ε_D ≪ 1
  on B). The mixture is symmetric under (w_A, w_B, φ) → (w_B, w_A, −φ); the donor is
  oriented so that expert A is the one the gate picks on task-A inputs.
* **Post-training (θ_P).** Gradient descent from θ_D on task A only. On A inputs the gate
  gradient keeps pushing g → 1 (expert A fits A better than expert B does); that
  gradient is a weighted mean of task-A inputs, which carries the shared component of
  μ_A, so φᵀx grows on task-B inputs too: ε_P > ε_D — the narrow-data "implicit task
  inference" of Kotha et al. that the paper cites.
* **Fine-tuning on B.** Plain full-batch gradient descent (no Adam: a per-coordinate
  normaliser would rescale exactly the gradient ratio Eq. 1 is about), for every
  learning rate in ``finetune_lrs``, snapshotted at every step count in ``finetune_steps``.
  The same runs are made from θ_P (SFT) and from θ_D (the donor of the graft).

Three curves of (task-A loss, task-B loss) on held-out samples, all starting at θ_P:
SFT (every snapshot of θ_P-ft), SFT-then-merge ``θ_P + λ(θ_P-ft − θ_P)`` and graft
``θ_P + λ(θ_D-ft − θ_D)`` for every snapshot and λ in ``lambdas``. Each curve's Pareto
frontier is compared at matched task-B gain: the task-A loss increase over θ_P where the
frontier (linearly interpolated) reaches a given fraction of the way from θ_P's task-B
loss to the best task-B loss that every method reaches. The outcome is measured and
reported, never assumed.

How the setting was chosen: with a small ``pretrain_shift`` (the donor already knows B)
θ_P's task-B loss is mostly the damage post-training did through the gate, which a donor
update knows nothing about; there the graft barely improves task B and loses to SFT at
matched gain. With B mostly new to the donor (the default), the graft loses less task A
at matched task-B gain, as the gradient-routing argument predicts, though SFT still
reaches lower task-B losses than any graft in the λ sweep.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure

METHODS = ("sft", "sft_merge", "graft")
LABELS = {"sft": "SFT", "sft_merge": "SFT + merge", "graft": "graft (donor Δ)"}


@dataclass(frozen=True)
class GatedExpertsConfig:
    """Everything that decides a run; the defaults run in a few seconds on a CPU."""

    seed: int = 0
    dim: int = 16
    n_train: int = 512  # samples per task for training
    n_test: int = 4096  # held-out samples per task for the losses
    mean_norm: float = 3.0  # ‖μ_A‖ = ‖μ_B‖
    mean_cosine: float = 0.5  # cos(μ_A, μ_B): the shared component post-training pushes along
    noise_std: float = 0.5  # σ of x around its task mean
    pretrain_shift: float = 3.0  # pretraining targets are β_T + shift·ξ_T off the means: B is new
    init_std: float = 0.1
    pretrain_lr: float = 0.05
    pretrain_steps: int = 3000
    pretrain_weight_decay: float = 0.0
    pretrain_restarts: int = 5  # random inits; the lowest pretraining loss is the donor
    posttrain_lr: float = 0.05
    posttrain_steps: int = 2000
    finetune_lrs: tuple[float, ...] = (0.01, 0.03, 0.1)
    finetune_steps: tuple[int, ...] = (5, 10, 20, 40, 80, 160, 320)
    lambdas: tuple[float, ...] = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0,
                                  1.1, 1.25, 1.5, 1.75, 2.0)
    gain_levels: tuple[float, ...] = (0.25, 0.5, 0.75)


@dataclass(frozen=True)
class Tasks:
    """Samples of both tasks (float64) and the ground truth they come from."""

    x_a: torch.Tensor
    y_a: torch.Tensor
    x_b: torch.Tensor
    y_b: torch.Tensor
    x_a_test: torch.Tensor
    y_a_test: torch.Tensor
    x_b_test: torch.Tensor
    y_b_test: torch.Tensor
    y_a_pre: torch.Tensor  # the pretraining corpus's (older, partly wrong) targets
    y_b_pre: torch.Tensor
    beta_a: torch.Tensor
    beta_b: torch.Tensor
    mu_a: torch.Tensor
    mu_b: torch.Tensor


def make_tasks(config: GatedExpertsConfig) -> Tasks:
    """Two Gaussian input clusters with a shared mean component, and linear targets."""
    gen = torch.Generator().manual_seed(config.seed)
    d = config.dim

    def normal(*shape: int) -> torch.Tensor:
        """Standard normal float64 draws from the run's one generator (so the seed fixes every draw)."""
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    u, v = torch.linalg.qr(normal(d, 2))[0].T  # orthonormal: shared and task-specific directions
    half = math.acos(config.mean_cosine) / 2  # μ_A, μ_B sit ±half an angle from u
    mu_a = config.mean_norm * (math.cos(half) * u + math.sin(half) * v)
    mu_b = config.mean_norm * (math.cos(half) * u - math.sin(half) * v)
    beta_a, beta_b = normal(d) / math.sqrt(d), normal(d) / math.sqrt(d)

    def sample(mu: torch.Tensor, beta: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` inputs x ~ N(μ, σ²I) and their true targets βᵀx."""
        x = mu + config.noise_std * normal(n, d)
        return x, x @ beta

    x_a, y_a = sample(mu_a, beta_a, config.n_train)
    x_b, y_b = sample(mu_b, beta_b, config.n_train)
    x_at, y_at = sample(mu_a, beta_a, config.n_test)
    x_bt, y_bt = sample(mu_b, beta_b, config.n_test)
    # pretraining's targets differ from the true ones only off the task means: the tasks'
    # fine structure is what pretraining got wrong and what post-training / fine-tuning add
    off_means = torch.eye(d, dtype=torch.float64) - torch.outer(u, u) - torch.outer(v, v)
    shift = config.pretrain_shift / math.sqrt(d)
    y_a_pre = x_a @ (beta_a + shift * off_means @ normal(d))
    y_b_pre = x_b @ (beta_b + shift * off_means @ normal(d))
    return Tasks(x_a, y_a, x_b, y_b, x_at, y_at, x_bt, y_bt, y_a_pre, y_b_pre,
                 beta_a, beta_b, mu_a, mu_b)


def split(theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """θ is one flat vector (so Δ and θ + λΔ are plain arithmetic): (w_A, w_B, φ)."""
    return theta.chunk(3)


def gate(theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """g_φ(x) = σ(φᵀx), the weight of expert A."""
    return torch.sigmoid(x @ split(theta)[2])


def predict(theta: torch.Tensor, x: torch.Tensor, constant_gate: float | None = None) -> torch.Tensor:
    """ŷ(x); ``constant_gate`` replaces g_φ(x) by a constant (the paper's simplification)."""
    w_a, w_b, _ = split(theta)
    g = gate(theta, x) if constant_gate is None else torch.full_like(x[:, 0], constant_gate)
    return g * (x @ w_a) + (1 - g) * (x @ w_b)


def loss(theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
         constant_gate: float | None = None) -> torch.Tensor:
    """½·mean (ŷ − y)², the sample version of the paper's L = ½ rᵀΣr."""
    return 0.5 * (predict(theta, x, constant_gate) - y).square().mean()


def expert_gradients(theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                     constant_gate: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(∇_{w_A} L, ∇_{w_B} L) by autograd: what one step of fine-tuning writes to each expert."""
    theta = theta.detach().clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(loss(theta, x, y, constant_gate), theta)
    w_a, w_b, _ = split(grad)
    return w_a, w_b


def descend(theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor, lr: float, steps: int,
            snapshots: tuple[int, ...] = (), weight_decay: float = 0.0) -> dict[int, torch.Tensor]:
    """Full-batch gradient descent (deterministic); returns θ after ``steps`` and at each snapshot."""
    theta = theta.detach().clone().requires_grad_(True)
    kept: dict[int, torch.Tensor] = {}
    for step in range(1, steps + 1):
        (grad,) = torch.autograd.grad(loss(theta, x, y), theta)
        with torch.no_grad():
            theta -= lr * (grad + weight_decay * theta)
        if step in snapshots or step == steps:
            kept[step] = theta.detach().clone()
    if steps == 0:
        kept[0] = theta.detach().clone()
    return kept


def pretrain(config: GatedExpertsConfig, tasks: Tasks) -> tuple[torch.Tensor, list[float]]:
    """θ_D: early-stopped descent on the A+B mixture, best of several random inits.

    A mixture of experts has a second basin from a small random init: a weak gate and two
    non-specialised experts whose difference, times the gate's slope, fits the task switch.
    Restarts picked by pretraining loss land in the specialised basin (the paper's
    assumption that pretraining learns the assignment); the loss is the only criterion.
    Returns θ_D, oriented so that expert A is the one the gate picks on task A, and the
    pretraining loss of every restart.
    """
    x = torch.cat([tasks.x_a, tasks.x_b])
    y = torch.cat([tasks.y_a_pre, tasks.y_b_pre])
    best: torch.Tensor | None = None
    restart_losses: list[float] = []
    for restart in range(config.pretrain_restarts):
        gen = torch.Generator().manual_seed(1009 * config.seed + restart + 1)
        init = config.init_std * torch.randn(3 * config.dim, generator=gen, dtype=torch.float64)
        theta = descend(init, x, y, config.pretrain_lr, config.pretrain_steps,
                        weight_decay=config.pretrain_weight_decay)[config.pretrain_steps]
        restart_losses.append(float(loss(theta, x, y)))
        if restart_losses[-1] == min(restart_losses):
            best = theta
    assert best is not None, "pretrain_restarts must be at least 1"
    if gate(best, tasks.x_a).mean() < gate(best, tasks.x_b).mean():
        w_a, w_b, phi = split(best)
        best = torch.cat([w_b, w_a, -phi])  # the same function, experts relabelled
    return best, restart_losses


def posttrain(config: GatedExpertsConfig, tasks: Tasks, donor: torch.Tensor) -> torch.Tensor:
    """θ_P: descent from θ_D on task A only (the narrow post-training distribution)."""
    return descend(donor, tasks.x_a, tasks.y_a, config.posttrain_lr,
                   config.posttrain_steps)[config.posttrain_steps]


def finetune_sweep(config: GatedExpertsConfig, tasks: Tasks,
                   start: torch.Tensor) -> list[tuple[float, int, torch.Tensor]]:
    """(lr, steps, θ-ft) for every learning rate and snapshot: one run per lr on task B."""
    runs = []
    last = max(config.finetune_steps)
    for lr in config.finetune_lrs:
        kept = descend(start, tasks.x_b, tasks.y_b, lr, last, tuple(config.finetune_steps))
        runs.extend((lr, steps, kept[steps]) for steps in config.finetune_steps)
    return runs


def eq1_check(theta: torch.Tensor, x_b: torch.Tensor, y_b: torch.Tensor) -> dict[str, float]:
    """‖∇_{w_A} L_B‖ / ‖∇_{w_B} L_B‖ against ε/(1 − ε), with the gate forced constant and learned."""
    eps = float(gate(theta, x_b).mean())
    predicted = eps / (1 - eps)
    g_a, g_b = expert_gradients(theta, x_b, y_b, constant_gate=eps)
    constant = float(g_a.norm() / g_b.norm())
    g_a, g_b = expert_gradients(theta, x_b, y_b)
    learned = float(g_a.norm() / g_b.norm())
    return {
        "eps": eps,
        "predicted": predicted,
        "ratio_constant_gate": constant,
        "rel_error_constant_gate": abs(constant / predicted - 1),
        "ratio_learned_gate": learned,
        "rel_error_learned_gate": abs(learned / predicted - 1),
    }


def losses(theta: torch.Tensor, tasks: Tasks) -> tuple[float, float]:
    """(task-A, task-B) loss on the held-out samples."""
    with torch.no_grad():
        return (float(loss(theta, tasks.x_a_test, tasks.y_a_test)),
                float(loss(theta, tasks.x_b_test, tasks.y_b_test)))


def pareto_frontier(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Points no other point beats on both losses, by increasing task-A loss."""
    frontier: list[dict[str, Any]] = []
    for point in sorted(points, key=lambda p: (p["loss_a"], p["loss_b"])):
        if not frontier or point["loss_b"] < frontier[-1]["loss_b"]:
            frontier.append(point)
    return frontier


def loss_a_at(frontier: list[dict[str, Any]], target_b: float) -> float | None:
    """Task-A loss where the frontier first reaches task-B loss ``target_b`` (linear in between)."""
    for i, point in enumerate(frontier):
        if point["loss_b"] <= target_b:
            if i == 0:
                return point["loss_a"]
            prev = frontier[i - 1]
            t = (prev["loss_b"] - target_b) / (prev["loss_b"] - point["loss_b"])
            return prev["loss_a"] + t * (point["loss_a"] - prev["loss_a"])
    return None


def run_gated_experts(config: GatedExpertsConfig | None = None) -> dict[str, Any]:
    """Pretrain, post-train, check Eq. 1, and compare SFT / SFT + merge / graft; JSON-ready.

    Runs on one CPU thread: the tensors are tiny, so thread hand-offs would cost more than
    the arithmetic, and one thread makes the float64 reductions the same on every machine.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(config or GatedExpertsConfig())
    finally:
        torch.set_num_threads(threads)


def _run(config: GatedExpertsConfig) -> dict[str, Any]:
    tasks = make_tasks(config)
    donor, restart_losses = pretrain(config, tasks)
    post = posttrain(config, tasks, donor)

    post_a, post_b = losses(post, tasks)
    start = {"loss_a": post_a, "loss_b": post_b, "lr": 0.0, "steps": 0, "lam": 0.0}
    # θ_P itself starts the SFT curve; the merge and graft curves reach it at λ = 0
    curves: dict[str, list[dict[str, Any]]] = {"sft": [start], "sft_merge": [], "graft": []}
    for lr, steps, ft in finetune_sweep(config, tasks, post):
        a, b = losses(ft, tasks)
        curves["sft"].append({"loss_a": a, "loss_b": b, "lr": lr, "steps": steps, "lam": 1.0})
        for lam in config.lambdas:
            a, b = losses(post + lam * (ft - post), tasks)
            curves["sft_merge"].append({"loss_a": a, "loss_b": b, "lr": lr, "steps": steps,
                                        "lam": lam})
    for lr, steps, ft in finetune_sweep(config, tasks, donor):
        delta = ft - donor
        for lam in config.lambdas:
            a, b = losses(post + lam * delta, tasks)
            curves["graft"].append({"loss_a": a, "loss_b": b, "lr": lr, "steps": steps,
                                    "lam": lam})
    frontiers = {m: pareto_frontier(curves[m]) for m in METHODS}

    best_b = {m: min(p["loss_b"] for p in curves[m]) for m in METHODS}
    common_best = max(best_b.values())  # the task-B loss every method reaches
    matched = []
    for level in config.gain_levels:
        target = post_b - level * (post_b - common_best)
        row: dict[str, Any] = {"level": level, "target_loss_b": target}
        for m in METHODS:
            a = loss_a_at(frontiers[m], target)
            row[m] = None if a is None else a - post_a
        matched.append(row)

    donor_a, donor_b = losses(donor, tasks)
    return {
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(config).items()},
        "pretrain_restart_losses": restart_losses,
        "eps_donor": float(gate(donor, tasks.x_b).mean()),
        "eps_post": float(gate(post, tasks.x_b).mean()),
        "gate_on_a_donor": float(gate(donor, tasks.x_a).mean()),
        "gate_on_a_post": float(gate(post, tasks.x_a).mean()),
        "donor_losses": {"loss_a": donor_a, "loss_b": donor_b},
        "post_losses": {"loss_a": post_a, "loss_b": post_b},
        "eq1": {"donor": eq1_check(donor, tasks.x_b, tasks.y_b),
                "post": eq1_check(post, tasks.x_b, tasks.y_b)},
        "curves": curves,
        "frontiers": frontiers,
        "best_loss_b": best_b,
        "common_best_loss_b": common_best,
        "matched_gain": matched,
    }


def format_gated_experts(result: dict[str, Any]) -> str:
    """A few lines: the ε's, Eq. 1 at both checkpoints, and the matched-gain table."""
    lines = [
        f"gate on task B: donor ε_D = {result['eps_donor']:.3f}, post ε_P = {result['eps_post']:.3f}"
        f"  (on task A: {result['gate_on_a_donor']:.3f} → {result['gate_on_a_post']:.3f})",
        f"losses A / B: donor {result['donor_losses']['loss_a']:.4f} / "
        f"{result['donor_losses']['loss_b']:.4f}, post {result['post_losses']['loss_a']:.4f} / "
        f"{result['post_losses']['loss_b']:.4f}",
    ]
    for name, eq in result["eq1"].items():
        lines.append(
            f"Eq. 1 at {name}: ε/(1−ε) = {eq['predicted']:.4f}; ‖∇w_A‖/‖∇w_B‖ = "
            f"{eq['ratio_constant_gate']:.4f} (constant gate), "
            f"{eq['ratio_learned_gate']:.4f} (learned gate, {100 * eq['rel_error_learned_gate']:.1f}% off)"
        )
    lines.append("task-A loss increase at matched task-B gain (fraction of the way to the "
                 "best task-B loss all methods reach):")
    lines.append(f"  {'gain':>5} {'target L_B':>10} " + " ".join(f"{LABELS[m]:>16}" for m in METHODS))
    for row in result["matched_gain"]:
        cells = " ".join(f"{'—' if row[m] is None else f'{row[m]:+.5f}':>16}" for m in METHODS)
        lines.append(f"  {100 * row['level']:>4.0f}% {row['target_loss_b']:>10.4f} {cells}")
    return "\n".join(lines)


def plot_gated_experts(result: dict[str, Any], path: str | os.PathLike) -> Path:
    """A PNG: every point and the Pareto frontier of each method, task-A vs task-B loss.

    Drawn on a bare :class:`~matplotlib.figure.Figure` (no pyplot): no GUI backend is
    chosen or needed, and no global pyplot state is touched.
    """
    path = Path(path)
    colors = {"sft": "#c0392b", "sft_merge": "#e67e22", "graft": "#2a7ab9"}
    figure = Figure(figsize=(7.0, 5.0))
    axis = figure.subplots()
    for m in METHODS:
        points = result["curves"][m]
        axis.scatter([p["loss_a"] for p in points], [p["loss_b"] for p in points], s=6,
                     color=colors[m], alpha=0.25)
        front = result["frontiers"][m]
        axis.plot([p["loss_a"] for p in front], [p["loss_b"] for p in front], "-o", ms=3,
                  color=colors[m], label=LABELS[m])
    post = result["post_losses"]
    axis.plot([post["loss_a"]], [post["loss_b"]], "k*", ms=12, label="θ_P (post)")
    for row in result["matched_gain"]:
        axis.axhline(row["target_loss_b"], color="#999999", linestyle=":", linewidth=1)
    axis.set_xscale("log")
    axis.set_xlabel("task-A loss (old task, lower is better)")
    axis.set_ylabel("task-B loss (new task, lower is better)")
    axis.set_title(f"gated linear experts: ε_D = {result['eps_donor']:.2f}, "
                   f"ε_P = {result['eps_post']:.2f}")
    axis.legend(fontsize="small")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=100)
    return path
