"""A multipart/form-data body as a stream of events, parsed as its bytes arrive.

Nothing is spooled: a file part's bytes are handed on as they come (python-multipart's
incremental parser), so an upload of any size holds one network read in memory here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import NamedTuple

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect, Request

from services.gateway.errors import BadRequest, ClientGone


class PartStart(NamedTuple):
    name: str


class PartData(NamedTuple):
    data: bytes


class PartEnd(NamedTuple):
    pass


Event = PartStart | PartData | PartEnd


async def multipart_events(request: Request) -> AsyncIterator[Event]:
    """PartStart, its PartData, PartEnd, for each part in order. BadRequest on a body that is
    not multipart/form-data; ClientGone when the client leaves mid-body."""
    kind, params = parse_options_header(request.headers.get("content-type", ""))
    boundary = params.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise BadRequest("the body must be multipart/form-data (with a boundary)")
    pending: list[Event] = []
    header: dict[str, bytearray] = {"field": bytearray(), "value": bytearray()}
    disposition: list[bytes] = []

    def on_part_begin() -> None:
        disposition.clear()

    def on_header_field(data: bytes, start: int, end: int) -> None:
        header["field"] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        header["value"] += data[start:end]

    def on_header_end() -> None:
        if bytes(header["field"]).lower() == b"content-disposition":
            disposition.append(bytes(header["value"]))
        header["field"].clear()
        header["value"].clear()

    def on_headers_finished() -> None:
        _, options = parse_options_header(disposition[0] if disposition else b"")
        name = options.get(b"name")
        if name is None:
            raise BadRequest("a form part has no Content-Disposition name")
        pending.append(PartStart(name.decode("utf-8", "replace")))

    def on_part_data(data: bytes, start: int, end: int) -> None:
        pending.append(PartData(bytes(data[start:end])))

    def on_part_end() -> None:
        pending.append(PartEnd())

    parser = MultipartParser(
        boundary,
        {
            "on_part_begin": on_part_begin,
            "on_header_field": on_header_field,
            "on_header_value": on_header_value,
            "on_header_end": on_header_end,
            "on_headers_finished": on_headers_finished,
            "on_part_data": on_part_data,
            "on_part_end": on_part_end,
        },
    )
    try:
        async for chunk in request.stream():
            parser.write(chunk)
            for event in pending:
                yield event
            pending.clear()
        parser.finalize()
    except FormParserError as exc:
        raise BadRequest(f"the multipart body is malformed: {exc}") from None
    except ClientDisconnect:
        raise ClientGone() from None
    for event in pending:
        yield event
