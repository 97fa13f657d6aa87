# Two commands do all set-up on a machine with only python3: `make demo` and `make test`.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test venv lock clean bench refresh skyrl-client scale-plan decode-bytes

# The tested dependency versions: requirements.lock (pip's pinned format) is installed first, then r3jax
# itself without resolving anything, so a fresh clone gets exactly what CI tested. `make lock` rewrites it
# from the newest versions pyproject.toml allows (then run the tests before committing it).
EXTRAS := dev,serve,parity,peers
$(STAMP): pyproject.toml requirements.lock
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -r requirements.lock
	$(VENV)/bin/pip install -q --no-deps -e '.[$(EXTRAS)]'
	$(MAKE) --no-print-directory skyrl-client
	touch $(STAMP)

lock:
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade --upgrade-strategy eager -e '.[$(EXTRAS)]'
	$(VENV)/bin/pip freeze --exclude-editable | grep -v '^#' > requirements.lock

# SkyRL 0.4.0's own client for tests/r3jax/serve/test_skyrl_client.py. Its wheel says Python >= 3.12,
# so it is downloaded (not installed) and unpacked; the test imports only its client modules. Offline,
# the download fails and that test skips, saying why.
SKYRL_DIR := $(VENV)/peers/skyrl-0.4.0
skyrl-client:
	test -d $(SKYRL_DIR) || { $(VENV)/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	    skyrl==0.4.0 -d $(VENV)/peers && $(VENV)/bin/python -m zipfile -e $(VENV)/peers/skyrl-0.4.0-py3-none-any.whl \
	    $(SKYRL_DIR); } || echo "skyrl 0.4.0 wheel not fetched: its client test will skip"

venv: $(STAMP)

# The suite over worker processes when pytest-xdist is installed (`-n auto`: one per core, at most one per
# 6 GiB of memory, tests/conftest.py), a test file per worker at a time so the engines and servers a file
# shares are built once; serially without it. The 15 slowest tests are printed. PYTEST_ARGS picks what
# runs, the same way: `make test PYTEST_ARGS="tests/models -x"`; `make test XDIST=` runs serially.
PYTEST_ARGS ?= tests
XDIST ?= $(shell $(VENV)/bin/python -c "import xdist" 2>/dev/null && echo "-n auto --dist loadfile")
test: $(STAMP)
	$(VENV)/bin/python -m pytest $(XDIST) --durations=15 $(PYTEST_ARGS)

demo: $(STAMP)
	$(VENV)/bin/python -m r3jax demo

# Every experiment script (tables on stdout, JSON/PNG under experiments/results/, each JSON recording the
# commit it ran on; commit first, or the figures are marked dirty and docs/measurements.md will not quote
# them). Slow on CPU (replay_rl is the longest). One skip: the TPU memory plan needs its own
# venv, run it with `make scale-plan`. BENCH_ARGS passes options to every script (e.g. --quick); the demo
# (experiments.train_multiturn, published to experiments/results/demo_summary.json) takes DEMO_ARGS.
# Then `python -m experiments.readme_tables --write` regenerates docs/measurements.md and the README figures.
BENCH := bench_model bench_trace bench_decode bench_serve bench_engine bench_dtype transfer_cost replay_mismatch \
	bench_scan bench_multiprocess bench_ep bench_attention bench_logits interop routers replay_rl
bench: $(STAMP)
	@echo "make bench: skipping scale_plan (needs the TPU compiler venv): run 'make scale-plan'"
	for m in $(BENCH); do \
	  $(VENV)/bin/python -m experiments.$$m $(BENCH_ARGS) || exit 1; done
	$(VENV)/bin/python -m experiments.transfer_cost --model route_heavy $(BENCH_ARGS)
	$(VENV)/bin/python -m experiments.train_multiturn $(DEMO_ARGS)
	$(VENV)/bin/python -m experiments.readme_tables --write

# Memory and compile plan on real TPU topologies (experiments/scale_plan.py): a venv of its own with the
# tpu-aot extra (jax[tpu] and its libtpu, which compiles for TPU slices on this CPU host), kept apart
# from .venv so the test venv stays CPU-only. SCALE_PLAN_ARGS passes options (e.g. --quick).
TPU_VENV := .venv-tpu
TPU_STAMP := $(TPU_VENV)/.installed

$(TPU_STAMP): pyproject.toml
	test -x $(TPU_VENV)/bin/python || $(PY) -m venv $(TPU_VENV)
	$(TPU_VENV)/bin/pip install -q --upgrade pip
	$(TPU_VENV)/bin/pip install -q -e '.[tpu-aot,dev]'
	touch $(TPU_STAMP)

scale-plan: $(TPU_STAMP)
	$(TPU_VENV)/bin/python -m experiments.scale_plan $(SCALE_PLAN_ARGS)

# Bytes the engine's decode step moves per TPU chip ÷ the bytes it must read (experiments/decode_bytes.py)
decode-bytes: $(TPU_STAMP)
	$(TPU_VENV)/bin/python -m experiments.decode_bytes $(DECODE_BYTES_ARGS)

# Re-run each published result whose measured code changed since its commit, or that was never published,
# with the command it was run with (`python -m experiments.freshness --commands`), then regenerate the
# pages. Commit first: results from a tree with uncommitted changes are never quoted.
refresh: $(STAMP)
	$(VENV)/bin/python -m experiments.freshness --commands > $(VENV)/refresh.sh
	cat $(VENV)/refresh.sh
	PATH="$(abspath $(VENV))/bin:$$PATH" bash -e $(VENV)/refresh.sh
	$(VENV)/bin/python -m experiments.readme_tables --write

clean:
	rm -rf $(VENV) $(TPU_VENV) runs
