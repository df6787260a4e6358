"""A ChatML tokenizer small enough to read in a test: one token per printable character after the special tokens,
so every rendered turn marker and every reply character has an id a test can name."""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def chatml_tokenizer(*extra_specials: str) -> Tokenizer:
    """`<|endoftext|>` (also the unknown token), `<|im_start|>`, `<|im_end|>`, then `extra_specials`, then the
    printable characters, each its own token."""
    specials = [*CHATML_SPECIALS, *extra_specials]
    vocab = {t: i for i, t in enumerate([*specials, *string.printable])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(specials)
    return tokenizer
