"""The SFT result as a Hugging Face checkpoint directory: written by the one HF writer every export shares
(`actors/tools/hf_checkpoint.py`; `leeway export` and `leeway run`'s ``final/`` use it too), here with the trained
fp32 weights."""

from actors.tools.hf_checkpoint import hf_tokenizer, write_checkpoint

__all__ = ["hf_tokenizer", "write_checkpoint"]
