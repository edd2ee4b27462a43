# The adapter store: pure Python, no GPU. Installs the project as `make setup` does, with the CPU
# build of torch (the store itself never imports it; the shared requirements list it).
FROM python:3.11-slim

WORKDIR /app
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY requirements.txt pyproject.toml ./
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
    && pip install -r requirements.txt
COPY . .
RUN pip install --no-deps -e .

EXPOSE 50051
CMD ["python", "-m", "services.adapter_store", "--host", "0.0.0.0", "--port", "50051", \
     "--backend", "local", "--root", "/data"]
