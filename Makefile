# Two entry points: `make demo` (train on embedded data) and `make test` (the full suite).
# Each creates .venv on first use and installs the project into it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export WANDB_MODE ?= offline
export HF_HUB_OFFLINE := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo ablation findings lint test install clean gpu-wheels gpu-check gpu-rehearsal

# pip byte-compiles one file at a time; compileall -j 0 does it on every core (about 15 s less here). The bytecode must
# be written at install: where PYTHONDONTWRITEBYTECODE is set, Python never caches what it compiles on import. Like
# pip, it passes over files that are not Python 3.11 (torch ships a Python 3.12-only test helper), and it leaves out
# the libraries' own test suites (tests/ and test/ folders: 2,100 files that nothing imports, 13 of its 44 CPU
# seconds). pip runs on one core: while it installs the project's dependencies, the other core compiles torch, sympy
# and torchvision, which the first command installed (a quarter of the bytecode); the last pass compiles the rest. The
# project is built by the setuptools installed beside torch (pyproject.toml's build requirement), not in an isolated
# build environment that pip would first fill from the index (about 4 s). The venv's own pip (23.2 with Python 3.11)
# is first replaced by the one in constraints.txt: it resolves the project's 120 dependencies in half the time (their
# command 25-28 s -> 11-15 s, the whole install 70-74 s -> 57-67 s). Setuptools' note on editable installs
# ("Editable installation. Please be careful with folders..."), which newer pips print, is left out.
SITE = $$($(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
COMPILE = $(BIN)/python -m compileall -q -x '/tests?/'
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c constraints.txt -U pip
	$(BIN)/python -m pip install -q --no-compile -c constraints.txt torch==2.14.1 torchvision==0.29.1 'setuptools>=77'
	site=$(SITE) && { $(COMPILE) -j 1 $$site/torch $$site/sympy $$site/torchvision > /dev/null & } && \
		PYTHONWARNINGS='ignore:Editable installation' \
		$(BIN)/python -m pip install -q --no-compile --no-build-isolation -c constraints.txt -e '.[dev]'; \
		status=$$?; wait; exit $$status
	$(COMPILE) -j 0 $(SITE) > /dev/null || true
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
	$(BIN)/attnlab sweep configs/sweeps/ablation.yaml

# Findings reproduced in every modality, 5 seeds each, one sweep after the other (resumable: run it again after an
# interruption), each with its report in runs/sweeps/<name>/report: train short, test long (Press et al. 2022), QK-norm
# against the learning rate (Wortsman et al. 2023), DETR's encoder with 2D RoPE against sine positions (the first three,
# about 83 min measured on a 2-core CPU); then attention sinks and outliers under softmax, softmax+1, clipped softmax,
# sigmoid, gated attention and registers, with each model's W8A8 drop, in the character GPT (13 min), toy En-De
# translation (18 min), images (26 min), DETR on shapes (17 min) and on BCCD (32 min), each measured alone.
findings: $(STAMP)
	$(BIN)/attnlab sweep configs/sweeps/train_short_test_long.yaml
	$(BIN)/attnlab sweep configs/sweeps/qk_norm_lr.yaml
	$(BIN)/attnlab sweep configs/sweeps/detr_rope.yaml
	$(BIN)/attnlab sweep configs/sweeps/sinks_text.yaml
	$(BIN)/attnlab sweep configs/sweeps/sinks_translation.yaml
	$(BIN)/attnlab sweep configs/sweeps/sinks_vision.yaml
	$(BIN)/attnlab sweep configs/sweeps/sinks_detection.yaml
	$(BIN)/attnlab sweep configs/sweeps/sinks_bccd.yaml

# The linter and the format check first: a minute of tests is not spent on a tree that fails them.
lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

# One pytest worker a core (pytest-xdist), a file to a worker (module fixtures such as one DDP reference run are
# made once): the suite's many small processes (CLI, DDP, sweeps) fill every core. Files go to the workers in the
# order tests/conftest.py gives them (those with the most slow tests first), not xdist's (the most tests first).
test: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && WANDB_MODE=disabled $(BIN)/python -m pytest -n auto --dist loadfile --no-loadscope-reorder

# The wheels a lent GPU machine (Python 3.12, torch and Lightning installed, no registry) lacks, at the versions that
# ran there on 2026-11-26 (benchmarks/RESULTS.md, "GPU rows (H100)"), and torchao at constraints.txt's version for the
# float8 MFU row (its cp310-abi3 manylinux_2_28 wheel loads on Python 3.12); `gpu-check` installs them from .whl (carry it).
GPU_WHEELS := jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.15.0 pycocotools==2.0.11 torchao==0.18.0
gpu-wheels:
	rm -rf .whl && $(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)

# On a lent GPU machine (carry .whl): the carried wheels, the CUDA tests and every GPU row (padding, decoding, DETR,
# overhead, ViT-B/16 MFU eager / compiled / float8, the fits' tokens/s by batching and with packed documents, long
# context) within 8.5 minutes, one report in $$OUT (else runs/gpu/); `gpu-rehearsal` runs the same steps here on the
# CPU at toy sizes first.
gpu-check:
	$(PYTHON) -m benchmarks.gpu_check

gpu-rehearsal: $(STAMP)
	$(BIN)/python -m benchmarks.gpu_check --rehearse

clean:
	rm -rf $(VENV) runs lightning_logs wandb
