# kv-lockstep: `make fuzz` and `make test` do all set-up on a fresh machine.
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch 2.13.0 lies on this machine's disk; pinned in
# pyproject.toml.  `make sglang` moves .venv to torch 2.14.1 (sglang's
# import set, constraints/sglang.txt); the other targets leave it there.
PIP_INSTALL := $(PY) -m pip install --quiet --disable-pip-version-check

FUZZ_TARGET ?= builtin:token
FUZZ_ARGS ?= --max-examples 1000
TEST_ARGS ?=
# make test JUNIT=report.xml writes JUnit XML (for CI test reports).
JUNIT ?=
# make hypofuzz: KV_LOCKSTEP_DB=redis://HOST:PORT shares one database across machines.
KV_LOCKSTEP_DB ?=
HYPOFUZZ_ARGS ?=

BENCH_ARGS ?=

.PHONY: install fuzz test lint hypofuzz sglang-matrix sglang-coverage bench clean

# `make install` always (re)installs; the other targets run it only when
# .venv is missing, so a torch upgraded by `make sglang` is left alone.
# `pip install -e .` puts the pinned 2.13.0 back over make sglang's 2.14.1
# (pip install --dry-run: "Would install kv-lockstep-0.1.0 torch-2.13.0+cpu"),
# so the stamp of sglang's import set goes too: the next `make sglang V=...`
# installs it again instead of reporting it up to date.
install:
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP_INSTALL) --upgrade pip
	$(PIP_INSTALL) -e .
	rm -f $(VENV)/.sglang-deps

$(PY):
	$(MAKE) install

fuzz: $(PY)
	$(VENV)/bin/kv-lockstep fuzz --target $(FUZZ_TARGET) $(FUZZ_ARGS)

test: $(PY)
	$(PY) -m pytest -n auto -p no:cacheprovider --hypothesis-profile=ci $(if $(JUNIT),--junitxml=$(JUNIT)) $(TEST_ARGS)

# ruff (pyflakes, import order) and the layering check: reference_model/
# imports no torch, allocators/ and reference_model/ import no harness, and no
# import cycle among the packages.
# ruff as pinned in pyproject.toml's `lint` extra, installed alone: `-e '.[lint]'`
# would put torch 2.13.0 back over make sglang's 2.14.1, as `make install` does.
lint: $(PY)
	test -x $(VENV)/bin/ruff || $(PIP_INSTALL) 'ruff==0.17.6'
	$(VENV)/bin/ruff check .
	$(PY) scripts/check_imports.py

# Coverage-guided fuzzing of tests/fuzz_targets.py with HypoFuzz and its
# dashboard; hypofuzz (and redis, for a redis:// database) go into .venv only.
hypofuzz: $(PY)
	$(PIP_INSTALL) hypofuzz $(if $(findstring redis,$(KV_LOCKSTEP_DB)),redis)
	KV_LOCKSTEP_DB=$(KV_LOCKSTEP_DB) $(VENV)/bin/hypothesis fuzz $(HYPOFUZZ_ARGS) -- tests/fuzz_targets.py -p no:cacheprovider

# make sglang V=..., sglang-matrix (SGLANG_RELEASES=...), sglang-coverage
include mk/sglang.mk

# Not a test: measures time to failure, shrinking, throughput and scaling,
# and writes bench/results.json and bench/RESULTS.md (about 10 minutes on 2 cores).
bench: $(PY)
	$(PY) -m bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .kv-lockstep .hypothesis *.egg-info
