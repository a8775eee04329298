# The two set-up commands of the README: `make demo` and `make test`.
# Each creates the virtualenv on first use (vLLM's CPU build, Ray, test tools).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.specbatch-installed
# checkov (tests/test_infra.py) pins old boto3/botocore, networkx and packaging, which would
# break s3fs and vLLM in $(VENV); it gets its own virtualenv, inside $(VENV) so git ignores it.
CHECKOV_VERSION := 3.3.30
CHECKOV_VENV := $(VENV)/checkov
CHECKOV_STAMP := $(CHECKOV_VENV)/.installed-$(CHECKOV_VERSION)

# The test tools' virtualenv (checkov) installs beside the main one, not after it.
MAKEFLAGS += --jobs=2

.PHONY: demo test install

install: $(STAMP)

$(STAMP): pyproject.toml
	mkdir -p $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e ".[cpu,test]"
	# pip pulls CUDA builds of these; each breaks `from vllm import LLM` on a CPU machine.
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/specbatch demo

$(CHECKOV_STAMP):
	mkdir -p $(VENV)
	$(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/pip install -q "checkov==$(CHECKOV_VERSION)"
	touch $(CHECKOV_STAMP)

# tests/test_report.py opens the HTML report in a real headless Chromium (Debian's package).
CHROMIUM := /usr/bin/chromium
$(CHROMIUM):
	apt-get update
	apt-get install -y --no-install-recommends chromium

test: $(STAMP) $(CHECKOV_STAMP) $(CHROMIUM)
	CHECKOV=$(CHECKOV_VENV)/bin/checkov $(BIN)/python -m pytest
