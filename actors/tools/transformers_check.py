"""A checkpoint's held-out accuracy as plain `transformers` sees it: greedy decoding with the checkpoint's own
tokenizer (and chat template), generation config and stop tokens, scored by the task's verifier.

Nothing of Leeway's engine, tokenizer loading or rendering is used, so the number agreeing with `leeway eval
--checkpoint` at temperature 0 says the exported directory means outside Leeway what it means inside it
(`leeway bench learning` reports both for the recipe's SFT checkpoint). Greedy, because two samplers agree only
in distribution; greedy replies agree token for token.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


def transformers_greedy_pass1(
    checkpoint: Path, task: Any, prompts: list[Any], *, max_new_tokens: int, threads: int = 1
) -> dict[str, Any]:
    """Greedy pass@1 over ``prompts`` of the checkpoint in ``checkpoint`` (one prompt at a time, no padding)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, trust_remote_code=False).eval()
    stops = model.generation_config.eos_token_id
    stops = set(stops if isinstance(stops, list) else [] if stops is None else [stops])
    right = 0
    for prompt in prompts:
        if prompt.token_ids is not None:
            ids = list(prompt.token_ids)
        elif prompt.messages:
            ids = tokenizer.apply_chat_template(list(prompt.messages), add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        else:
            ids = tokenizer(prompt.text)["input_ids"]
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=max_new_tokens,
            )[0, len(ids) :].tolist()
        reply = next((out[:i] for i, token in enumerate(out) if token in stops), out)
        text = tokenizer.decode(reply, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        right += task.verify(prompt, text, reply).reward >= task.max_reward
    return {"prompts": len(prompts), "pass@1": right / len(prompts), "seconds": time.perf_counter() - started}
