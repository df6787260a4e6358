"""The character-level tokenizer of the built-in tasks, shipped as a real ``tokenizer.json``.

One token per character: ids 0-3 are the special tokens ``<pad> <bos> <eos> <unk>``, then the digits,
then a few symbols. Encoding with special tokens prepends ``<bos>``; decoding fuses characters without
spaces. The file ``char_tokenizer.json`` next to this module is what `build_char_tokenizer` writes; a
test checks they agree, so edit the function and regenerate the file, never the file by hand::

    python -c "from pipeline.tasks.char_tokenizer import build_char_tokenizer, TOKENIZER_PATH; \
build_char_tokenizer(TOKENIZER_PATH)"

It loads with ``tokenizers.Tokenizer.from_file`` or
``transformers.PreTrainedTokenizerFast(tokenizer_file=..., pad_token="<pad>", ...)``.
"""

from __future__ import annotations

import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

TOKENIZER_PATH = Path(__file__).with_name("char_tokenizer.json")

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
CHARACTERS = "0123456789>= +-|,"
"""Ordinary characters, in id order after the special tokens."""

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3


def build_charset_tokenizer(
    special_tokens: tuple[str, ...], characters: str, *, unk: str | None = None, path: str | Path | None = None
) -> Tokenizer:
    """One token per character: `special_tokens` first (the second is the `<bos>` prepended on encode),
    then `characters`, in id order; written to ``path`` when given. Shared by the task tokenizers. An alphabet
    with a newline splits on every character, newlines included (``.`` would leave a run of them one piece)."""
    vocab = {token: i for i, token in enumerate((*special_tokens, *characters))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk) if unk else models.WordLevel(vocab=vocab))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]" if "\n" in characters else "."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(list(special_tokens))
    bos = special_tokens[1]
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, 1)])
    if path is not None:
        tokenizer.save(str(path), pretty=True)
    return tokenizer


def build_char_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """Build the tokenizer (and write it to ``path`` when given)."""
    return build_charset_tokenizer(SPECIAL_TOKENS, CHARACTERS, unk=UNK, path=path)


def load_char_tokenizer() -> Tokenizer:
    """The shipped tokenizer."""
    return Tokenizer.from_file(str(TOKENIZER_PATH))


ALPHABETS = {
    "text": "".join(c for c in string.printable if c not in "\r\x0b\x0c"),
    "numeric": string.digits + "-+*/.=() ",
}
"""Alphabets of the ecosystem tasks' tokenizers (`alphabet_tokenizer`), in id order after `SPECIAL_TOKENS`:
``text``, printable ASCII, and ``numeric``, the digits and the arithmetic signs only, with which a small random
policy writes numbers often enough to learn."""


def alphabet_tokenizer(alphabet: str) -> Tokenizer:
    """One token per character of `ALPHABETS[alphabet]` after ``<pad> <bos> <eos> <unk>``; anything else encodes as
    ``<unk>``. Built in memory, the same in every process: the task that names it ships no file."""
    if alphabet not in ALPHABETS:
        raise ValueError(f"tokenizer must be one of {sorted(ALPHABETS)}, got {alphabet!r}")
    return build_charset_tokenizer(SPECIAL_TOKENS, ALPHABETS[alphabet], unk=UNK)
