# expertmesh — the verbs people type. `make help` lists them.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
OUT ?= out
DEMO_POLICIES ?= static eplb quota hybrid fastermoe
export RAY_AUTH_MODE ?= disabled
export PYTHONDONTWRITEBYTECODE := 1

.DEFAULT_GOAL := help
.PHONY: help setup demo demo-planner test test-unit test-integration lint fmt typecheck bench gpu-check \
	bench-planner bench-balance bench-balance-cores bench-migration bench-soak bench-runtime bench-checkpoint clean serve proto emulate-up emulate-down emulate-status emulate-rayup ci-deps results mutate

help: ## list the verbs
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-18s %s\n", $$1, $$2}'

setup: ## create .venv: pinned CPU torch first, then the project with dev tools
	@VENV=$(VENV) scripts/setup.sh

demo: setup ## the main job: train a small MoE LM across 3 simulated DCs on local Ray (live loss, step time)
	@mkdir -p $(OUT)
	$(VENV)/bin/expertmesh demo --exit --steps 40 --json $(OUT)/demo.json

demo-planner: setup ## planner only: generate a skewed trace and plan it with every policy, print a table
	@mkdir -p $(OUT)
	$(VENV)/bin/expertmesh trace generate --out $(OUT)/trace.npz --steps 8 --layers 2 \
		--topology deploy/topologies/ep64.yaml --experts 256 --top-k 8 --tokens-per-rank 8192 \
		--imbalance 2.0 --seed 0
	@avail=" $$($(VENV)/bin/expertmesh plan policies --names | tr '\n' ' ')"; plans=""; \
	for p in $(DEMO_POLICIES); do \
		case "$$avail" in *" $$p "*) ;; *) echo "note: policy $$p is not registered yet; skipping it"; continue;; esac; \
		echo "expertmesh plan --policy $$p --out $(OUT)/plan-$$p.npz"; \
		$(VENV)/bin/expertmesh plan --quiet --trace $(OUT)/trace.npz \
			--topology deploy/topologies/ep64.yaml --policy $$p --out $(OUT)/plan-$$p.npz || exit $$?; \
		plans="$$plans $(OUT)/plan-$$p.npz"; \
	done; \
	$(VENV)/bin/expertmesh plan compare --trace $(OUT)/trace.npz $$plans

test: setup lint ci-deps ## lint, type-check and run every test (unit + integration)
	$(PY) -m pytest -q

MUTATE_MINUTES ?= 60
mutate: setup ## mutation testing (mutmut) of formats, auth, deps, core, costmodel, quota; bounded by MUTATE_MINUTES (60); docs/testing.md
	@VENV=$(VENV) OUT=$(OUT) MUTATE_MINUTES=$(MUTATE_MINUTES) scripts/mutate.sh

ci-deps: ## system tools some tests use: promtool (Debian prometheus), ip/tc (iproute2); root: apt-get
	@scripts/ci-deps.sh

test-unit: setup ## unit tests only (no Ray, no network)
	$(PY) -m pytest -q -m unit

test-integration: setup ## integration tests only (real local Ray, loopback servers)
	$(PY) -m pytest -q -m integration

lint: setup ## ruff (lint + format check) and mypy
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy controller/expertmesh workers/expertmesh
	$(VENV)/bin/mypy bench

fmt: setup ## apply ruff's formatting and safe fixes
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: bench-planner bench-balance bench-balance-cores bench-migration bench-api bench-runtime bench-checkpoint ## every benchmark (not the soak)

serve: setup ## controller + REST/dashboard (127.0.0.1:8700) + gRPC (127.0.0.1:8701), no Ray workers
	$(VENV)/bin/expertmesh serve --topology deploy/topologies/two-dc.yaml

screenshots: setup ## re-take docs/dashboard.png (headless Chromium against a live controller)
	EXPERTMESH_SCREENSHOTS=docs $(PY) -m pytest -q tests/integration/test_dashboard.py

proto: setup ## regenerate proto/expertmesh/v1/*_pb2*.py from the .proto (committed; a test checks)
	PYTHON=$(PY) PATH=$(VENV)/bin:$$PATH scripts/gen_proto.sh

bench-api: setup ## control plane: gRPC reports/s, REST latest-plan p50/p99; load ingestion at 1,000 DCs x 8 ranks x 58 layers with/without aggregation
	$(PY) bench/bench_api.py
	$(PY) bench/bench_ingest.py

SOAK_MINUTES ?= 10
bench-soak: setup ## soak: 1,000 ranks stream reports to `expertmesh serve` for SOAK_MINUTES (10) while plans commit
	@mkdir -p $(OUT)
	$(PY) bench/bench_soak.py --minutes $(SOAK_MINUTES) --json $(OUT)/soak.json

bench-planner: setup ## planner: quota/eplb vs DeepSeek EPLB at EP64 (table + ratios)
	$(PY) bench/bench_planner.py

bench-balance: setup ## balancing: quota solve ms at 8/16/64 ranks, replica economy; then the fast loop training the demo (max/mean, step time, 20 Mbit/s x 1/4 microbatches vs the model)
	@mkdir -p $(OUT)
	$(PY) bench/bench_balance.py
	$(PY) bench/bench_balance_train.py --json $(OUT)/bench-balance-train.json

bench-balance-cores: setup ## balancing on vs off end to end where it can show: 2 ranks pinned to their own cores, experts that dominate the step; static, fast loop, slow loop, force-balanced ideal (~2 min)
	@mkdir -p $(OUT)
	$(PY) bench/bench_balance_cores.py --json $(OUT)/bench-balance-cores.json

results: setup ## docs/results.md: simulator sweeps (bandwidth, DCs, regimes, dispatch, FEPLB), 1,000-DC run and plan, growth (7.5-11 min on 2 idle cores)
	$(PY) bench/results.py

bench-runtime: setup ## runtime (SPMD plane over gloo): Ray overhead (old plane: recorded), every policy vs static at 2-3 DCs x 1 Gbit/s-20 Mbit/s vs sim replay of each row's trace, tokens/s
	@mkdir -p $(OUT)
	$(PY) bench/bench_runtime.py --json $(OUT)/bench-runtime.json

bench-checkpoint: setup ## expert checkpoint of the demo model: ms to gather, write (fsync, rename) and load, vs a step
	@mkdir -p $(OUT)
	$(PY) bench/bench_checkpoint.py --json $(OUT)/bench-checkpoint.json

gpu-check: ## on a machine with CUDA (its own torch, no setup): the gpu tests (NCCL, the SPMD plane on CUDA) and bench/bench_gpu.py into $(OUT)/gpu
	OUT=$(OUT)/gpu bash scripts/gpu-check.sh

bench-migration: setup ## migration: copies kept, relay rounds, modeled time, plan speed (EP64 to 8,000 ranks)
	$(PY) bench/bench_migration.py

EMU_TOPOLOGY ?= deploy/topologies/emulate.yaml
emulate-up: setup ## one-machine multi-DC Ray cluster: a network namespace per DC, htb-shaped veths (root; EMU_TOPOLOGY=...)
	$(PY) deploy/emulate/netemu.py up --topology $(EMU_TOPOLOGY)

emulate-status: setup ## the emulation's namespaces, addresses, shaped rates and Ray PIDs
	$(PY) deploy/emulate/netemu.py status

emulate-down: setup ## tear the emulation down: its Ray processes, namespaces, veths, bridge, temp dir
	$(PY) deploy/emulate/netemu.py down

emulate-rayup: setup ## `ray up` deploy/cluster.yaml over SSH onto emulated DC hosts, train, `ray down` (root; ~5 min)
	@mkdir -p $(OUT)
	$(PY) deploy/emulate/rayup.py run --json $(OUT)/rayup.json

clean: ## remove the venv, caches and outputs
	rm -rf $(VENV) $(OUT) .cache .pytest_cache .mypy_cache .ruff_cache .hypothesis
