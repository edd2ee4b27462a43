"""Kernel tests: Triton kernels against the float64 torch references.

Without a GPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set here before
triton is imported when `make test` has not set it) on small shapes; on a CUDA machine the same
tests run compiled, at real sizes, in bfloat16 and float16 (tests/kernels/sizes.py).
"""

from __future__ import annotations

import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _fix_interpreter_loop_bounds() -> None:
    """Triton 3.6's interpreter turns a run-time loop bound into an int with int(ndarray), which
    numpy >= 2.4 refuses for the 1-element arrays it holds scalars in (triton-lang/triton#9171,
    fixed upstream after 3.6). Kernels loop to run-time bounds (context lengths), so take the
    element explicitly."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_lorafleet_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._lorafleet_fixed = True
    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _fix_interpreter_loop_bounds()

# CUDA graph tests need a GPU: without one the file is not collected (nothing to skip).
collect_ignore = [] if ON_GPU else ["test_graphs.py"]
