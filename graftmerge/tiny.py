"""Generate tiny Qwen3-shaped checkpoints (post, donor, donor_ft) for demos and tests.

Real transformers configs and real sharded safetensors, random weights: enough
to exercise every code path of a graft without downloading anything.
"""

from __future__ import annotations

from pathlib import Path

import torch


def tiny_qwen3_config(
    *,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    intermediate_size: int = 96,
    vocab_size: int = 256,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    tie_word_embeddings: bool = True,
):
    from transformers import Qwen3Config

    return Qwen3Config(
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=hidden_size // num_attention_heads,
        max_position_embeddings=512,
        tie_word_embeddings=tie_word_embeddings,
        torch_dtype="float32",
    )


def save_tiny_model(
    folder: str | Path,
    *,
    seed: int = 0,
    base: dict[str, torch.Tensor] | None = None,
    noise: float = 0.02,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str = "40KB",
    **config_kwargs,
) -> dict[str, torch.Tensor]:
    """Save a Qwen3ForCausalLM with random weights (or ``base`` + noise) as sharded safetensors.

    Returns the saved state dict so callers can derive related checkpoints.
    """
    from transformers import Qwen3ForCausalLM

    config = tiny_qwen3_config(**config_kwargs)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    if base is not None:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                parameter.copy_(base[name] + noise * torch.randn(parameter.shape, generator=generator))
    model = model.to(dtype)
    folder = Path(folder)
    model.save_pretrained(folder, max_shard_size=max_shard_size, safe_serialization=True)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def make_graft_inputs(root: str | Path, *, seed: int = 0, **config_kwargs) -> dict[str, Path]:
    """post / base / base-ft folders of one tiny architecture under ``root``."""
    root = Path(root)
    donor = save_tiny_model(root / "base", seed=seed, **config_kwargs)
    save_tiny_model(root / "post", seed=seed + 1, base=donor, noise=0.05, **config_kwargs)
    save_tiny_model(root / "base-ft", seed=seed + 2, base=donor, noise=0.02, **config_kwargs)
    return {"post": root / "post", "donor": root / "base", "donor_ft": root / "base-ft"}
