"""Fixtures shared by the inference tests (defined in tests/inference/models.py)."""

import torch

from tests.inference.models import tiny_models  # noqa: F401  (re-exported fixture)

# The CUDA engine tests need a GPU: without one the file is not collected (nothing to skip).
collect_ignore = [] if torch.cuda.is_available() else ["test_engine_cuda.py"]
