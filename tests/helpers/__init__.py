"""Code shared by the test modules (no tests here); fixtures live in tests/conftest.py.

runners        console scripts in this process or as real processes; the one-line error contract
models         read, copy, hash and compare model folders
configs        graft and task_arithmetic configs as YAML text
fisher_caches  random diagonal, mixed and sharded Fisher caches
references     brute-force graft and top-k mask
estimation     tiny models, rollouts, a tokenizer, brute-force Fisher estimates
fake_hub       a fake Hugging Face Hub and HF cache
lora           PEFT adapters and PEFT's own deltas
smollm2        SmolLM2 imported from its GGUF once per session, shared by the xdist workers
warm_processes real mergekit-yaml processes forked from a warm parent (no start-up per process)
ggufs          a tiny complete llama GGUF
tiny_tokenizer a small trained BPE tokenizer with a chat template, and a tiny chat model
hf_cache       a folder placed in a Hugging Face cache as a downloaded snapshot
"""
