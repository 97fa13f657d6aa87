# Two commands do all set-up on a machine with only python3: `make demo` and `make test`.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test venv clean bench

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[dev,serve,parity]'
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(VENV)/bin/python -m pytest tests

demo: $(STAMP)
	$(VENV)/bin/python -m r3jax demo

# Every experiment script (tables on stdout, JSON/PNG under experiments/results/). Slow on CPU.
bench: $(STAMP)
	for m in bench_model bench_trace bench_decode bench_serve transfer_cost replay_mismatch bench_multiprocess; do \
	  $(VENV)/bin/python -m experiments.$$m $(BENCH_ARGS) || exit 1; done

clean:
	rm -rf $(VENV) runs
