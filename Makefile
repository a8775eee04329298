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

# uv installs what pip would (the same resolution, the best version across every index, as pip
# picks it) from the places pip is configured with here: its indexes, find-links and constraints.
# It downloads in parallel and compiles bytecode on every core: about 1 minute where pip takes 3-4.
UV_VERSION := 0.13.9
UV := $(BIN)/uv
pip_setting = $(shell $(PYTHON) -m pip config get global.$(1) 2>/dev/null)
UV_SOURCES = --index-strategy unsafe-best-match \
	$(foreach url,$(firstword $(PIP_INDEX_URL) $(call pip_setting,index-url)),--index-url $(url)) \
	$(foreach url,$(PIP_EXTRA_INDEX_URL) $(call pip_setting,extra-index-url),--extra-index-url $(url)) \
	$(foreach dir,$(sort $(PIP_FIND_LINKS) $(call pip_setting,find-links)),--find-links $(dir)) \
	$(foreach file,$(sort $(PIP_CONSTRAINT) $(call pip_setting,constraint)),--constraint $(file))
# Bytecode at install: where PYTHONDONTWRITEBYTECODE is set, nothing is written at import.
UV_INSTALL = $(UV) pip install -q --compile-bytecode $(UV_SOURCES)

# The test tools' virtualenv (checkov) installs beside the main one, not after it.
MAKEFLAGS += --jobs=2

.PHONY: demo test install

install: $(STAMP)

$(UV):
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "uv==$(UV_VERSION)"

$(STAMP): pyproject.toml | $(UV)
	$(UV_INSTALL) --python $(BIN)/python -e ".[cpu,test]"
	# These come as CUDA builds; each breaks `from vllm import LLM` on a CPU machine.
	$(UV) pip uninstall -q --python $(BIN)/python torchvision torchaudio torchcodec || true
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/specbatch demo

$(CHECKOV_STAMP): | $(UV)
	$(PYTHON) -m venv --without-pip $(CHECKOV_VENV)
	$(UV_INSTALL) --python $(CHECKOV_VENV)/bin/python "checkov==$(CHECKOV_VERSION)"
	touch $(CHECKOV_STAMP)

# tests/test_report.py opens the HTML report in a real headless Chromium (Debian's package).
CHROMIUM := /usr/bin/chromium
$(CHROMIUM):
	apt-get update
	apt-get install -y --no-install-recommends chromium

test: $(STAMP) $(CHECKOV_STAMP) $(CHROMIUM)
	CHECKOV=$(CHECKOV_VENV)/bin/checkov $(BIN)/python -m pytest
