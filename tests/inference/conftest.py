"""Fixtures shared by the inference tests (defined in tests/inference/models.py)."""

from tests.inference.models import tiny_models  # noqa: F401  (re-exported fixture)
