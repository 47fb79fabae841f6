# The two commands a newcomer needs:
#   make demo   installs what is needed and runs the demo pipeline end to end
#   make test   installs what is needed and runs lint, types and the whole test suite
# While working on the code:
#   make unit             the fast tier: every test not marked slow, in two processes (about 60 s on 2 cores)
#   make test-under-load  make test while two busy loops keep two cores busy (tests must not
#                         depend on timing)

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The runtime needs no system packages: every wheel bundles its libraries (PyAV its
# FFmpeg; headless OpenCV needs neither libGL nor GLib, only zlib and the C/C++ runtimes).
# System packages the tests need: FFmpeg CLI, GStreamer's RTSP server (test camera), Chromium
# (dashboard test), buildah and debootstrap (the image is built and run), Prometheus and
# promtool (the dashboard's queries and the alert rules).
APT_PACKAGES := ffmpeg python3-gi gir1.2-gstreamer-1.0 gir1.2-gst-rtsp-server-1.0 \
	gstreamer1.0-tools gstreamer1.0-plugins-base gstreamer1.0-plugins-good \
	gstreamer1.0-plugins-bad gstreamer1.0-plugins-ugly gstreamer1.0-libav \
	chromium fonts-dejavu-core buildah debootstrap prometheus
PYTEST_ARGS ?=

.PHONY: demo test install lock system-deps apt-install lint typecheck unit suite \
	test-under-load bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# A real Triton server for tests/inference/test_triton.py: the `tritonserver` inside the
# nvidia-pytriton wheel. The wheel pins numpy<2, which would pull the whole environment
# back to NumPy 1, so it goes in without its pins, and its Python-backend stub gets a
# NumPy 1 of its own (a folder the tests put first on the stub's path).
TRITON_TEST_DEPS := 'tritonclient[http]' pyzmq sh typer typing_inspect wrapt importlib_metadata

# constraints.txt pins every dependency to the versions CI tests with; the images install
# from it too. The samples group (the wheel holding the PP-OCR models) goes in without its
# dependencies, which would pull the GUI build of OpenCV (pyproject.toml says more).
# A virtualenv made while the project used opencv-python has both wheels writing cv2/:
# the GUI one is removed and the headless files laid down again.
$(VENV)/.installed: pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/pip install --quiet --constraint constraints.txt -e '.[test]'
	$(BIN)/pip install --quiet --constraint constraints.txt --no-deps --group samples
	@if $(BIN)/pip show --quiet opencv-python 2>/dev/null; then \
		$(BIN)/pip uninstall --quiet --yes opencv-python && \
		$(BIN)/pip install --quiet --constraint constraints.txt --no-deps --force-reinstall \
			opencv-python-headless; \
	fi
	$(BIN)/pip install --quiet --constraint constraints.txt $(TRITON_TEST_DEPS)
	$(BIN)/pip install --quiet --no-deps nvidia-pytriton
	$(BIN)/pip install --quiet --no-deps --upgrade --target $(VENV)/triton-stub-numpy 'numpy<2'
	touch $@

install: $(VENV)/.installed

# Re-resolve constraints.txt from pyproject.toml after changing dependencies, and commit
# the result. Pins already in the file are kept where they still fit;
# `make lock LOCK_ARGS=--upgrade` moves everything to the newest allowed versions.
LOCK_ARGS ?=
lock: | $(BIN)/python
	$(BIN)/pip install --quiet uv
	$(BIN)/uv pip compile pyproject.toml --extra test --group samples --python-version 3.11 --universal \
		--custom-compile-command "make lock" --quiet --output-file constraints.txt $(LOCK_ARGS)

# Install only what is missing; need root (or sudo) on Debian/Ubuntu.
system-deps:
	@$(MAKE) --no-print-directory apt-install PACKAGES="$(APT_PACKAGES)"

apt-install:
	@missing=$$(for p in $(PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing system packages: $$missing"; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

samples/generated/demo.mp4: samples/make_clip.py | install
	$(BIN)/python samples/make_clip.py $@

demo: install samples/generated/demo.mp4
	$(BIN)/vidpipe run configs/demo.yaml --summary

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy

# The fast tier leaves out the tests marked `slow` (real servers started per test,
# subprocess runs of the CLI, soaks); tests/conftest.py says how a test gets the mark.
# Two pytest processes: about half of a fast test's time is spent waiting on a server or a
# codec, so a second process fills the idle core (pytest-xdist; UNIT_WORKERS=0 runs one).
UNIT_WORKERS ?= 2
unit: install system-deps
	$(BIN)/pytest -q -m "not slow and not gpu" -n $(UNIT_WORKERS) $(PYTEST_ARGS)

suite: install system-deps
	$(BIN)/pytest -q $(PYTEST_ARGS)

test: lint typecheck suite

# Two busy loops for as long as `make test` runs, stopped however it ends.
LOAD_JOBS ?= 2
test-under-load: install
	@pids=; for i in $$(seq $(LOAD_JOBS)); do sh -c 'while :; do :; done' & pids="$$pids $$!"; done; \
	trap 'kill $$pids 2>/dev/null' EXIT INT TERM; \
	echo "busy loops: $$pids"; \
	$(MAKE) --no-print-directory test

bench: install
	$(BIN)/python bench/batching.py
	$(BIN)/python bench/scheduler_overhead.py

clean:
	rm -rf $(VENV) samples/generated test-artifacts .pytest_cache .mypy_cache .ruff_cache
