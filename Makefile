# make demo / make test / make bench: each creates .venv if missing and installs the project first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): $(PY) pyproject.toml requirements/dev.txt
	$(PY) -m pip install -q -r requirements/dev.txt
	$(PY) -m pip install -q -c requirements/dev.txt -e ".[dev]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -ra

bench: $(STAMP)
	$(PY) -m bench.kernels --preset cpu-small

demo: $(STAMP)
	@echo "make demo arrives with the trainer (issue 4); see README"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
