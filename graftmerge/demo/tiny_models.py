"""Generate tiny checkpoints (post, donor, donor_ft) for demos and tests.

Real transformers configs and real sharded safetensors, random weights: enough
to exercise every code path of a graft without downloading anything. Several
architectures that mergekit knows are available, because masks go wrong where
tensor layouts differ: Qwen3 (the default; q/k norms), Llama (SmolLM2-like),
Qwen2 (q/k/v biases) and GPT-2 (fused q/k/v in a Conv1D ``c_attn`` stored
d_in × d_out, LayerNorm biases, learned position embeddings).
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

# architecture → (transformers config class, causal-LM class); all known to mergekit 0.1.5
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
}


def tiny_config(
    architecture: str = "qwen3",
    *,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    intermediate_size: int = 96,
    vocab_size: int = 256,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    tie_word_embeddings: bool = True,
):
    """A small transformers config of ``architecture`` (one of :data:`ARCHITECTURES`)."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; choose one of {', '.join(ARCHITECTURES)}")
    if architecture == "gpt2":  # its own key names; no grouped KV heads
        return transformers.GPT2Config(
            n_embd=hidden_size,
            n_layer=num_hidden_layers,
            n_inner=intermediate_size,
            vocab_size=vocab_size,
            n_head=num_attention_heads,
            n_positions=512,
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=None,  # the default 50256 lies outside a tiny vocabulary
            eos_token_id=None,
            dtype="float32",
        )
    options = {
        "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "max_position_embeddings": 512,
        "tie_word_embeddings": tie_word_embeddings,
        "dtype": "float32",
    }
    if architecture != "qwen2":  # Qwen2 derives head_dim from hidden_size itself
        options["head_dim"] = hidden_size // num_attention_heads
    return getattr(transformers, ARCHITECTURES[architecture][0])(**options)


def tiny_qwen3_config(**config_kwargs):
    """The Qwen3 config of :func:`tiny_config` (kept for existing callers)."""
    return tiny_config("qwen3", **config_kwargs)


def save_tiny_model(
    folder: str | Path,
    *,
    seed: int = 0,
    base: dict[str, torch.Tensor] | None = None,
    noise: float = 0.02,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str = "40KB",
    architecture: str = "qwen3",
    **config_kwargs,
) -> dict[str, torch.Tensor]:
    """Save a causal LM of ``architecture`` with random weights (or ``base`` + noise) as sharded safetensors.

    Returns the saved state dict so callers can derive related checkpoints.
    """
    config = tiny_config(architecture, **config_kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, ARCHITECTURES[architecture][1])(config)
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
    """post / base / base-ft folders of one tiny architecture under ``root``.

    ``config_kwargs`` go to :func:`save_tiny_model` (``architecture=`` included).
    """
    root = Path(root)
    donor = save_tiny_model(root / "base", seed=seed, **config_kwargs)
    save_tiny_model(root / "post", seed=seed + 1, base=donor, noise=0.05, **config_kwargs)
    save_tiny_model(root / "base-ft", seed=seed + 2, base=donor, noise=0.02, **config_kwargs)
    return {"post": root / "post", "donor": root / "base", "donor_ft": root / "base-ft"}
