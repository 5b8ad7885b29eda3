# The two commands a newcomer runs: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: run test install install-test system-deps lint format clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Installs run once: a stamp file in the venv records it, and pyproject.toml changing (or, for
# the test install, this Makefile: the reference pins below) redoes it. `make run` then starts
# the server at once, without pip's 15 s and setuptools' warning box.
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test

$(RUN_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[voice]'
	touch $@

install: $(RUN_STAMP)

# Reference implementations for parity tests, without their dependencies: chattts and vocos
# would pull torchaudio (no build for our torch); the tests stub the parts they do not use.
REFERENCE_PKGS := chattts==0.2.5 vocos==0.1.0 vector-quantize-pytorch==1.32.0 \
	torch-einops-utils==0.2.0

# Debian packages the tests need: chromium for tests/test_playground.py (playwright downloads
# no browser here). Installed as root, or through sudo without a prompt (sudo -n); a machine
# where neither works gets one clear error instead of failing tests later.
SYSTEM_PKGS := chromium

system-deps:
	@command -v chromium >/dev/null && exit 0; \
	command -v apt-get >/dev/null || { echo "make test needs Debian's $(SYSTEM_PKGS) (apt-get not found): install it, then rerun" >&2; exit 1; }; \
	sudo=""; [ "$$(id -u)" -eq 0 ] || sudo="sudo -n"; \
	echo "installing $(SYSTEM_PKGS) (Debian) for the browser tests"; \
	$$sudo apt-get update -qq && \
	$$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SYSTEM_PKGS) >/dev/null

# The Qwen3-TTS reference (qwen-tts) pins transformers 4.57.3 and pulls gradio, librosa and
# torchaudio; omnistep runs transformers 5.x. So it goes, with the transformers it pins and
# without dependencies, into an overlay folder that only the parity tests' subprocess puts first
# on its path (tests/qwen3_tts_ref/env.py); the venv itself never imports it. The marker file
# makes a second `make test` skip the install.
# librosa is real there (the voice-clone prompt's mel filters and resampling), with what it
# imports that the venv lacks (numba, msgpack, soxr, soundfile come from the venv; scikit-learn
# is only imported by librosa parts qwen-tts never uses). Bump the marker's number when the
# list changes, so an older overlay is rebuilt.
QWEN_TTS_REF := .ref/qwen-tts
QWEN_TTS_REF_PKGS := qwen-tts==0.1.1 transformers==4.57.3 "huggingface_hub<1.0" \
	"tokenizers<0.23" accelerate==1.12.0 \
	librosa==0.11.0 scipy==1.17.1 audioread==3.1.0 lazy_loader==0.6 decorator==5.3.1 \
	joblib==1.6.0 cloudpickle==3.1.2 pooch==1.9.0 platformdirs==4.14.9
QWEN_TTS_REF_MARK := $(QWEN_TTS_REF)/.installed-2

$(QWEN_TTS_REF_MARK): | $(BIN)/python
	rm -rf $(QWEN_TTS_REF)
	$(BIN)/pip install -q --no-deps --target $(QWEN_TTS_REF) $(QWEN_TTS_REF_PKGS)
	touch $@

# The Chatterbox reference (chatterbox-tts 0.1.7) pins torch 2.6, transformers 5.2, gradio,
# diffusers, resemble-perth (its watermarker) and more. Its T3 imports only torch, transformers,
# einops and tqdm, which the venv has. Its S3Gen flow and HiFT (tests/chatterbox_ref/
# upstream_s3gen.py) import diffusers (the estimator's attention blocks), conformer, omegaconf
# (a type in flow.py), scipy (HiFT's window) and librosa (the mel filters; its effects.trim, which
# the voice encoder calls, imports scikit-learn): those go into the overlay too, --no-deps, with
# librosa's imports as for qwen-tts. The reference-clip front ends (tests/chatterbox_ref/
# upstream_clone.py) need s3tokenizer (S3TokenizerV2, which upstream's S3Tokenizer subclasses;
# its utils import onnx, from the venv) and torchaudio (s3gen.py's resampler, xvector.py's
# Kaldi fbank): torchaudio's compiled libraries do not load beside our torch, so they are
# deleted after the install and torchaudio imports without its extension; the parts upstream
# calls (compliance.kaldi, transforms.Resample) are plain torch. tests/chatterbox_ref/env.py
# imports the submodules without the package __init__s. Bump the marker's number when the
# list changes.
CHATTERBOX_REF := .ref/chatterbox
CHATTERBOX_REF_PKGS := chatterbox-tts==0.1.7 diffusers==0.42.1 conformer==0.3.2 omegaconf==2.3.0 \
	antlr4-python3-runtime==4.9.3 librosa==0.11.0 scipy==1.17.1 audioread==3.1.0 lazy_loader==0.6 \
	decorator==5.3.1 joblib==1.6.0 pooch==1.9.0 platformdirs==4.14.9 scikit-learn==1.6.1 \
	threadpoolctl==3.8.0 cloudpickle==3.1.2 s3tokenizer==0.3.0 torchaudio==2.11.0
CHATTERBOX_REF_MARK := $(CHATTERBOX_REF)/.installed-3

$(CHATTERBOX_REF_MARK): | $(BIN)/python
	rm -rf $(CHATTERBOX_REF)
	$(BIN)/pip install -q --no-deps --target $(CHATTERBOX_REF) $(CHATTERBOX_REF_PKGS)
	rm -f $(CHATTERBOX_REF)/torchaudio/lib/*.so
	touch $@

# The VoxCPM2 reference (voxcpm 2.0.3) declares gradio, funasr, modelscope, torchaudio,
# torchcodec, datasets and more. VoxCPM2Model (voxcpm/model/voxcpm2.py, the part the parity tests
# compare) imports torch, transformers, einops, pydantic, tqdm, safetensors (from the venv) and
# librosa (its reference-clip loader), which the venv lacks: so the overlay holds the package and
# librosa with what librosa imports that the venv lacks (scipy, audioread, lazy_loader,
# decorator, joblib, cloudpickle, pooch, platformdirs; numba, soxr, msgpack and soundfile come
# from the venv), all --no-deps. tests/voxcpm_ref/env.py registers bare `voxcpm` and `voxcpm.model` packages so
# their __init__s do not run (they import core.py's huggingface/modelscope pipeline and the
# VoxCPM1 model, which needs torchaudio). Nothing is stubbed. Bump the marker when the list
# changes.
VOXCPM_REF := .ref/voxcpm
VOXCPM_REF_PKGS := voxcpm==2.0.3 librosa==0.11.0 scipy==1.17.1 audioread==3.1.0 \
	lazy_loader==0.6 decorator==5.3.1 joblib==1.6.0 cloudpickle==3.1.2 pooch==1.9.0 \
	platformdirs==4.14.9
VOXCPM_REF_MARK := $(VOXCPM_REF)/.installed-2

$(VOXCPM_REF_MARK): | $(BIN)/python
	rm -rf $(VOXCPM_REF)
	$(BIN)/pip install -q --no-deps --target $(VOXCPM_REF) $(VOXCPM_REF_PKGS)
	touch $@

$(TEST_STAMP): pyproject.toml Makefile | $(BIN)/python
	$(BIN)/pip install -q -e '.[voice,piper,chattts,test,dev]'
	$(BIN)/pip install -q --no-deps $(REFERENCE_PKGS)
	touch $@ $(RUN_STAMP)

install-test: $(BIN)/python system-deps $(QWEN_TTS_REF_MARK) $(CHATTERBOX_REF_MARK) \
	$(VOXCPM_REF_MARK) $(TEST_STAMP)

run: install
	$(BIN)/omnistep serve --host $(HOST) --port $(PORT)

test: install-test
	$(BIN)/python -m pytest -q

lint: install-test
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: install-test
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ref
