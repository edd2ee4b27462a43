"""Authorization: what each caller (services/auth.py) may touch, the same in both services,
and the audit lines of the calls that change what is stored or resident.

A tenant acts only on adapter ids under ``NAME/``, and its listings and watches show only
those; ``admin`` may do anything; ``service`` (the inference service's credential at the store)
may read everything from the store and do nothing else, and nothing at the inference service;
the anonymous caller (no token file) may do anything. A refusal is PermissionDenied, raised
before the store or the registry is asked, so that it says nothing of other tenants' ids.
"""

from __future__ import annotations

import logging

from services.auth import Caller, PermissionDenied, Role

audit_log = logging.getLogger("lorafleet.audit")


def _own(caller: Caller, adapter_id: str) -> bool:
    return caller.unrestricted or (
        caller.namespace is not None and adapter_id.startswith(caller.namespace)
    )


def _outside(caller: Caller, adapter_id: str) -> PermissionDenied:
    return PermissionDenied(
        f"{caller} may only use adapter ids under {caller.namespace!r}; {adapter_id!r} is not"
    )


def check_store_read(caller: Caller, adapter_id: str) -> None:
    """GetAdapter, FetchAdapter: a tenant its own adapters, admin and service any."""
    if caller.role is Role.SERVICE or _own(caller, adapter_id):
        return
    raise _outside(caller, adapter_id)


def check_store_write(caller: Caller, adapter_id: str) -> None:
    """UploadAdapter, DeleteAdapter: a tenant its own adapters, admin any, service none."""
    if caller.role is Role.SERVICE:
        raise PermissionDenied("the service credential may only read from the adapter store")
    if not _own(caller, adapter_id):
        raise _outside(caller, adapter_id)


def scope_prefix(caller: Caller, prefix: str) -> str:
    """The prefix a listing or watch for ``prefix`` really uses: a tenant's own namespace when
    ``prefix`` is empty or a prefix of it, ``prefix`` itself when it lies inside it. A tenant
    asking for a prefix outside its namespace is refused."""
    if caller.role is Role.SERVICE or caller.unrestricted:
        return prefix
    namespace = caller.namespace
    if prefix.startswith(namespace):
        return prefix
    if namespace.startswith(prefix):
        return namespace  # every id under the namespace matches ``prefix`` too
    raise PermissionDenied(f"{caller} may only list adapter ids under {namespace!r}")


def check_inference(caller: Caller, adapter_id: str) -> None:
    """Generate, LoadAdapter, UnloadAdapter: a tenant its own adapters and the base model
    (adapter_id ""), admin anything; the service credential has no rights here."""
    if caller.role is Role.SERVICE:
        raise PermissionDenied("the service credential has no rights at the inference service")
    if adapter_id and not _own(caller, adapter_id):
        raise _outside(caller, adapter_id)


def visible(caller: Caller, adapter_id: str) -> bool:
    """Whether a listing at the inference service shows ``adapter_id`` to ``caller``."""
    return caller.role is not Role.SERVICE and _own(caller, adapter_id)


class audited:  # noqa: N801 (used as a statement: ``with audited(...) as entry:``)
    """Logs one audit line when its block ends: who (role, tenant), what (action, adapter,
    version) and how it ended (ok, denied, or failed with the error's type). Uploads, deletes,
    loads and unloads are audited; the block sets ``version`` once it is known."""

    def __init__(self, action: str, caller: Caller, adapter_id: str, version: int | str = 0):
        self.action, self.caller, self.adapter_id, self.version = (
            action, caller, adapter_id, version,
        )  # fmt: skip

    def __enter__(self) -> audited:
        return self

    def __exit__(self, kind, exc, _tb) -> bool:
        if exc is None:
            outcome = "ok"
        elif isinstance(exc, PermissionDenied):
            outcome = "denied"
        else:
            outcome = f"failed:{type(exc).__name__}"
        audit_log.info(
            "audit action=%s role=%s tenant=%s adapter=%s version=%s outcome=%s",
            self.action, self.caller.role.value, self.caller.tenant or "-",
            self.adapter_id or "-", self.version or "latest", outcome,
        )  # fmt: skip
        return False
