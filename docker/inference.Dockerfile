# The inference service on an NVIDIA GPU. The CUDA runtime image provides the user-space driver
# libraries' counterpart; PyPI's torch wheel for Linux x86-64 is the CUDA build and brings its
# own CUDA libraries. On a machine without a GPU, docker-compose.cpu.yml runs this image with
# --device cpu.
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-pip \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv
COPY requirements.txt pyproject.toml ./
RUN pip install -r requirements.txt
COPY . .
RUN pip install --no-deps -e .

EXPOSE 50052 9400
CMD ["python", "-m", "services.inference", "--host", "0.0.0.0", "--port", "50052", \
     "--model", "/models/demo", "--adapter-store", "adapter-store:50051", "--device", "auto"]
