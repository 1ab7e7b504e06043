# sglang allocator targets.  Included by the main Makefile, which defines
# VENV and PY; the defaults below let this fragment also run on its own
# (make -f mk/sglang.mk sglang V=...).
#
#   make sglang V=0.5.23   -> deps into $(VENV) (once), wheel into .sglang/0.5.23
VENV ?= .venv
PY ?= $(VENV)/bin/python

.PHONY: sglang
sglang: $(PY)
	@if [ -z "$(V)" ]; then \
	    echo "make sglang: set V, e.g. make sglang V=0.5.23" >&2; exit 2; fi
	scripts/install_sglang.sh $(V)
