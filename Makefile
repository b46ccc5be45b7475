# The README's two commands are `make run` and `make test`; each sets itself up.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
UV := $(shell command -v uv 2>/dev/null)

.PHONY: setup run test lint links typecheck controlplane vllm-env observability-tools fmt crds clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py
	@if [ -z "$(UV)" ]; then python3 -m pip install -q uv; fi
	uv venv -q --allow-existing -p 3.11 $(VENV)
	VIRTUAL_ENV=$(abspath $(VENV)) uv pip install -q -e '.[dev,nixl]'
	@touch $@

# Local PD cluster with the built-in tiny model: serves an OpenAI endpoint,
# answers a sample request, keeps serving until Ctrl-C.
run: setup
	$(VENV)/bin/pdcluster up -f examples/pd-1p1d.yaml --demo

lint: setup
	$(VENV)/bin/ruff check runtime operator tests e2e bench
	$(VENV)/bin/ruff format --check runtime operator tests e2e bench
	$(VENV)/bin/lint-imports pyproject.toml

# import-linter imports the editable install like any program; mypy cannot: it maps a
# file to a module by its folder names, and the editable install maps runtime/ and
# operator/ onto pdcluster.* with an import hook mypy never runs. So mypy alone reads a
# tree of links mirroring the installed layout (`mypy_path` or `explicit_package_bases`
# would name the modules `runtime.*`, and `pdcluster.*` imports would go unresolved).
MYPY_ROOT := build/mypy
links:
	@mkdir -p $(MYPY_ROOT)/pdcluster
	@ln -sfn ../../../runtime $(MYPY_ROOT)/pdcluster/runtime
	@ln -sfn ../../../operator $(MYPY_ROOT)/pdcluster/operator

typecheck: setup links
	cd $(MYPY_ROOT) && $(abspath $(VENV))/bin/mypy --config-file $(CURDIR)/pyproject.toml -p pdcluster.runtime -p pdcluster.operator

# The Kubernetes binaries and helm are built (or found in the cache) before
# pytest starts, so the chart tests have helm and no test is skipped for it.
controlplane: setup
	$(PY) -m e2e.controlplane.build

# vLLM's CPU build in an interpreter of its own (its torch pin differs from ours),
# cached under ~/.cache/pdcluster-vllm like the Kubernetes binaries.
vllm-env: setup
	$(PY) -m e2e.vllmenv.build

# Prometheus and promtool (Debian's package) and an OpenTelemetry Collector (built from
# its Go modules into the cache): the real parties of the dashboard, alert and tracing tests.
observability-tools: setup
	$(PY) -m e2e.prometheus_tools
	$(PY) -m e2e.otelcol.build

# --durations: the slowest tests, to see where CI time goes.
test: lint typecheck controlplane vllm-env observability-tools
	$(PY) -m pytest -q --durations=40

fmt: setup
	$(VENV)/bin/ruff format runtime operator tests e2e bench
	$(VENV)/bin/ruff check --fix runtime operator tests e2e bench

# CRD YAML and the PDCluster reference are generated from runtime/spec/ and operator/api.py;
# the chart's dashboards and alerting rules from operator/observability/.
crds: setup
	$(PY) -m pdcluster.operator.crd.crdgen -o crds/pdcluster.io_pdclusters.yaml -o charts/pdcluster-operator/crds/pdcluster.io_pdclusters.yaml
	$(PY) -m pdcluster.operator.crd.crdgen --kind PDClusterRoleScaler -o crds/pdcluster.io_pdclusterrolescalers.yaml -o charts/pdcluster-operator/crds/pdcluster.io_pdclusterrolescalers.yaml
	$(PY) -m pdcluster.operator.crd.refdoc > docs/reference.md
	$(PY) -m pdcluster.operator.observability.generate

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .pdcluster
