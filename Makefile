# Two entry points: `make demo` (train on embedded data) and `make test` (the full suite).
# Each creates .venv on first use and installs the project into it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export WANDB_MODE ?= offline
export HF_HUB_OFFLINE := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo ablation lint test install clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c constraints.txt torch==2.14.1 torchvision==0.29.1
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# The digits ViT (about a minute, prints its test accuracy), then all three modalities at their
# smallest and the cross-modality report (a few minutes on a CPU).
demo: $(STAMP)
	$(BIN)/attnlab fit --config configs/vision/digits.yaml
	$(BIN)/attnlab test --config configs/vision/digits.yaml --ckpt_path best
	$(BIN)/python -m experiments.demo

# Every similarity (and the text model's positional encodings) in every modality on 3 seeds: the sweep
# configs/sweeps/ablation.yaml (resumable), then the report with 95% intervals and what the scaling by sqrt(d) does.
ablation: $(STAMP)
	$(BIN)/python -m experiments.ablation

# The linter and the format check first: a minute of tests is not spent on a tree that fails them.
lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

test: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && WANDB_MODE=disabled $(BIN)/python -m pytest

clean:
	rm -rf $(VENV) runs lightning_logs wandb
