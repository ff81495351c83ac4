# The two commands the README opens with: `make demo` and `make test`.
VENV := .venv/bin
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: bootstrap demo test lint unit bench compat

bootstrap:
	@bash scripts/bootstrap.sh

demo: bootstrap
	$(VENV)/kvtier demo

lint: bootstrap
	$(VENV)/ruff check .
	$(VENV)/kvtier audit connector offload_tiers audit

# Two pytest workers, one test file (or group of files, see tests/conftest.py) each at a
# time, so module fixtures start their engines once: an engine start is ~30 s of mostly
# single-threaded imports, so two overlap well on two cores.
JOBS ?= 2

test: lint
	$(VENV)/python -m pytest -q -p no:cacheprovider -n $(JOBS) --dist loadgroup --durations=60 tests; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; exit $$rc

unit: bootstrap
	$(VENV)/python -m pytest -q -p no:cacheprovider -n $(JOBS) -m "not e2e" tests

# kvtier's engine-free suites against vLLM 0.33.0 and 0.34.0, each in .venv-compat-X.Y: .venv's
# packages plus that vllm wheel (--no-deps), on the CPU platform; one line per release
# ("compat: vllm X: N passed"); see scripts/compat.sh.
compat:
	@bash scripts/compat.sh

# kvtier's LMCache L2 adapter (connector/lmcache_l2) inside LMCache 0.5.6, in .venv-lmcache
# (lmcache --no-deps over .venv's packages; never a dependency of kvtier): its tests on real
# Redis (standalone and Cluster) and LMCache's MP server end to end; see scripts/lmcache.sh.
.PHONY: lmcache
lmcache:
	@bash scripts/lmcache.sh

# Every benchmark the README quotes, its JSON into benchmarks/results/ (stamped with date,
# load and command), then README/docs figures rendered from those files (benchmarks/figures.py;
# the test suite fails when a quoted figure differs from its JSON). Takes ~1 h on 2 cores.
R := benchmarks/results
FIG := $(VENV)/python -m benchmarks.figures
bench: bootstrap
	mkdir -p $(R)
	$(VENV)/python -m benchmarks.bench_events --json $(R)/events.json && $(FIG) stamp $(R)/events.json -- python -m benchmarks.bench_events
	$(VENV)/python -m benchmarks.bench_tiers --json $(R)/tiers.json && $(FIG) stamp $(R)/tiers.json -- python -m benchmarks.bench_tiers
	$(VENV)/python -m benchmarks.bench_audit --json $(R)/audit.json && $(FIG) stamp $(R)/audit.json -- python -m benchmarks.bench_audit
	$(VENV)/python -m benchmarks.bench_janitor --value-bytes 65536 --json $(R)/janitor-64k.json && $(FIG) stamp $(R)/janitor-64k.json -- python -m benchmarks.bench_janitor --value-bytes 65536
	$(VENV)/python -m benchmarks.bench_janitor --value-bytes 2097152 --keys 2000 --json $(R)/janitor-2m.json && $(FIG) stamp $(R)/janitor-2m.json -- python -m benchmarks.bench_janitor --value-bytes 2097152 --keys 2000
	$(VENV)/python -m benchmarks.bench_backfill --json $(R)/backfill.json && $(FIG) stamp $(R)/backfill.json -- python -m benchmarks.bench_backfill
	$(VENV)/python -m benchmarks.bench_native_tier --json $(R)/native.json && $(FIG) stamp $(R)/native.json -- python -m benchmarks.bench_native_tier
	$(VENV)/python -m benchmarks.bench_stall --quick --json $(R)/stall.json && $(FIG) stamp $(R)/stall.json -- python -m benchmarks.bench_stall --quick
	$(VENV)/python -m benchmarks.bench_e2e --json $(R)/e2e.json && $(FIG) stamp $(R)/e2e.json -- python -m benchmarks.bench_e2e
	$(VENV)/python -m benchmarks.bench_ttft --quick --json $(R)/ttft.json && $(FIG) stamp $(R)/ttft.json -- python -m benchmarks.bench_ttft --quick
	$(VENV)/python -m benchmarks.bench_index --json $(R)/index.json && $(FIG) stamp $(R)/index.json -- python -m benchmarks.bench_index
	$(VENV)/python -m benchmarks.route_demo --json $(R)/route.json && $(FIG) stamp $(R)/route.json -- python -m benchmarks.route_demo
	$(VENV)/python -m benchmarks.bench_host_tier --quick --json $(R)/host_tier.json && $(FIG) stamp $(R)/host_tier.json -- python -m benchmarks.bench_host_tier --quick
	$(VENV)/python -m benchmarks.bench_checkpoint_identity --gib 16 --shards 4 --json $(R)/checkpoint_identity.json && $(FIG) stamp $(R)/checkpoint_identity.json -- python -m benchmarks.bench_checkpoint_identity --gib 16 --shards 4
	LMCACHE_VENV_ONLY=1 bash scripts/lmcache.sh && .venv-lmcache/bin/python -m benchmarks.bench_lmcache_l2 --json $(R)/lmcache_l2.json && $(FIG) stamp $(R)/lmcache_l2.json -- python -m benchmarks.bench_lmcache_l2
	$(FIG) render
