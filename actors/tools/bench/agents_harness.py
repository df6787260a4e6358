"""The harness side of `leeway bench agents`: the endpoint's episodes, driven with the real `openai` client from a
process of their own, as an agent harness drives a generator it does not share an interpreter with.

Run as ``python -m actors.tools.bench.agents_harness`` by the bench. It reads one JSON object on stdin
(``url``, ``api_key``, ``model``, ``scripts``: each episode's user messages, ``max_tokens``), runs every
episode at once, and prints one JSON object: ``elapsed_s`` (first request to last response), ``cpu_s`` (this
process's CPU time over the same span: what the client costs), ``latencies_s``
(one per turn) and ``episodes`` (each turn's ``prompt_token_ids`` and sampled ``token_ids``). The key travels
on stdin, never on the command line, where any user of the machine could read it.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import orjson


async def episode(
    client: Any, model: str, index: int, script: list[str], max_tokens: int, latencies: list[float]
) -> dict[str, list[list[int]]]:
    """Turn ``t`` samples with seed ``index * 1000 + t`` and exactly ``max_tokens`` tokens (``ignore_eos``)."""
    messages: list[dict[str, Any]] = []
    prompts, sampled = [], []
    for turn, text in enumerate(script):
        messages.append({"role": "user", "content": text})
        started = time.perf_counter()
        r = await client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            seed=index * 1000 + turn,
            extra_headers={"X-Session-ID": f"bench-{index}"},
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        latencies.append(time.perf_counter() - started)
        choice = r.choices[0]
        sampled.append(list(choice.model_extra["token_ids"]))
        prompts.append(list(r.model_extra["prompt_token_ids"]))
        messages.append(choice.message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
    return {"prompts": prompts, "sampled": sampled}


async def drive(spec: dict[str, Any]) -> dict[str, Any]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{spec['url']}/v1", api_key=spec["api_key"] or "none", max_retries=0)
    latencies: list[float] = []
    try:
        started, cpu = time.perf_counter(), time.process_time()
        runs = await asyncio.gather(
            *(
                episode(client, spec["model"], e, script, spec["max_tokens"], latencies)
                for e, script in enumerate(spec["scripts"])
            )
        )
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    finally:
        await client.close()
    return {"elapsed_s": elapsed, "cpu_s": cpu, "latencies_s": latencies, "episodes": runs}


def main() -> None:
    spec = orjson.loads(sys.stdin.buffer.read())
    sys.stdout.buffer.write(orjson.dumps(asyncio.run(drive(spec))))


if __name__ == "__main__":
    main()
