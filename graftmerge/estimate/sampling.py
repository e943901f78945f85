"""Sample completions from the post model itself (temperature 1, top-p 1 by default).

Sampling from θpost is what makes the estimate the true Fisher rather than the
empirical one. The loop is our own (a KV cache and a seeded generator) rather than
``generate()``, whose defaults from generation_config.json (top_k, repetition
penalty, ...) would silently change the distribution. Every prompt gets its own
generator seeded from (seed, prompt index), so results do not depend on how prompts
are split across processes. Several prompts share each forward (left padding, an
attention mask and explicit positions), but each prompt's rows are drawn with its own
generator, so results do not depend on which prompts share a batch either (up to the
float rounding that padding may change).
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from graftmerge.errors import GraftError


def prompt_generator(seed: int, index: int, device: torch.device) -> torch.Generator:
    """Prompt ``index``'s own generator, seeded from (seed, index): samples do not depend on sharding."""
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


def check_sampling(
    temperature: float, top_p: float, samples: int, max_new_tokens: int, batch_size: int = 1
) -> None:
    """GraftError for sampling settings that cannot give Fisher samples, before any model is loaded."""
    if temperature <= 0:
        raise GraftError(f"--temperature must be > 0 (got {temperature}); the Fisher needs samples")
    if not 0 < top_p <= 1:
        raise GraftError(f"--top-p must be in (0, 1] (got {top_p})")
    if samples < 1 or max_new_tokens < 1:
        raise GraftError("--samples-per-prompt and --max-new-tokens must be at least 1")
    if batch_size < 1:
        raise GraftError(f"--sample-batch-size must be at least 1 (got {batch_size})")


def _forward_options(model: nn.Module) -> tuple[str, dict]:
    """The KV-cache argument's name, and options for a prefill that keeps only the last logits."""
    parameters = inspect.signature(model.forward).parameters
    # transformers ≥ 5.2x names the KV cache ``cache``; older versions ``past_key_values``
    cache_argument = "cache" if "cache" in parameters else "past_key_values"
    # (rows, prompt length, vocabulary) logits would be the largest tensor of a batch
    last_only = {"logits_to_keep": 1} if "logits_to_keep" in parameters else {}
    return cache_argument, last_only


@torch.no_grad()
def sample_batch(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    samples: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    generators: Sequence[torch.Generator],
    eos_ids: Sequence[int],
    pad_id: int = 0,
) -> list[list[tuple[int, ...]]]:
    """``samples`` completions of each prompt, all prompts in one KV-cache loop.

    Rows are left-padded (attention mask, positions counted from each row's first real
    token) so every row's next-token logits are those of its unpadded prompt. Prompt
    ``i``'s rows are drawn with ``generators[i]`` alone, one multinomial per prompt per
    step, so its completions do not depend on which prompts share the batch. A prompt
    whose rows have all sampled EOS stops drawing; the loop ends when every row has.
    Each completion is cut after its first EOS (kept: it was sampled).
    """
    if len(generators) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(generators)} generators")
    if not prompts:
        return []
    device = next(model.parameters()).device
    input_ids, mask = _left_padded(prompts, samples, pad_id, device)
    positions = (mask.cumsum(dim=1) - 1).clamp_min(0)  # padding: any valid position, masked anyway
    eos = torch.tensor(list(eos_ids) or [-1], device=device)
    cache_argument, last_only = _forward_options(model)

    out = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        **last_only,
    )
    if any(len(prompt) < input_ids.shape[1] for prompt in prompts):
        _check_padded_logits(model, out.logits)
    steps = _decode(
        model,
        out,
        mask,
        positions[:, -1:],
        generators=generators,
        samples=samples,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        eos=eos,
        pad_id=pad_id,
        cache_argument=cache_argument,
    )
    return _completions(steps, eos, samples, len(prompts))


def _completions(
    steps: list[torch.Tensor], eos: torch.Tensor, samples: int, prompts: int
) -> list[list[tuple[int, ...]]]:
    """Each row's tokens cut after its first EOS (kept: it was sampled), grouped by prompt."""
    sampled = torch.stack(steps, dim=1).tolist()
    eos_set = set(eos.tolist())
    completions = []
    for row in sampled:
        cut = next((i + 1 for i, token in enumerate(row) if token in eos_set), len(row))
        completions.append(tuple(row[:cut]))
    return [completions[i * samples : (i + 1) * samples] for i in range(prompts)]


def _left_padded(
    prompts: Sequence[Sequence[int]], samples: int, pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, attention mask), ``samples`` rows per prompt, padded on the left to share one forward."""
    width = max(len(p) for p in prompts)
    rows = len(prompts) * samples
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((rows, width), dtype=torch.long, device=device)
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {i} is empty")
        block = slice(i * samples, (i + 1) * samples)
        input_ids[block, width - len(prompt) :] = torch.tensor(list(prompt), device=device)
        mask[block, width - len(prompt) :] = 1
    return input_ids, mask


def _check_padded_logits(model: nn.Module, logits: torch.Tensor) -> None:
    """GraftError if left padding broke the prefill's next-token logits (rather than sample from NaN)."""
    if not bool(torch.isfinite(logits[:, -1]).all()):
        # e.g. eager attention in float64 turns the padding rows' all-masked softmax into NaN
        implementation = getattr(model.config, "_attn_implementation", None)
        raise GraftError(
            f"the model gives non-finite logits for left-padded prompts "
            f"(attn_implementation {implementation!r}, {logits.dtype}); "
            "pass --attn-implementation sdpa or --sample-batch-size 1"
        )


def _decode(
    model: nn.Module,
    out: Any,
    mask: torch.Tensor,
    position: torch.Tensor,
    *,
    generators: Sequence[torch.Generator],
    samples: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    eos: torch.Tensor,
    pad_id: int,
    cache_argument: str,
) -> list[torch.Tensor]:
    """One (rows,) tensor of tokens per step from the prefill ``out`` on, until every row has sampled EOS."""
    rows, device = mask.shape[0], mask.device
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    active = [True] * len(generators)  # some row of the prompt has not sampled EOS yet
    steps = []
    for step in range(max_new_tokens):
        logits = out.logits[:, -1]
        tokens = torch.full((rows,), pad_id, dtype=torch.long, device=device)
        for i, generator in enumerate(generators):
            if active[i]:
                block = slice(i * samples, (i + 1) * samples)
                tokens[block] = sample_next_tokens(logits[block], temperature, top_p, generator)
        steps.append(tokens)
        finished |= torch.isin(tokens, eos)
        active = finished.view(len(generators), samples).all(dim=1).logical_not().tolist()
        if not any(active) or step == max_new_tokens - 1:
            break
        cache = out["cache"] if "cache" in out else out["past_key_values"]
        mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
        position = position + 1
        out = model(
            input_ids=tokens[:, None],
            attention_mask=mask,
            position_ids=position,
            use_cache=True,
            **{cache_argument: cache},
        )
    return steps


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
    """``samples`` completions of one prompt (:func:`sample_batch` with a batch of one)."""
    return sample_batch(
        model,
        [prompt_ids],
        samples=samples,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        generators=[generator],
        eos_ids=eos_ids,
    )[0]


def eos_token_ids(model: nn.Module, tokenizer=None) -> list[int]:
    """EOS ids from the generation config, the model config, or the tokenizer."""
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            return [value] if isinstance(value, int) else list(value)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return [tokenizer.eos_token_id]
    return []
