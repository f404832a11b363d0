# `make train` and `make test` work on a fresh machine with only Python 3.11+ and make.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Optional extras: `hf` (torch + transformers, for the Hugging Face parity tests) and `tpu`
# (libtpu, for compiling against TPU topologies). CI installs them all.
EXTRAS ?= test
STAMP := $(VENV)/.installed-$(shell echo $(EXTRAS) | cat - pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: train test fuzz bench clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "shardlab needs Python >= 3.11; set PYTHON=python3.11 (or newer)")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[$(EXTRAS)]'
	rm -f $(VENV)/.installed-* && touch $@

train: $(STAMP)  ## the default run; pass options with ARGS="--steps 100 --strategy fsdp"
	$(PY) train.py $(ARGS)

# The suite in JOBS pytest-xdist workers, one test file to a worker (a file's tests share the
# steps it compiles). XLA:CPU already compiles and runs on ~1.6 of CI's 2 cores; the second
# worker fills the rest and the waits on the processes tests start. JOBS=0: one process.
JOBS ?= 2
test: $(STAMP)  ## the whole suite; extra pytest options with ARGS="-k parity"
	$(PY) -m pytest $(if $(filter 0,$(JOBS)),,-n $(JOBS) --dist loadfile) $(ARGS)

# The file readers fuzzed deeply (tests/fuzz_harness.py: the suite runs a few seeded examples
# each; this runs 2000 random ones per test, or EXAMPLES=N) and says how many inputs it tried.
fuzz: $(STAMP)
	@log=$$(mktemp); SHARDLAB_FUZZ=deep SHARDLAB_FUZZ_EXAMPLES=$(EXAMPLES) \
	  SHARDLAB_FUZZ_LOG=$$log $(PY) -m pytest -q tests/test_fuzz_*.py $(ARGS); status=$$?; \
	  awk '{n += $$2} END {printf "fuzz: %d inputs tried\n", n}' $$log; rm -f $$log; \
	  exit $$status

bench: $(STAMP)
	$(PY) bench/core.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
