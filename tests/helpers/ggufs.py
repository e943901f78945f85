"""A tiny but complete llama GGUF (float32, no tokenizer), written with gguf-py's own writer.

For tests of what ``graftmerge import-gguf`` does around the import (output folders, locks,
overwrites) that need a GGUF it accepts, without dequantising a real model's: transformers
reads a real model's metadata (tens of thousands of tokenizer entries) in seconds; this one
at once.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

WIDTH, FFN, VOCAB = 32, 64, 16


def tiny_llama_gguf(path: Path, blocks: int = 1, seed: int = 0) -> Path:
    """``path``: llama metadata and every tensor of ``blocks`` decoder blocks, random values."""
    from gguf import GGUFWriter

    generator = np.random.default_rng(seed)
    shapes = {"token_embd.weight": (VOCAB, WIDTH), "output_norm.weight": (WIDTH,)}
    for block in range(blocks):
        shapes.update({f"blk.{block}.{part}.weight": (WIDTH, WIDTH)
                       for part in ("attn_q", "attn_k", "attn_v", "attn_output")})
        shapes.update({f"blk.{block}.ffn_gate.weight": (FFN, WIDTH), f"blk.{block}.ffn_up.weight": (FFN, WIDTH),
                       f"blk.{block}.ffn_down.weight": (WIDTH, FFN), f"blk.{block}.attn_norm.weight": (WIDTH,),
                       f"blk.{block}.ffn_norm.weight": (WIDTH,)})
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(blocks)
    writer.add_context_length(64)
    writer.add_embedding_length(WIDTH)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    for name, shape in shapes.items():
        writer.add_tensor(name, (generator.standard_normal(shape) * 0.1).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
