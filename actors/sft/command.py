"""`leeway sft`'s parser: its description, flags and handler.

The command itself is `actors/sft/runtime.py`, which imports torch at module level; it is imported only once the
config has loaded, so `leeway sft --help` answers without torch and a bad config fails before torch loads.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from actors.cli_args import WithConfig, add_config_arguments
from actors.tools.evaluate import EVAL_FILE

if TYPE_CHECKING:
    from pipeline.config import LeewayConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`leeway sft`'s description, flags and handler."""
    parser.description = (
        "Trains sft.base_model (default model.name_or_path) on sft.data (JSONL/Parquet rows of "
        "'messages', or 'prompt' and 'completion') or, with sft.from_task, on the task's reference answers; the loss "
        "is on the assistant's tokens only, rendered with the run's tokenizer and chat template as a generator "
        "renders them. Uses the trainer's backend (trainer.backend, packing, --nproc FSDP2 ranks), a learning rate "
        "with warm-up and decay (sft.*), gradient clipping, a progress bar with loss and tokens/s, resumable state "
        "every sft.checkpoint_every steps. Writes a Hugging Face checkpoint (safetensors, config, tokenizer, chat "
        "template) into sft.output_dir (default runs/<run.name>-sft), then evaluates it on the task's eval split "
        f"({EVAL_FILE}) and prints a JSON summary."
    )
    add_config_arguments(parser)
    parser.add_argument("--resume", action="store_true", help="continue from the newest saved state in sft.output_dir")
    parser.add_argument("--fresh", action="store_true", help="delete sft.output_dir first (an earlier result or state)")
    parser.add_argument("--nproc", type=int, default=None, help="FSDP2 data-parallel ranks (default: trainer.nproc)")
    parser.add_argument("--no-eval", action="store_true", help="skip the evaluation at the end")
    parser.set_defaults(handler=WithConfig(main))


def main(cfg: LeewayConfig, args: argparse.Namespace) -> int:
    from actors.sft.runtime import main as sft_main

    return sft_main(cfg, args)
