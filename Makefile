# k3rocm — the README's two commands are `make demo` and `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
REPORT  ?= reports/demo
STAMP   := $(VENV)/.k3rocm-installed

.PHONY: demo test gpu-test isa venv clean

venv: $(STAMP)

# Where a CUDA/ROCm build of torch is already installed (a GPU node), reuse it through a venv with
# system site packages instead of pulling another torch; otherwise install the CPU set-up pinned in
# constraints-cpu.txt (the versions the suite was last run against).
$(STAMP): pyproject.toml constraints-cpu.txt
	@if $(PY) -c "import sys, torch; sys.exit(0 if (torch.version.cuda or torch.version.hip) else 1)" >/dev/null 2>&1; then \
	  echo "k3rocm: reusing this machine's GPU build of torch (venv with system site packages)"; \
	  $(PY) -m venv --system-site-packages $(VENV) && \
	  $(BIN)/pip install -q --disable-pip-version-check -e ".[test]"; \
	else \
	  echo "k3rocm: no GPU build of torch here; installing the pinned CPU set-up (constraints-cpu.txt)"; \
	  $(PY) -m venv $(VENV) && \
	  $(BIN)/pip install -q --disable-pip-version-check -c constraints-cpu.txt -e ".[test]"; \
	fi
	@$(BIN)/python -c "import torch, triton; b = ('ROCm ' + torch.version.hip) if torch.version.hip else (('CUDA ' + torch.version.cuda) if torch.version.cuda else 'CPU'); print(f'k3rocm: torch {torch.__version__} ({b} build), triton {triton.__version__}')"
	@touch $@

demo: $(STAMP)
	$(BIN)/k3rocm load --out $(REPORT)
	$(BIN)/k3rocm validate --level performance --out $(REPORT)
	$(BIN)/k3rocm bench --out $(REPORT)

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 -m "not gpu" tests

gpu-test: $(STAMP)
	$(BIN)/python -m pytest -q -m gpu tests

isa: $(STAMP)
	$(BIN)/k3rocm kernels isa

clean:
	rm -rf $(VENV) reports build *.egg-info
