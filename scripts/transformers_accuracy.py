"""A checkpoint directory's greedy held-out accuracy in plain transformers and in Leeway, side by side.

    python scripts/transformers_accuracy.py CONFIG DIR [--prompts N] [--set KEY=VALUE ...]

The check that an exported policy (`leeway export`, a run's ``final/``) means outside Leeway what it meant inside:
`actors/tools/transformers_check.py` decodes the task's held-out prompts greedily with nothing but
``AutoModelForCausalLM`` / ``AutoTokenizer`` and the directory's generation config, and `leeway eval --checkpoint`
(at temperature 0, one sample) decodes the same prompts with Leeway's engine; both are scored by the task's
verifier. Prints one JSON line; the two pass@1 values should be equal.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.tools.evaluate import evaluate_checkpoint
from actors.tools.transformers_check import transformers_greedy_pass1
from pipeline.config import load_config
from pipeline.tasks import task_for


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("directory", type=Path)
    parser.add_argument("--prompts", type=int, default=None, help="the first N eval prompts (default: eval.prompts)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    cfg = load_config(args.config, [*args.overrides, "eval.temperature=0", "eval.samples_per_prompt=1"])
    task = task_for(cfg)
    limit = args.prompts if args.prompts is not None else cfg.eval.prompts
    prompts = task.eval_prompts()[:limit]
    hf = transformers_greedy_pass1(
        args.directory,
        task,
        prompts,
        max_new_tokens=cfg.engine.sampling.max_new_tokens,
        threads=cfg.engine.torch_threads,
    )
    leeway = evaluate_checkpoint(cfg, args.directory, task=task, prompts=prompts)
    print(
        json.dumps(
            {
                "prompts": hf["prompts"],
                "transformers_greedy_pass1": hf["pass@1"],
                "leeway_greedy_pass1": leeway["pass@1"],
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
