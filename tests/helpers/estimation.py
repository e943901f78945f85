"""Fisher-estimation support for tests: tiny models, rollouts, a tiny offline tokenizer,
brute-force references computed one sequence at a time, and the accumulator run on them."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from graftmerge.demo.tiny_models import save_tiny_model
from graftmerge.estimate.accumulator import FisherAccumulator
from graftmerge.estimate.batching import pad_batch, plan_batches
from graftmerge.estimate.rollouts import Rollout

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 48, "vocab_size": 128}


def make_model(folder: Path, *, tied: bool = True, seed: int = 0, **overrides) -> Path:
    save_tiny_model(folder, seed=seed, tie_word_embeddings=tied, **{**TINY, **overrides})
    return folder


def load(folder: Path, dtype: torch.dtype = torch.float64):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def random_rollouts(count: int, *, seed: int = 0, vocab: int = 128) -> list[Rollout]:
    """Mixed prompt and completion lengths, so batches need padding."""
    generator = torch.Generator().manual_seed(seed)
    rollouts = []
    for _ in range(count):
        prompt = int(torch.randint(1, 9, (), generator=generator))
        completion = int(torch.randint(1, 12, (), generator=generator))
        ids = torch.randint(0, vocab, (prompt + completion,), generator=generator).tolist()
        rollouts.append(Rollout(tuple(ids[:prompt]), tuple(ids[prompt:])))
    return rollouts


def write_jsonl(path: Path, rollouts: list[Rollout]) -> Path:
    with open(path, "w") as handle:
        for r in rollouts:
            handle.write(
                json.dumps(
                    {"prompt_ids": list(r.prompt_ids), "completion_ids": list(r.completion_ids)}
                )
                + "\n"
            )
    return path


def sequence_loss(model: nn.Module, rollout: Rollout) -> torch.Tensor:
    """L_n written directly: mean NLL of the completion tokens of one unpadded sequence."""
    ids = torch.tensor([rollout.prompt_ids + rollout.completion_ids])
    log_probs = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
    start = len(rollout.prompt_ids)
    targets = ids[0, start:]
    return -log_probs[start - 1 : -1].gather(1, targets[:, None]).mean()


def brute_force_diagonal(model: nn.Module, rollouts: list[Rollout]) -> dict[str, torch.Tensor]:
    """(1/N) Σ_n (∇L_n)², one backward per sequence."""
    named = dict(model.named_parameters())
    for p in named.values():
        p.requires_grad_(True)
    total = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in named.items()}
    for rollout in rollouts:
        grads = torch.autograd.grad(sequence_loss(model, rollout), list(named.values()))
        for n, g in zip(named, grads, strict=True):
            total[n] += g.double() ** 2
    return {n: t / len(rollouts) for n, t in total.items()}


def brute_force_kfac(
    model: nn.Module, rollouts: list[Rollout]
) -> dict[str, dict[str, torch.Tensor]]:
    """P, Q of every Linear and of an untied embedding, from activations and output gradients
    captured with ``retain_grad`` one sequence at a time."""
    captured: dict[str, tuple] = {}

    def capture(name):
        def hook(module, args, output):
            output.retain_grad()
            captured[name] = (args[0].detach(), output)

        return hook

    modules = {n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))}
    handles = [m.register_forward_hook(capture(n)) for n, m in modules.items()]
    for p in model.parameters():
        p.requires_grad_(True)
    sums: dict[str, dict[str, torch.Tensor]] = {}
    tokens = 0
    try:
        for rollout in rollouts:
            captured.clear()
            sequence_loss(model, rollout).backward()
            tokens += rollout.length
            for name, (a, h) in captured.items():
                g = h.grad[0].double()
                entry = sums.setdefault(name, {"aa": 0, "gg": 0, "count": 0})
                entry["gg"] = entry["gg"] + g.T @ g
                if isinstance(modules[name], nn.Embedding):
                    entry["count"] = (
                        entry["count"]
                        + torch.bincount(a[0], minlength=modules[name].num_embeddings).double()
                    )
                else:
                    entry["aa"] = entry["aa"] + a[0].double().T @ a[0].double()
    finally:
        for handle in handles:
            handle.remove()
    n = len(rollouts)
    out = {}
    for name, entry in sums.items():
        if isinstance(modules[name], nn.Embedding):
            out[name] = {"P": entry["count"] / tokens, "Q": entry["gg"] / n}
        else:
            out[name] = {"P": entry["gg"] / n, "Q": entry["aa"] / tokens}
    return out


CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)
WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "sat",
    "ran",
    "on",
    "mat",
    "home",
    "fast",
    "slow",
    "red",
    "blue",
    "is",
    "was",
    "and",
]


def save_tiny_tokenizer(folder: Path) -> None:
    """A whitespace word-level tokenizer with a chat template, built offline (no Hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "</s>", "<user>", "<assistant>", "<system>"]
    vocab = {token: i for i, token in enumerate(specials + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="</s>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)


def caches_close(a_path: Path, b_path: Path, rtol: float) -> float:
    """Largest relative difference between two caches (diagonals and KFAC eigenvalues/matrices)."""
    from graftmerge.formats.fisher_cache import open_fisher_cache

    a, b = open_fisher_cache(a_path), open_fisher_cache(b_path)
    assert a.names("diagonal") == b.names("diagonal") and a.names("kfac") == b.names("kfac")
    worst = 0.0
    for name in a.names("diagonal"):
        x, y = a.diagonal(name), b.diagonal(name)
        worst = max(worst, float((x - y).abs().max() / x.abs().max().clamp_min(1e-30)))
    for name in a.names("kfac"):
        x, y = a.kfac(name), b.kfac(name)
        for (U1, S1), (U2, S2) in (((x.U, x.S), (y.U, y.S)), ((x.V, x.D), (y.V, y.D))):
            m1 = S1 if U1 is None else U1 @ torch.diag(S1) @ U1.T
            m2 = S2 if U2 is None else U2 @ torch.diag(S2) @ U2.T
            worst = max(worst, float((m1 - m2).abs().max() / m1.abs().max().clamp_min(1e-30)))
    assert worst <= rtol, worst
    return worst


def accumulate(model, rollouts, batch_size: int, **options):
    with FisherAccumulator(model, dtype=torch.float64, **options) as accumulator:
        for indices in plan_batches([r.length for r in rollouts], batch_size):
            accumulator.accumulate(pad_batch([rollouts[i] for i in indices]))
    return accumulator.means()


def relative_error(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).abs().max() / y.abs().max())
