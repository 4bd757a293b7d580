# Two entry points: `make demo` (train on embedded data) and `make test` (the full suite).
# Each creates .venv on first use and installs the project into it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export WANDB_MODE ?= offline
export HF_HUB_OFFLINE := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test install clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c constraints.txt torch==2.14.1 torchvision==0.29.1
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/attnlab fit --config configs/vision/digits.yaml
	$(BIN)/attnlab test --config configs/vision/digits.yaml --ckpt_path best

test: $(STAMP)
	WANDB_MODE=disabled $(BIN)/python -m pytest

clean:
	rm -rf $(VENV) runs lightning_logs wandb
