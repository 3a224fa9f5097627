# The README's two commands: `make demo` and `make test`. Both install into .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
# torch/torchvision are installed first and pinned: this machine serves exactly these from disk.
# On your own machine override, e.g. `make test TORCH_SPEC="torch torchvision"`.
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1

.PHONY: install data browser demo test lint bench bench-gpu fidelity clean clean-results server

install: $(VENV)/.installed

# pip stays quiet (-q); one line per step says what the next minute or two is spent on.
$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || { echo "raycl: creating the virtual environment $(VENV)"; \
		python3 -m venv $(VENV); }
	@echo "raycl: upgrading pip"
	@$(PY) -m pip install -q --upgrade pip
	@echo "raycl: installing $(TORCH_SPEC) (the largest package)"
	@$(PY) -m pip install -q $(TORCH_SPEC)
	@echo "raycl: installing raycl and its dependencies (ray, mlflow, optuna, …) into $(VENV)"
	@$(PY) -m pip install -q -e '.[dev]'
	@touch $@
	@echo "raycl: installed ($(PY))"

# Fashion-MNIST for the mnist_fashion dataset: a Debian package (skipped when not root).
data:
	@if [ ! -d /usr/share/datasets/fashion-mnist ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 || \
		 (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1)) \
		|| echo "note: could not install dataset-fashion-mnist; its tests will be skipped"; \
	fi

# Chromium for the MLflow UI browser test (tests/test_mlflow_ui.py): a Debian package (installed
# when root, ~20 s; otherwise, or when it cannot be installed, that test is skipped).
browser:
	@if [ ! -x /usr/bin/chromium ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing chromium for the MLflow UI browser test"; \
		(DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 || \
		 (apt-get update -q >/dev/null 2>&1 && \
		  DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1)) \
		|| echo "note: could not install chromium; the MLflow UI browser test will be skipped"; \
	elif [ ! -x /usr/bin/chromium ]; then \
		echo "note: /usr/bin/chromium is missing (as root: apt-get install chromium);" \
		     "the MLflow UI browser test will be skipped"; \
	fi

demo: install
	$(PY) -m raycl.tune searches/quickstart.yaml

# Two test workers; the work units (the shared Ray session's tests, the simulated cloud, each
# fault sweep, ...) are handed out longest first, so both stay busy to the end (tests/conftest.py,
# tests/xdist_order.py). `make test PYTEST_WORKERS=0` runs them in one process. OMP_WAIT_POLICY:
# OpenMP threads that wait without spinning, on cores the processes share (tests/conftest.py).
# PYTHONDONTWRITEBYTECODE (set on some machines, CI's included) is emptied for the tests: every
# process the suite starts (xdist workers, Ray trials and workers, drivers: hundreds) would
# otherwise compile raycl's modules and the tests from source again (~0.3 s of CPU each).
PYTEST_WORKERS ?= 2

test: install data browser
	$(PY) -m ruff check .
	$(PY) tools/structure.py
	OMP_WAIT_POLICY=PASSIVE PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n $(PYTEST_WORKERS) \
		--dist loadgroup --durations=40

# An MLflow server on 127.0.0.1:5000 over ./mlflow.db (sweeps: --tracking-uri http://127.0.0.1:5000).
server: install
	$(PY) -m raycl.server

lint: install
	$(PY) -m ruff check .

bench: install
	$(PY) benchmarks/bench.py

# The GPU benchmark: raycl's step vs a plain loop, AMP, channels_last, torch.compile, each
# method's step, augmentation, embedding, faiss k-means (docs/benchmarks.md). Needs torch only:
# on a bare GPU machine `python benchmarks/gpu.py` does the same.
bench-gpu: install
	$(PY) benchmarks/gpu.py

# Each seed paper's claim over 3 paired seeds with a 95 % interval, about an hour on 2 cores
# (docs/benchmarks.md, "Fidelity"); FIDELITY="--quick" for the 2-minute smoke, "--scale gpu
# --device cuda" on a GPU. Needs torch, not Ray: python benchmarks/fidelity.py on a bare machine.
FIDELITY ?= --scale cpu
fidelity: install data
	$(PY) benchmarks/fidelity.py $(FIDELITY) --json-out fidelity.jsonl

# Only what is rebuilt by itself: caches, build files, the UI test's screenshots. Never results.
clean:
	rm -rf .pytest_cache .ruff_cache .pytest-artifacts build dist *.egg-info
	find . \( -path ./$(VENV) -o -path ./.git \) -prune -o -name __pycache__ -type d -prune \
		-exec rm -rf {} +

# Sweep results here: MLflow's runs and artifacts, Ray Tune's state and checkpoints, the only
# copy of every sweep run with the default paths. Listed; deleted only with CONFIRM=1.
RESULTS := ray_results mlflow.db mlartifacts mlruns

clean-results:
	@found=""; for path in $(RESULTS); do [ -e "$$path" ] && found="$$found $$path"; done; \
	if [ -z "$$found" ]; then echo "no results here (none of: $(RESULTS))"; exit 0; fi; \
	du -sh $$found; \
	if [ "$(CONFIRM)" != 1 ]; then \
		echo "these are the only copy of every sweep's runs and checkpoints;" \
		     "'make clean-results CONFIRM=1' deletes them"; exit 1; fi; \
	rm -rf $$found; echo "deleted:$$found"
