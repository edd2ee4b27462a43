"""Fixtures shared by the inference tests (defined in tests/inference/models.py)."""

import torch

from tests.inference.models import tiny_models  # noqa: F401  (re-exported fixture)

# The CUDA engine tests need a GPU, the tensor-parallel ones two: without them the file is not
# collected (nothing to skip).
_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
collect_ignore = [
    name
    for name, need in (("test_engine_cuda.py", 1), ("test_tensor_parallel_cuda.py", 2))
    if _gpus < need
]
