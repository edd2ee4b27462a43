"""services/auth.py, access.py, tokens.py and inference/tenancy.py without processes: the
token file's format and reload, the bearer metadata, every authorization rule, the token
tool, and the quota arithmetic on a clock the test moves."""

from __future__ import annotations

import json
import os
import stat

import pytest

from services import tokens as tokens_tool
from services.access import (
    check_inference,
    check_store_read,
    check_store_write,
    scope_prefix,
    visible,
)
from services.auth import (
    ANONYMOUS,
    Authenticator,
    Caller,
    PermissionDenied,
    Role,
    TokenFileError,
    TokenTable,
    Unauthenticated,
    bearer_metadata,
    parse_tokens,
    token_digest,
)
from services.inference.errors import TenantQuotaExceeded
from services.inference.tenancy import Quotas, Tenancy
from services.tls import is_loopback

ACME = Caller(Role.TENANT, "acme")
ADMIN = Caller(Role.ADMIN)
SERVICE = Caller(Role.SERVICE)
HEX = "ab" * 32


def doc(*items) -> str:
    return json.dumps({"tokens": list(items)})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not json", "is not JSON"),
        ('{"token": []}', 'expected {"tokens": [...]}'),
        (doc("x"), "tokens[0] must be an object"),
        (doc({"sha256": "ab", "role": "admin"}), "tokens[0]: sha256 must be 64 lowercase hex"),
        (doc({"sha256": HEX.upper(), "role": "admin"}), "sha256 must be 64 lowercase hex"),
        (doc({"sha256": HEX, "role": "root"}), "role must be 'tenant', 'admin' or 'service'"),
        (doc({"sha256": HEX, "role": "anonymous"}), "role must be"),
        (doc({"sha256": HEX, "role": "tenant"}), "a tenant needs a name"),
        (doc({"sha256": HEX, "role": "tenant", "tenant": "Acme"}), "a tenant needs a name"),
        (doc({"sha256": HEX, "role": "tenant", "tenant": "a/b"}), "a tenant needs a name"),
        (doc({"sha256": HEX, "role": "admin", "tenant": "acme"}), "only role 'tenant'"),
        (
            doc({"sha256": HEX, "role": "admin"}, {"sha256": HEX, "role": "service"}),
            "tokens[1]: the same sha256 appears twice",
        ),
    ],
)
def test_a_malformed_token_file_is_refused_naming_the_entry(text, message):
    with pytest.raises(TokenFileError) as refused:
        parse_tokens(text, "tokens.json")
    assert message in str(refused.value) and "tokens.json" in str(refused.value)


def test_tokens_resolve_to_their_callers_from_bearer_metadata(tmp_path):
    path = tmp_path / "tokens.json"
    path.write_text(
        doc(
            {"sha256": token_digest("t-acme"), "role": "tenant", "tenant": "acme"},
            {"sha256": token_digest("t-admin"), "role": "admin"},
            {"sha256": token_digest("t-svc"), "role": "service", "note": "extra keys are fine"},
        )
    )
    auth = Authenticator.from_file(path)
    assert auth.caller_from_metadata(bearer_metadata("t-acme")) == ACME
    assert auth.caller_from_metadata(bearer_metadata("t-admin")) == ADMIN
    assert auth.caller_from_metadata([("authorization", "bearer   t-svc ")]) == SERVICE
    assert auth.caller_from_metadata([("x", "y"), ("authorization", b"Bearer t-acme")]) == ACME
    for metadata, message in (
        ((), "no credentials"),
        ([("authorization", "Basic dDp0")], "must read 'Bearer TOKEN'"),
        ([("authorization", "Bearer")], "must read 'Bearer TOKEN'"),
        (bearer_metadata("t-acmE"), "not valid here"),
        (bearer_metadata(token_digest("t-acme")), "not valid here"),  # the digest is no token
    ):
        with pytest.raises(Unauthenticated) as refused:
            auth.caller_from_metadata(metadata)
        assert message in str(refused.value)
    # Without a token file everybody is anonymous, with every right.
    assert Authenticator(None).caller_from_metadata(()) is ANONYMOUS
    check_store_write(ANONYMOUS, "anything/at-all")
    assert scope_prefix(ANONYMOUS, "") == ""


def test_the_table_follows_the_file_and_keeps_the_last_good_version(tmp_path, caplog):
    path = tmp_path / "tokens.json"
    path.write_text(doc({"sha256": token_digest("one"), "role": "admin"}))
    table = TokenTable(path)
    assert table.lookup("one") == ADMIN and table.lookup("two") is None
    path.write_text(doc({"sha256": token_digest("two"), "role": "tenant", "tenant": "b"}))
    os.utime(path, ns=(1, 1))  # a new signature even within one mtime tick
    assert table.lookup("one") is None and table.lookup("two") == Caller(Role.TENANT, "b")
    path.write_text("{ half a file")
    assert table.lookup("two") == Caller(Role.TENANT, "b")
    assert "the previous tokens stay" in caplog.text
    path.unlink()
    assert table.lookup("two") == Caller(Role.TENANT, "b")
    assert "is gone; the previous tokens stay" in caplog.text
    with pytest.raises(TokenFileError):
        TokenTable(tmp_path / "missing.json")


def test_the_store_token_file_keeps_its_last_token_and_logs_a_problem_once(tmp_path, caplog):
    from services.inference.store_access import TokenFile

    path = tmp_path / "service.token"
    path.write_text(" one\n")
    token = TokenFile(path)
    assert token.metadata() == bearer_metadata("one")
    path.write_text("two")
    assert token.metadata() == bearer_metadata("two")
    # Each problem is logged once however often the token is asked for: a path that cannot
    # be read (a directory now), a version without a token, the file gone.
    path.unlink()
    path.mkdir()
    for state in ("unreadable", "empty", "gone"):
        if state == "empty":
            path.rmdir()
            path.write_text("  \n")
        elif state == "gone":
            path.unlink()
        for _ in range(3):
            assert token.metadata() == bearer_metadata("two")
    problems = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(problems) == 3, problems
    assert all("the previous token is still sent" in p for p in problems)
    assert "cannot read" in problems[0] and "holds no token" in problems[1]
    assert "is gone" in problems[2]
    for text in ("", "\n"):
        (tmp_path / "empty").write_text(text)
        with pytest.raises(TokenFileError, match="holds no token"):
            TokenFile(tmp_path / "empty")
    with pytest.raises(TokenFileError, match="cannot be read"):
        TokenFile(tmp_path / "missing")


def test_namespace_rules():
    check_store_read(ACME, "acme/x")
    check_store_write(ACME, "acme/team/x")
    check_inference(ACME, "acme/x")
    check_inference(ACME, "")  # the base model
    for adapter_id in ("beta/x", "acme", "acmex/y", "x/acme/y"):
        for rule in (check_store_read, check_store_write, check_inference):
            with pytest.raises(PermissionDenied, match="'acme/'"):
                rule(ACME, adapter_id)
    check_store_read(SERVICE, "beta/x")
    for rule, adapter_id in ((check_store_write, "beta/x"), (check_inference, "")):
        with pytest.raises(PermissionDenied, match="service credential"):
            rule(SERVICE, adapter_id)
    for rule in (check_store_read, check_store_write, check_inference):
        rule(ADMIN, "beta/x")
    assert [visible(c, "acme/x") for c in (ACME, ADMIN, SERVICE)] == [True, True, False]
    assert not visible(ACME, "beta/x")

    assert scope_prefix(ACME, "") == "acme/"
    assert scope_prefix(ACME, "ac") == "acme/"
    assert scope_prefix(ACME, "acme/") == "acme/"
    assert scope_prefix(ACME, "acme/sup") == "acme/sup"
    for prefix in ("b", "acmex", "acme-", "beta/"):
        with pytest.raises(PermissionDenied):
            scope_prefix(ACME, prefix)
    assert scope_prefix(SERVICE, "beta/") == "beta/" and scope_prefix(ADMIN, "") == ""


def test_the_token_tool_generates_once_and_keeps_tokens_private(tmp_path, capsys):
    directory = tmp_path / "auth"
    assert tokens_tool.main(["init", str(directory), "--tenant", "demo"]) == 0
    printed = capsys.readouterr().out
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    table = TokenTable(directory / "tokens.json")
    for name, caller in (
        ("admin", ADMIN),
        ("service", SERVICE),
        ("demo", Caller(Role.TENANT, "demo")),
    ):
        path = directory / f"{name}.token"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        token = path.read_text().strip()
        assert table.lookup(token) == caller
        assert token in printed  # shown once
        assert token not in (directory / "tokens.json").read_text()  # only its digest
    assert stat.S_IMODE((directory / "tokens.json").stat().st_mode) == 0o600
    assert tokens_tool.main(["init", str(directory), "--tenant", "demo"]) == 0
    again = capsys.readouterr().out
    assert "already generated" in again and "lft_" not in again
    assert tokens_tool.main(["init", str(tmp_path / "x"), "--tenant", "Bad/Name"]) == 2

    assert tokens_tool.main(["add", str(directory / "tokens.json"), "--role", "tenant",
                             "--tenant", "acme"]) == 0  # fmt: skip
    added = capsys.readouterr().out.strip()
    assert TokenTable(directory / "tokens.json").lookup(added) == ACME
    assert tokens_tool.main(["add", str(directory / "tokens.json"), "--role", "admin",
                             "--tenant", "acme"]) == 2  # fmt: skip


def test_quotas_count_calls_and_tokens_per_tenant():
    now = [100.0]
    tenancy = Tenancy(quotas=Quotas(2, 1, 10.0), clock=lambda: now[0])
    beta = Caller(Role.TENANT, "beta")
    first = tenancy.admit(ACME, 4)
    with pytest.raises(TenantQuotaExceeded, match=r"waiting for their first token.*queued 1"):
        tenancy.admit(ACME, 1)
    first.started()
    second = tenancy.admit(ACME, 4)
    with pytest.raises(TenantQuotaExceeded, match=r"tenant 'acme' has 2 .*in-flight 2"):
        tenancy.admit(ACME, 1)
    tenancy.admit(beta, 1).close(1)  # another tenant's limits are its own
    for _ in range(20):
        tenancy.admit(ADMIN, 1000)  # admins have none
    second.close(0)  # never ran: nothing charged
    first.close(12)  # used more than charged: the bucket goes below zero
    first.close(12)  # idempotent
    # Bucket: 10 tokens at most, 10 a second; 10 - 12 = -2 left.
    with pytest.raises(TenantQuotaExceeded, match=r"over its limit of 10 tokens per second"):
        tenancy.admit(ACME, 1)
    now[0] += 0.1  # -1
    with pytest.raises(TenantQuotaExceeded, match=r"retry in 0\.1 s"):
        tenancy.admit(ACME, 1)
    now[0] += 0.2  # +1
    third = tenancy.admit(ACME, 5)  # 1 - 5 = -4
    third.close(5)
    with pytest.raises(TenantQuotaExceeded):
        tenancy.admit(ACME, 1)
    now[0] += 60  # refills to one second's worth, no more
    for _ in range(2):
        tenancy.admit(ACME, 5).close(5)
    with pytest.raises(TenantQuotaExceeded, match="tokens per second"):
        tenancy.admit(ACME, 1)


def test_a_tenants_pins_are_bounded_by_its_bytes():
    tenancy = Tenancy(quotas=Quotas(max_pinned_bytes=3 << 20))
    tenancy.check_pin(ACME, "acme/a version 1", 2 << 20, 1 << 20)  # 3 MiB: at the limit
    with pytest.raises(TenantQuotaExceeded) as refused:
        tenancy.check_pin(ACME, "acme/b version 2", 1 << 20, 2621440)
    assert str(refused.value) == (
        "tenant 'acme' has 2.50 MiB of adapters pinned; pinning acme/b version 2 (1.00 MiB) "
        "would pass its limit of 3.00 MiB (--tenant-max-pinned-mb); unload one, or load this "
        "one without pin"
    )
    tenancy.check_pin(ADMIN, "acme/b version 2", 100 << 20, 100 << 20)  # admins have none
    Tenancy(quotas=Quotas()).check_pin(ACME, "acme/b version 2", 100 << 20, 100 << 20)


def test_loopback_hosts():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.5.0.1", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "10.0.0.1", "::", "example.com"))


def test_tenancy_flags_are_checked_naming_the_flag(tmp_path, capsys):
    from services.inference.config import ServiceConfig
    from services.inference.errors import status_for
    from services.inference.server import engine_config
    from store.config import StoreConfig

    pem = tmp_path / "x.pem"
    pem.write_text("-")
    f = str(pem)
    for argv, fragment in (
        (["--tls-cert", f], "--tls-cert and --tls-key go together"),
        (["--tls-client-ca", f], "--tls-client-ca needs --tls-cert"),
        (["--auth-tokens", str(tmp_path / "none.json")], "--auth-tokens"),
        (["--adapter-store-cert", f, "--adapter-store-key", f], "needs --adapter-store-ca"),
        (["--adapter-store-ca", f, "--adapter-store-key", f], "--adapter-store-cert and"),
        (["--tenant-max-in-flight", "0"], "--tenant-max-in-flight must be positive"),
        (["--tenant-tokens-per-second", "-1"], "--tenant-tokens-per-second must be positive"),
        (["--scheduling", "lottery"], "--scheduling"),
    ):
        with pytest.raises(SystemExit):
            ServiceConfig.from_args(["--model", "m", *argv], environ={})
        assert fragment in capsys.readouterr().err, argv
    for argv, fragment in (
        (["--tls-key", f], "--tls-cert and --tls-key go together"),
        (["--tls-client-ca", f], "--tls-client-ca needs"),
        (["--auth-tokens", str(tmp_path / "none.json")], "--auth-tokens"),
    ):
        with pytest.raises(ValueError, match=fragment):
            StoreConfig.from_args(argv, environ={})
    cfg = ServiceConfig.from_args(
        ["--model", "m", "--scheduling", "fcfs"],
        environ={"LORAFLEET_INFERENCE_TENANT_MAX_QUEUED": "3"},
    )
    assert cfg.tenant_max_queued == 3 and engine_config(cfg).scheduling == "fcfs"
    assert status_for(Unauthenticated("x")).code.name == "UNAUTHENTICATED"
    assert status_for(PermissionDenied("x")).code.name == "PERMISSION_DENIED"
    assert status_for(TenantQuotaExceeded("x")).code.name == "RESOURCE_EXHAUSTED"


def test_a_server_beyond_loopback_without_tokens_or_tls_warns(caplog):
    from services.tls import warn_if_exposed

    texts = {"anyone_may": "do X", "in_clear": "Y"}
    warn_if_exposed("the store", "127.0.0.1", authenticated=False, tls=False, **texts)
    assert caplog.text == ""
    warn_if_exposed("the store", "0.0.0.0", authenticated=True, tls=True, **texts)
    assert caplog.text == ""
    warn_if_exposed("the store", "0.0.0.0", authenticated=False, tls=False, **texts)
    assert "without authentication: anyone who reaches it may do X" in caplog.text
    assert "--auth-tokens" in caplog.text
    assert "without TLS: tokens and Y cross the network in clear" in caplog.text
