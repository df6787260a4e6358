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

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

TOKENIZER_PATH = Path(__file__).with_name("char_tokenizer.json")

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
CHARACTERS = "0123456789>= +-|,"
"""Ordinary characters, in id order after the special tokens."""

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3


def build_char_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """Build the tokenizer (and write it to ``path`` when given)."""
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, BOS_ID)])
    if path is not None:
        tokenizer.save(str(path), pretty=True)
    return tokenizer


def load_char_tokenizer() -> Tokenizer:
    """The shipped tokenizer."""
    return Tokenizer.from_file(str(TOKENIZER_PATH))
