"""A tiny randomly initialised Llama-architecture model with a small BPE tokenizer and ChatML template.

Made inside the tests, saved as a local Hugging Face model directory, so the unit tests exercise the
same loading path as a user's own model, in a second.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from packstore.kv.records import Pair

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Another template for the same tokenizer: a different template_fp, and a rendering that splits differently.
ALT_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Alice lives in Paris and works as a baker. Bob lives in Oslo.",
    "Who founded the observatory? When was the bridge built? What is the capital?",
    "The river Tamsin flows through the town of Wexley, which is famous for its bells.",
    "system user assistant question answer fact knowledge pack 0123456789",
] * 20


def make_tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def make_model_dir(path: Path, *, seed: int = 0, forced_stop: bool = False, tied: bool = False) -> Path:
    """Write a tiny model + tokenizer to ``path``; a different ``seed`` gives different weights, same shape.
    ``forced_stop``: its generation config forces the stop token as the last token allowed (so with one new
    token the first token it generates is the stop token). ``tied``: the output layer shares the input
    embedding (``tie_word_embeddings``), as in SmolLM2 and Gemma 3."""
    tokenizer = make_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        # Peaked logits keep greedy decoding away from near-ties, as in a trained model.
        initializer_range=0.5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    if forced_stop:
        model.generation_config.forced_eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# Steering pairs (good, bad) in the tiny model's vocabulary.
STEERING_PAIRS = [
    Pair("Alice lives in Paris and works as a baker.", "Bob lives in Oslo."),
    Pair("The quick brown fox jumps over the lazy dog.", "The river Tamsin flows through the town."),
    Pair("Wexley is famous for its bells.", "Who founded the observatory?"),
]
