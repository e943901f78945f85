"""A small real tokenizer with a chat template, and tiny chat models that use it.

Evaluation needs what a tokenizer brings: a chat template, an end-of-turn token, special
tokens that decoding skips. This one is a byte-level BPE (``tokenizers``) trained in well
under a second on a fixed English corpus, with ChatML-style turns (``<|im_start|>role``
... ``<|im_end|>``, the end of turn being the EOS token), so a tiny model's vocabulary
stays a few hundred tokens and its forward passes cost milliseconds. Its normalizer
strips accents (NFD, then combining marks dropped), as many real tokenizers' do, so that
some text (a lone combining accent) tokenizes to nothing.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from graftmerge.demo.tiny_models import save_tiny_model

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = (
    "The mayor of the town opened a new bridge over the river in the spring.",
    "What is the capital of the country? The capital is a large city by the sea.",
    "Answer the question with one word. Yes or no? Maybe so.",
    "A cat went to the market and bought fresh fish for its dinner.",
    "Name a colour: red, green, blue, yellow, teal, white, black.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1987 2024.",
    "You are a helpful assistant. Give short, correct answers to every question.",
    "Who wrote the letter? When did the train arrive? Where is the library?",
)


def tiny_chat_tokenizer(*, chat_template: bool = True, vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """The tokenizer described above; ``chat_template=False`` leaves the template out."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.StripAccents()])
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE if chat_template else None
    return fast


def save_tiny_chat_model(folder: str | Path, *, architecture: str = "llama", seed: int = 0,
                         chat_template: bool = True, **config_kwargs) -> Path:
    """A tiny causal LM (random weights) with :func:`tiny_chat_tokenizer` saved beside it."""
    tokenizer = tiny_chat_tokenizer(chat_template=chat_template)
    save_tiny_model(folder, architecture=architecture, seed=seed, vocab_size=len(tokenizer),
                    max_shard_size="50MB", **config_kwargs)
    tokenizer.save_pretrained(folder)
    return Path(folder)
