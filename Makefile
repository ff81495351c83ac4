# The two commands the README opens with: `make demo` and `make test`.
VENV := .venv/bin
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: bootstrap demo test lint unit bench

bootstrap:
	@bash scripts/bootstrap.sh

demo: bootstrap
	$(VENV)/kvtier demo

lint: bootstrap
	$(VENV)/ruff check .
	$(VENV)/kvtier audit connector offload_tiers audit

# Two pytest workers, one test file each at a time (module fixtures start their engines once):
# an engine start is ~30 s of single-threaded imports, so two overlap well on two cores.
JOBS ?= 2

test: lint
	$(VENV)/python -m pytest -q -p no:cacheprovider -n $(JOBS) --dist loadfile --durations=60 tests; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; exit $$rc

unit: bootstrap
	$(VENV)/python -m pytest -q -m "not e2e" tests

bench: bootstrap
	mkdir -p bench-results
	$(VENV)/python benchmarks/bench_events.py --json bench-results/events.json
	$(VENV)/python benchmarks/bench_tiers.py --json bench-results/tiers.json
	$(VENV)/python benchmarks/bench_audit.py --json bench-results/audit.json
	$(VENV)/python benchmarks/bench_e2e.py --json bench-results/e2e.json
