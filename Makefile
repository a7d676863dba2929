# taipan: `make run` (install, fetch the default model, run a demo) and `make test`.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
export HF_HUB_OFFLINE := 1
# Every runtime the tests start imports our modules in several processes: let the first one
# write their bytecode (an environment that sets PYTHONDONTWRITEBYTECODE would compile them
# again in each process, ~1 s of CPU per runtime on the 2-core CI box).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install model run test test-slow lint format bench

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev,eval]'
	touch $(STAMP)

install: $(STAMP)

model: $(STAMP)
	$(PY) -m taipan.models smollm2 >/dev/null

run: model
	$(PY) -m taipan.demo

lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(PY) -m tests.lint_imports

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# Two workers, a test file at a time each (tests/conftest.py: one torch thread per process).
test: model lint
	$(PY) -m pytest -q -n 2 --dist loadfile

test-slow: model
	$(PY) -m pytest -q -m slow

bench: model
	$(VENV)/bin/taipan bench --model smollm2 --num-prompts 32 --output-len 64
