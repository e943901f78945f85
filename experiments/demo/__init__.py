"""The small-LM experiment: a Qwen3 trained here on a synthetic world, SFT vs OPSD vs grafts."""
