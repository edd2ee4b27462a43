"""The values in adapter_model.safetensors: every one must be finite.

A NaN or an infinity in A or B reaches every logit of every token the adapter touches, so such
an adapter is refused where it enters: on upload, as its bytes stream in (ValueChecker.feed takes
the file in pieces of any size, in order), and in the inference service when it arrives.
For IEEE formats a finite value is one within the dtype's range: its exponent bits are not all
ones. The check reads each value's bits as an unsigned integer (numpy releases the GIL for it):
with the sign bit cleared, a value is NaN or infinite exactly when it is >= the exponent mask.
"""

from __future__ import annotations

import numpy as np

from store.format_errors import AdapterFormatError
from store.safetensors_header import SafetensorsHeader

# dtype -> (little-endian unsigned view, sign-cleared mask, smallest non-finite bit pattern)
_BITS = {
    "F16": (np.dtype("<u2"), 0x7FFF, 0x7C00),
    "BF16": (np.dtype("<u2"), 0x7FFF, 0x7F80),
    "F32": (np.dtype("<u4"), 0x7FFFFFFF, 0x7F800000),
}
_WINDOW_BYTES = 1 << 20  # checked at a time: bounds the scratch buffer


class ValueChecker:
    """Checks the data section of one file, fed in order from the file's first byte."""

    def __init__(self, header: SafetensorsHeader, position: int = 0) -> None:
        """``position``: where in the file the first byte fed lies (at most the header's end:
        no value may be skipped)."""
        if position > header.data_offset:
            raise ValueError(f"position {position} is past the data section's start")
        self._header = header
        self._position = position  # bytes of the file fed so far
        self._tensor = 0  # index into header.tensors of the tensor at _position
        self._carry = b""  # the start of a value split between two pieces
        self._scratch = np.empty(_WINDOW_BYTES // 2, dtype=np.uint16)

    def feed(self, data: bytes | memoryview) -> None:
        """Check the next bytes of the file; raises AdapterFormatError at a non-finite value.
        Bytes past the last tensor are ignored (the caller checks the file's size)."""
        view = memoryview(data).cast("B")
        start = self._header.data_offset
        if self._position < start:
            skip = min(len(view), start - self._position)
            view = view[skip:]
            self._position += skip
        tensors = self._header.tensors
        while len(view) and self._tensor < len(tensors):
            tensor = tensors[self._tensor]
            end = start + tensor.end
            take = min(len(view), end - self._position)
            self._check(tensor, view[:take], self._position - start - tensor.begin)
            view = view[take:]
            self._position += take
            if self._position == end:
                self._tensor += 1

    def _check(self, tensor, piece: memoryview, offset: int) -> None:
        """``piece`` holds the tensor's bytes from ``offset`` (bytes into the tensor) on."""
        dtype, mask, limit = _BITS[tensor.dtype]
        size = dtype.itemsize
        if self._carry:
            need = size - len(self._carry)
            head = self._carry + bytes(piece[:need])
            self._carry = b""
            if len(head) < size:
                self._carry = head
                return
            self._check_values(tensor, head, dtype, mask, limit, offset - len(head) + need)
            piece, offset = piece[need:], offset + need
        whole = len(piece) - len(piece) % size
        for begin in range(0, whole, _WINDOW_BYTES):
            window = piece[begin : min(whole, begin + _WINDOW_BYTES)]
            self._check_values(tensor, window, dtype, mask, limit, offset + begin)
        self._carry = bytes(piece[whole:])

    def _check_values(self, tensor, raw, dtype, mask, limit, offset: int) -> None:
        values = np.frombuffer(raw, dtype=dtype)
        scratch = self._scratch.view(dtype.newbyteorder("="))[: len(values)]
        np.bitwise_and(values, mask, out=scratch)
        if scratch.max(initial=0) < limit:
            return
        index = offset // dtype.itemsize + int(np.argmax(scratch >= limit))
        row, column = divmod(index, tensor.shape[1])
        raise AdapterFormatError(
            f"tensor {tensor.name} holds a value that is not finite (NaN or infinite: outside "
            f"the range of {tensor.dtype}) at [{row}, {column}]"
        )


def check_values(header: SafetensorsHeader, data: bytes | memoryview) -> None:
    """Check every value of a whole file at once (raises AdapterFormatError)."""
    ValueChecker(header).feed(data)
