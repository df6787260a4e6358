"""Greedy held-out accuracy of a Hugging Face checkpoint directory in plain transformers (no Leeway engine).

    python scripts/transformers_accuracy.py CONFIG DIR [--prompts N] [--set KEY=VALUE ...]

The check of issue 40 that an exported policy (`leeway export`, a run's ``final/``) is the policy Leeway trained:
this script's number must equal

    leeway eval CONFIG --checkpoint DIR --samples 1 --set eval.temperature=0

(its ``pass@1``). Only the task comes from Leeway (its held-out prompts, `Task.eval_prompts`, the first
``eval.prompts`` of them, and its verifier); the model, the tokenizer, the chat template and the stop tokens are
whatever ``AutoModelForCausalLM`` / ``AutoTokenizer`` load from DIR. A reply is decoded as Leeway scores one: the
stop token left out, special tokens kept. Prints one JSON line: prompts, correct, accuracy.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.config import load_config
from pipeline.tasks import task_for


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("directory")
    parser.add_argument("--prompts", type=int, default=None, help="the first N eval prompts (default: eval.prompts)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    task = task_for(cfg)
    prompts = task.eval_prompts() or []
    limit = args.prompts if args.prompts is not None else cfg.eval.prompts
    prompts = prompts[:limit] if limit is not None else prompts
    model = AutoModelForCausalLM.from_pretrained(args.directory).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.directory)
    stops = model.generation_config.eos_token_id
    stops = set([stops] if isinstance(stops, int) else stops or [])
    correct = 0
    for prompt in prompts:
        if prompt.token_ids is not None:
            ids = list(prompt.token_ids)
        elif prompt.messages is not None:
            ids = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        else:
            ids = tokenizer(prompt.text)["input_ids"]
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]), do_sample=False, max_new_tokens=cfg.engine.sampling.max_new_tokens
            )[0, len(ids) :].tolist()
        reply = out[: next((i for i, t in enumerate(out) if t in stops), len(out))]  # up to the stop token
        text = tokenizer.decode(reply, skip_special_tokens=False)
        verdict = task.verify(prompt, text, reply)
        correct += int(verdict.reward is not None and verdict.reward >= task.max_reward)
    print(json.dumps({"prompts": len(prompts), "correct": correct, "accuracy": correct / max(len(prompts), 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
