# kv-lockstep: `make fuzz` and `make test` do all set-up on a fresh machine.
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch lies on this machine's disk; pinned in pyproject.toml.
PIP_INSTALL := $(PY) -m pip install --quiet --disable-pip-version-check

FUZZ_TARGET ?= builtin:token
FUZZ_ARGS ?= --max-examples 1000
TEST_ARGS ?=
BENCH_ARGS ?=

.PHONY: install fuzz test bench clean

# `make install` always (re)installs; the other targets run it only when
# .venv is missing, so a torch upgraded by `make sglang` is left alone.
install:
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP_INSTALL) --upgrade pip
	$(PIP_INSTALL) -e .

$(PY):
	$(MAKE) install

fuzz: $(PY)
	$(VENV)/bin/kv-lockstep fuzz --target $(FUZZ_TARGET) $(FUZZ_ARGS)

test: $(PY)
	$(PY) -m pytest -n auto -p no:cacheprovider --hypothesis-profile=ci $(TEST_ARGS)

# Not a test: measures time to failure, shrinking, throughput and scaling,
# and writes bench/results.json and bench/RESULTS.md (about 10 minutes on 2 cores).
bench: $(PY)
	$(PY) -m bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .kv-lockstep .hypothesis *.egg-info
