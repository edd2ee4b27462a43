# The HTTP gateway: pure Python, no GPU, no model files. Installs the project as `make setup` does,
# with the CPU build of torch (the gateway itself never imports it; the shared requirements list
# it).
FROM python:3.11-slim

WORKDIR /app
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY requirements.txt pyproject.toml ./
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
    && pip install -r requirements.txt
COPY . .
RUN pip install --no-deps -e .

EXPOSE 8000
CMD ["python", "-m", "services.gateway", "--host", "0.0.0.0", "--port", "8000", \
     "--inference", "inference:50052", "--adapter-store", "adapter-store:50051"]
