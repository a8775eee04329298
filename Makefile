# The two set-up commands of the README: `make demo` and `make test`.
# Each creates the virtualenv on first use (vLLM's CPU build, Ray, test tools).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.specbatch-installed

.PHONY: demo test install

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e ".[cpu,test]"
	# pip pulls CUDA builds of these; each breaks `from vllm import LLM` on a CPU machine.
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/specbatch demo

test: $(STAMP)
	$(BIN)/python -m pytest
