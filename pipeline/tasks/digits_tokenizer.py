"""The digits tokenizer of ``reverse_digits``, shipped as a real ``tokenizer.json``.

A vocabulary of 14 tokens, one per character: ids 0-2 are the special tokens ``<pad> <bos> <eos>``
(the same ids as in the char tokenizer), then the digits ``0``-``9``, then the separator ``>``. With
so few tokens a randomly initialised policy already writes mostly digits, so the reversal task starts
near its chance reward of 0.1 per position instead of spending its first steps on the format.
Encoding with special tokens prepends ``<bos>``; decoding fuses characters without spaces; a character
outside the vocabulary cannot be encoded (there is no ``<unk>``).

The file ``digits_tokenizer.json`` next to this module is what `build_digits_tokenizer` writes; a test
checks they agree, so edit the function and regenerate the file, never the file by hand::

    python -c "from pipeline.tasks.digits_tokenizer import build_digits_tokenizer, TOKENIZER_PATH; \\
build_digits_tokenizer(TOKENIZER_PATH)"
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from pipeline.tasks.char_tokenizer import build_charset_tokenizer

TOKENIZER_PATH = Path(__file__).with_name("digits_tokenizer.json")

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS = (PAD, BOS, EOS)
CHARACTERS = "0123456789>"
"""Ordinary characters, in id order after the special tokens."""

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


def build_digits_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """Build the tokenizer (and write it to ``path`` when given)."""
    return build_charset_tokenizer(SPECIAL_TOKENS, CHARACTERS, path=path)


def load_digits_tokenizer() -> Tokenizer:
    """The shipped tokenizer."""
    return Tokenizer.from_file(str(TOKENIZER_PATH))
