# lorafleet developer entry points. `make test` sets everything up on a fresh machine.
PY := .venv/bin/python
VENV_STAMP := .venv/.installed

.PHONY: setup test lint proto run bench clean

setup: $(VENV_STAMP)

$(VENV_STAMP): requirements.txt pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install --upgrade --quiet pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(VENV_STAMP)

test: setup
	TRITON_INTERPRET=1 $(PY) -m pytest -q

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

proto: setup
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. \
		protos/lorafleet/v1/*.proto

run: setup
	$(PY) -m services.local_stack

# GPU benchmarks need an NVIDIA GPU; bench/store.py runs anywhere.
bench: setup
	$(PY) bench/store.py

clean:
	rm -rf .venv .pytest_cache .ruff_cache
