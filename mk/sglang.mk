# sglang allocator targets.  Included by the main Makefile, which defines
# VENV and PY; the defaults below let this fragment also run on its own
# (make -f mk/sglang.mk sglang V=...).
#
#   make sglang V=0.5.23   -> deps into $(VENV) (once), wheel into .sglang/0.5.23
#   make sglang-matrix     -> the gate on each of $(SGLANG_RELEASES), one row per release and kind
#   make sglang-coverage   -> statement coverage of the newest installed release's allocator code
VENV ?= .venv
PY ?= $(VENV)/bin/python
PIP_INSTALL ?= $(PY) -m pip install --quiet --disable-pip-version-check
# Releases `make sglang-matrix` gates, each installed by `make sglang V=...`:
# any from 0.5.8 (allocators in one file) to the newest (a package) will do.
SGLANG_RELEASES ?= 0.5.8 0.5.12 0.5.17 0.5.18 0.5.23
MATRIX_ARGS ?= --max-examples 300
COVERAGE_ARGS ?= --max-examples 300

.PHONY: sglang
sglang: $(PY)
	@if [ -z "$(V)" ]; then \
	    echo "make sglang: set V, e.g. make sglang V=0.5.23" >&2; exit 2; fi
	scripts/install_sglang.sh $(V)

# The gate on each release's token (page size 1), paged (4), SWA and NPU
# allocators; one table row per release and kind.  A release that does not
# install, or does not import, is a row saying why.
.PHONY: sglang-matrix
sglang-matrix: $(PY)
	@for v in $(SGLANG_RELEASES); do $(MAKE) --no-print-directory sglang V=$$v \
	    || echo "sglang-matrix: sglang $$v did not install or import; its row says why" >&2; done
	@mkdir -p .kv-lockstep
	$(PY) -m state_machines.runs.matrix $(SGLANG_RELEASES) $(MATRIX_ARGS) --json .kv-lockstep/matrix.json

# Every kind of the newest release under .sglang/, each in its own worker,
# then one table: per file of its allocator code, statements and how many ran.
# coverage.py as in pyproject.toml's `cover` extra, installed alone (as .ci/run
# does): `-e '.[cover]'` would put torch 2.13.0 back under the release it measures.
.PHONY: sglang-coverage
sglang-coverage: $(PY)
	@$(PY) -c "import coverage" 2>/dev/null || $(PIP_INSTALL) 'coverage>=7'
	$(PY) -m state_machines.runs.cover $(COVERAGE_ARGS)
