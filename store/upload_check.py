"""UploadCheck: everything the store checks in an upload's bytes, as they arrive, without I/O.

The safetensors header is parsed once it is complete and validated against adapter_config.json
(and the base model, when the store has one); from then on every value is checked as it arrives
(tensor_values.py), and the file may not grow past the size its header fixes. It is plain
synchronous code, so the upload runs it on a worker thread and a test can drive it directly.
"""

from __future__ import annotations

from store.base_model import BaseModelShape
from store.errors import AdapterTooLarge, InvalidRequest, TenantStorageFull
from store.lora_config import LoraAdapterConfig
from store.peft import SafetensorsHeader, SafetensorsHeaderReader, validate_adapter
from store.tensor_values import ValueChecker


class UploadCheck:
    def __init__(
        self,
        config: LoraAdapterConfig,
        max_bytes: int,
        base: BaseModelShape | None = None,
        announced_size: int = 0,
        quota: str = "",
    ) -> None:
        """``announced_size``: the size the client said the file has (0 = not said);
        ``quota``: where ``max_bytes`` is the room a tenant's storage quota leaves, what that
        quota is (errors then say it, as TenantStorageFull)."""
        self._config = config
        self._max = max_bytes
        self._quota = quota
        self._base = base
        self._announced = announced_size
        self._reader = SafetensorsHeaderReader()
        self._values: ValueChecker | None = None
        self.received = 0

    @property
    def header(self) -> SafetensorsHeader | None:
        return self._reader.header

    def feed(self, chunk: bytes | memoryview) -> None:
        """The next bytes of adapter_model.safetensors; raises AdapterFormatError (the file is
        not a valid adapter), AdapterTooLarge or InvalidRequest."""
        self.received += len(chunk)
        if self.received > self._max:
            self._too_large(f"adapter is over the limit of {self._max} bytes")
        if self._values is None:
            if self._reader.feed(chunk) is None:
                return
            self._check_header(self._reader.header)
            # The chunk that completed the header may hold the first values too.
            self._values = ValueChecker(self._reader.header, self.received - len(chunk))
        expected = self._reader.header.total_size
        if self.received > expected:
            raise InvalidRequest(
                f"adapter_model.safetensors has more bytes than its header describes "
                f"({self.received} > {expected})"
            )
        self._values.feed(chunk)

    def _check_header(self, header: SafetensorsHeader) -> None:
        if header.total_size > self._max:
            self._too_large(
                f"adapter_model.safetensors is {header.total_size} bytes; the limit is {self._max}"
            )
        if self._announced and self._announced != header.total_size:
            raise InvalidRequest(
                f"size_bytes says {self._announced} but the safetensors header describes "
                f"a file of {header.total_size} bytes"
            )
        validate_adapter(self._config, header, self._base)

    def _too_large(self, message: str) -> None:
        if self._quota:
            raise TenantStorageFull(f"{message}: {self._quota}")
        raise AdapterTooLarge(message)

    def finish(self) -> SafetensorsHeader:
        """The validated header, once the whole file has arrived."""
        header = self._reader.header
        if header is None:
            raise InvalidRequest(
                f"upload ended after {self.received} bytes, inside the safetensors header"
            )
        if self.received < header.total_size:
            raise InvalidRequest(
                f"adapter_model.safetensors is truncated: received {self.received} of "
                f"{header.total_size} bytes"
            )
        return header
