"""Sample completions from the post model itself (temperature 1, top-p 1 by default).

Sampling from θpost is what makes the estimate the true Fisher rather than the
empirical one. The loop is our own (a KV cache and a seeded generator) rather than
``generate()``, whose defaults from generation_config.json (top_k, repetition
penalty, ...) would silently change the distribution. Every prompt gets its own
generator seeded from (seed, prompt index), so results do not depend on how prompts
are split across processes.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Sequence

import torch
from torch import nn

from graftmerge.errors import GraftError


def prompt_generator(seed: int, index: int, device: torch.device) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def sample_next_tokens(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator
) -> torch.Tensor:
    """(B,) token ids from (B, V) logits: softmax(logits / T), nucleus-truncated to mass top_p."""
    probs = torch.softmax(logits.to(torch.float64) / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of strictly more likely tokens
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def check_sampling(temperature: float, top_p: float, samples: int, max_new_tokens: int) -> None:
    if temperature <= 0:
        raise GraftError(f"--temperature must be > 0 (got {temperature}); the Fisher needs samples")
    if not 0 < top_p <= 1:
        raise GraftError(f"--top-p must be in (0, 1] (got {top_p})")
    if samples < 1 or max_new_tokens < 1:
        raise GraftError("--samples-per-prompt and --max-new-tokens must be at least 1")


@torch.no_grad()
def sample_completions(
    model: nn.Module,
    prompt_ids: Sequence[int],
    *,
    samples: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    generator: torch.Generator,
    eos_ids: Sequence[int],
) -> list[tuple[int, ...]]:
    """``samples`` completions of one prompt, each cut after its first EOS (kept: it was sampled)."""
    device = next(model.parameters()).device
    input_ids = torch.tensor([list(prompt_ids)] * samples, device=device)
    eos = torch.tensor(list(eos_ids) or [-1], device=device)
    # transformers ≥ 5.2x names the KV cache ``cache``; older versions ``past_key_values``
    cache_argument = (
        "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    )
    out = model(input_ids=input_ids, use_cache=True)
    steps = []
    finished = torch.zeros(samples, dtype=torch.bool, device=device)
    for _ in range(max_new_tokens):
        tokens = sample_next_tokens(out.logits[:, -1], temperature, top_p, generator)
        steps.append(tokens)
        finished |= torch.isin(tokens, eos)
        if finished.all():
            break
        cache = out["cache"] if "cache" in out else out["past_key_values"]
        out = model(input_ids=tokens[:, None], use_cache=True, **{cache_argument: cache})
    rows = torch.stack(steps, dim=1).tolist()
    eos_set = set(eos.tolist())
    completions = []
    for row in rows:
        cut = next((i + 1 for i, token in enumerate(row) if token in eos_set), len(row))
        completions.append(tuple(row[:cut]))
    return completions


def eos_token_ids(model: nn.Module, tokenizer=None) -> list[int]:
    """EOS ids from the generation config, the model config, or the tokenizer."""
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            return [value] if isinstance(value, int) else list(value)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return [tokenizer.eos_token_id]
    return []
