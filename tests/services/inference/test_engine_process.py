"""The engine in its own process (engine_process.py, engine_client.py): the service's handle
behaves as the in-process engine does, never frees an adapter's bytes before the engine is done
with them, and a dead engine process ends every stream (test_service_lifecycle.py: and stops
the service)."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.inference.arena import HostArena
from services.inference.engine.adapter_manager import AdapterState
from services.inference.engine.api import AdapterKey, GenerationOutput, GenerationRequest
from services.inference.engine.config import EngineConfig
from services.inference.engine.engine import Engine
from services.inference.engine.errors import (
    DuplicateRequest,
    EngineError,
    EngineStopped,
    InvalidRequest,
    UnknownAdapter,
)
from services.inference.engine.sampling_params import SamplingParams
from services.inference.engine_client import RemoteEngine

A, B, C = (AdapterKey(n, 1) for n in ("a", "b", "c"))
THREE = SamplingParams(max_new_tokens=3)


def _config(svc_models) -> EngineConfig:
    return EngineConfig(model_dir=svc_models.model, device="cpu", max_loras=2, num_pages=256)


def _in_arena(arena: HostArena, path) -> tuple[bytes, object]:
    """An adapter's config and its weights copied into a block of the arena."""
    body = (path / "adapter_model.safetensors").read_bytes()
    block = arena.alloc(len(body))
    arena.view(block)[:] = body
    return (path / "adapter_config.json").read_bytes(), arena.tensor(block)


async def _tokens(engine, request: GenerationRequest) -> tuple[int, ...]:
    return tuple([t async for out in engine.generate(request) for t in out.token_ids])


async def _scenario(engine, files) -> list:
    """The adapter API as the registry and servicer drive it; returns what a caller sees."""
    seen = []
    for key, name in ((A, "a"), (B, "b"), (C, "c")):
        engine.add_adapter(key, *files[name])
    seen.append(engine.adapter_status(A))
    await engine.load_adapter(A, pin=True)
    seen.append((engine.adapter_status(A), engine.adapter_in_pool(A)))
    for key in (B, C, B, C):  # two index rows: b and c take turns; the pinned a stays
        await engine.load_adapter(key)
        seen.append((engine.adapter_in_pool(A), engine.adapter_in_pool(key)))
    engine.pin_adapter(A, False)
    await engine.load_adapter(B)
    await engine.load_adapter(C)  # now a, the least recently used idle one, goes
    seen.append(engine.adapter_status(A))
    seen.append(len(engine.adapter_copy_seconds()))
    engine.remove_adapter(C)
    seen.append(engine.adapter_status(C))
    engine.add_adapter(C, *files["c"])  # back before its pages are freed
    for key in (None, A, B, C):
        seen.append(await _tokens(engine, GenerationRequest(f"r-{key}", "hi", None, key, THREE)))
    with pytest.raises(UnknownAdapter):
        await engine.load_adapter(AdapterKey("missing", 1))
    with pytest.raises(UnknownAdapter):
        await _tokens(engine, GenerationRequest("u", "hi", adapter=AdapterKey("missing", 1)))
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        await _tokens(engine, GenerationRequest("v", prompt_token_ids=[1, 10**6]))
    return seen


async def test_remote_engine_answers_as_the_engine_in_process(svc_models):
    arena = HostArena(4 << 20, pin=False)
    files = {n: _in_arena(arena, svc_models.adapters[n]) for n in ("a", "b", "c")}
    local = Engine(_config(svc_models))
    await local.start()
    try:
        expected = await _scenario(local, files)
    finally:
        await local.stop()
    remote = RemoteEngine(_config(svc_models), arena)
    await remote.start()
    try:
        assert await _scenario(remote, files) == expected
        assert expected[1] == ((AdapterState.IN_POOL, 0, True), True)
        assert expected[6].state is AdapterState.HOST and expected[8] is None
        await remote.sync_stats()
        stats = remote.stats()
        assert stats.adapter_loads == len(remote.adapter_copy_seconds()) > 0
        with pytest.raises(TypeError, match="host arena"):
            remote.add_adapter(AdapterKey("d", 1), files["a"][0], files["a"][1].clone())
        with pytest.raises(InvalidRequest, match="already loaded"):
            remote.add_adapter(A, *files["a"])
    finally:
        await remote.stop()
    assert not remote.running
    with pytest.raises(EngineStopped):
        await _tokens(remote, GenerationRequest("late", "hi"))


async def _until(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_bytes_stay_in_use_until_the_engine_reports_them_free(svc_models):
    arena = HostArena(4 << 20, pin=False)
    files = {n: _in_arena(arena, svc_models.adapters[n]) for n in ("a", "b")}
    remote = RemoteEngine(_config(svc_models), arena)
    await remote.start()
    try:
        remote.add_adapter(A, *files["a"])
        assert not remote.adapter_releasable(A)  # the engine has not applied the add yet
        await _until(lambda: remote.adapter_releasable(A))
        long = SamplingParams(max_new_tokens=40, ignore_eos=True)
        stream = remote.generate(GenerationRequest("long", "hi", adapter=A, sampling=long))
        first = await anext(stream)  # running: a request uses a's pool copy
        assert first.token_ids and not remote.adapter_releasable(A)
        with pytest.raises(DuplicateRequest):
            await anext(remote.generate(GenerationRequest("long", "hi")))
        rest = [out async for out in stream]
        assert rest[-1].finished
        await _until(lambda: remote.adapter_releasable(A))
        remote.add_adapter(B, *files["b"])
        await _until(lambda: remote.adapter_releasable(B))
        load = asyncio.ensure_future(remote.load_adapter(B))
        await asyncio.sleep(0)  # the command is out; the answer cannot have come back yet
        assert not remote.adapter_releasable(B)
        await load
        assert remote.adapter_in_pool(B)
        remote.remove_adapter(B)
        assert remote.adapter_status(B) is None
        await _until(lambda: remote.adapter_releasable(B))
    finally:
        await remote.stop()


async def test_a_dead_engine_process_ends_every_stream(svc_models):
    exits = []
    remote = RemoteEngine(_config(svc_models), HostArena(1 << 20, pin=False), on_exit=exits.append)
    await remote.start()
    long = SamplingParams(max_new_tokens=200, ignore_eos=True)
    stream = remote.generate(GenerationRequest("r", "hi", sampling=long))
    assert (await anext(stream)).token_ids
    remote._proc.kill()
    with pytest.raises(EngineStopped, match="engine process exited"):
        async for _ in stream:
            pass
    assert not remote.running and len(exits) == 1
    with pytest.raises(EngineStopped):
        await remote.load_adapter(A)
    await remote.stop()
    assert exits == [exits[0]]  # stop() after the death reports nothing more


async def test_an_aborted_id_is_reused_only_after_the_engine_confirms(svc_models):
    """A stream left early aborts at once; its id stays taken until the engine confirms the
    abort, so a retry under the same id never receives the old request's tokens, and no
    request is left running without a reader."""
    arena = HostArena(4 << 20, pin=False)
    remote = RemoteEngine(_config(svc_models), arena)
    await remote.start()
    try:
        long = SamplingParams(max_new_tokens=400, ignore_eos=True)
        stream = remote.generate(GenerationRequest("same", "hi", sampling=long))
        assert (await anext(stream)).token_ids
        await stream.aclose()  # the caller goes away
        assert not remote._outputs.is_open("same")  # closed now, not when collected
        assert remote.request_in_use("same")  # the service names a new call otherwise
        with pytest.raises(DuplicateRequest):
            await anext(remote.generate(GenerationRequest("same", "hi", sampling=THREE)))
        await _until(lambda: not remote._aborting)  # the engine confirmed the abort
        assert not remote.request_in_use("same")
        outs = [o async for o in remote.generate(GenerationRequest("same", "hi", sampling=THREE))]
        assert outs[-1].completion_tokens == 3 and outs[-1].finish_reason is not None
        await remote.sync_stats()  # current, not up to 50 ms old
        assert remote.stats().num_running == 0 and remote.stats().kv_pages == 0
    finally:
        await remote.stop()


async def test_sync_stats_reflect_a_running_request(svc_models):
    arena = HostArena(4 << 20, pin=False)
    config, weights = _in_arena(arena, svc_models.adapters["b"])
    remote = RemoteEngine(_config(svc_models), arena)
    await remote.start()
    try:
        remote.add_adapter(B, config, weights)
        long = SamplingParams(max_new_tokens=400, ignore_eos=True)
        stream = remote.generate(GenerationRequest("r", "hi", adapter=B, sampling=long))
        assert (await anext(stream)).token_ids
        await remote.sync_stats()
        stats = remote.stats()
        assert stats.num_running == 1 and stats.adapter_pages > 0 and stats.adapters_in_pool == 1
        await stream.aclose()
    finally:
        await remote.stop()
    with pytest.raises(EngineStopped):
        await remote.sync_stats()


def test_reports_count_only_commands_applied_in_full(svc_models):
    """Between steps a held adapter command lets later requests pass it, but a report says
    "applied up to n" only once every command up to n is applied: the service reuses an
    adapter's bytes on the strength of that number."""
    from multiprocessing import Pipe

    from services.inference.engine.engine import Phase
    from services.inference.engine_process import ProcessEngine

    ours, theirs = Pipe()
    engine = ProcessEngine(_config(svc_models), theirs)
    a, b = (GenerationRequest(rid, prompt_token_ids=[3, 5], sampling=THREE) for rid in "ab")
    for msg in (("generate", 1, a), ("load", 2, A, False), ("generate", 3, b)):
        engine.post(msg)
    engine._drain(timeout=None, phase=Phase.BETWEEN)  # "load" waits; "b" passes it
    assert [s.request_id for s in engine.core.scheduler.waiting] == ["a", "b"]
    engine.report(final=False)
    kind, report = ours.recv()
    assert kind == "report" and report.applied == 1
    engine._drain(timeout=None, phase=Phase.DURING)
    engine.report(final=False)
    assert ours.recv()[1].applied == 3


def test_held_adapter_commands_keep_the_requests_that_depend_on_them_in_order(svc_models):
    """Between steps an add and a load wait for the next step's GPU time. A request for the
    added adapter, and that request's abort, wait behind the add; a request for the adapter
    being loaded does not wait for the load, nor does a stats query."""
    from multiprocessing import Pipe

    from services.inference.engine.engine import Phase
    from services.inference.engine_process import ProcessEngine

    ours, theirs = Pipe()
    engine = ProcessEngine(_config(svc_models), theirs)
    path = svc_models.adapters["a"]
    body = (path / "adapter_model.safetensors").read_bytes()
    engine.arena = memoryview(body)
    engine.add_adapter(
        B,
        (svc_models.adapters["b"] / "adapter_config.json").read_bytes(),
        (svc_models.adapters["b"] / "adapter_model.safetensors").read_bytes(),
    )
    on_a, on_b = (
        GenerationRequest(f"r{k.adapter_id}", prompt_token_ids=[3, 5], adapter=k, sampling=THREE)
        for k in (A, B)
    )
    config = (path / "adapter_config.json").read_bytes()
    for msg in (
        ("add", 1, A, 0, len(body), config, None),
        ("generate", 2, on_a),
        ("abort", 3, "ra"),
        ("load", 4, B, False),
        ("generate", 5, on_b),
        ("stats", 6),
    ):
        engine.post(msg)
    engine._drain(timeout=None, phase=Phase.BETWEEN)
    assert [s.request_id for s in engine.core.scheduler.waiting] == ["rb"]
    assert engine.core.adapters.status(A) is None and engine._loads == []
    assert engine._stats_wanted == 6  # applied, though the report cannot cover it yet
    engine.report(final=False)
    assert ours.recv()[1].applied == 0  # the add, first, is held
    engine._drain(timeout=None, phase=Phase.DURING)  # add, "ra", load; the abort waits
    assert [s.request_id for s in engine.core.scheduler.waiting] == ["rb", "ra"]
    assert engine.adapter_status(A) is not None and len(engine._loads) == 1
    engine._drain(timeout=None, phase=Phase.BETWEEN)
    assert [s.request_id for s in engine.core.scheduler.waiting] == ["rb"]
    engine.report(final=False)
    report = ours.recv()[1]
    assert report.applied == 6 and report.aborted == ["ra"] and report.stats is not None


def test_every_command_the_service_sends_is_classified():
    """Each message kind of the protocol gets its kind and names once, as it arrives; one the
    engine does not know is held between steps like adapter work (and only logged when
    applied)."""
    from services.inference.engine.engine import CommandKind
    from services.inference.engine_process import _command

    request = GenerationRequest("r", prompt_token_ids=[3], adapter=A)
    expected = {
        ("generate", 1, request): (CommandKind.REQUEST, (A, "r")),
        ("generate", 2, GenerationRequest("s", prompt_token_ids=[3])): (CommandKind.REQUEST,
                                                                         ("s",)),
        ("abort", 3, "r"): (CommandKind.ABORT, ("r",)),
        ("add", 4, A, 0, 8, b"{}", None): (CommandKind.ADAPTER, (A,)),
        ("remove", 5, A): (CommandKind.ADAPTER, (A,)),
        ("load", 6, A, False): (CommandKind.PLACEMENT, (A,)),
        ("pin", 7, A, True): (CommandKind.PLACEMENT, (A,)),
        ("stats", 8): (CommandKind.STATS, ()),
        ("rewind", 9, A): (CommandKind.ADAPTER, ()),
    }  # fmt: skip
    for msg, (kind, names) in expected.items():
        cmd = _command(msg)
        assert (cmd.msg, cmd.kind, cmd.names) == (msg, kind, names), msg[0]


def test_a_stats_command_is_answered_once_a_report_covers_it(svc_models):
    """A "stats" command applied while an abort before it is held is answered by the first
    report that counts it as applied (GetStats waits for exactly that), even if the stats have
    not changed."""
    from multiprocessing import Pipe

    from services.inference.engine.engine import Phase
    from services.inference.engine_process import ProcessEngine

    ours, theirs = Pipe()
    engine = ProcessEngine(_config(svc_models), theirs)
    engine.report(final=True)  # the stats as they are: nothing will change them
    assert ours.recv()[1].stats is not None
    for msg in (("abort", 1, "gone"), ("stats", 2)):
        engine.post(msg)
    engine._drain(timeout=None, phase=Phase.DURING)  # the abort is held, "stats" applied
    engine.report(final=False)
    assert not ours.poll(0.2)  # nothing to say yet: no report covers "stats"
    engine._drain(timeout=None, phase=Phase.BETWEEN)
    engine.report(final=False)
    report = ours.recv()[1]
    assert report.applied == 2 and report.aborted == ["gone"] and report.stats is not None


def test_an_engine_gone_idle_reports_its_stats_at_once(svc_models):
    """Stats ride along at most every 50 ms while busy, but the report of the turn that leaves
    the engine idle carries them: otherwise /metrics would show the last busy numbers until
    the next turn (up to the idle wait). Turns after that keep to the 50 ms pace."""
    import time
    from multiprocessing import Pipe

    from services.inference.engine.engine import Phase
    from services.inference.engine_process import ProcessEngine

    ours, theirs = Pipe()
    engine = ProcessEngine(_config(svc_models), theirs)
    engine.post(("generate", 1, GenerationRequest("a", prompt_token_ids=[3, 5], sampling=THREE)))
    engine._drain(timeout=None, phase=Phase.BETWEEN)
    engine.report(final=False)
    assert ours.recv()[1].stats.num_waiting == 1
    while engine.core.has_work:
        engine.core.step()
    engine._stats_at = time.monotonic()  # stats were just sent: the 50 ms have not passed
    engine.report(final=False)
    assert ours.poll(5), "no report"
    report = ours.recv()[1]
    assert report.stats is not None and report.stats.num_running == report.stats.num_waiting == 0
    # Later idle turns keep to the 50 ms pace: no stats are gathered for them.
    gathered = []
    real = engine.core.stats
    engine.core.stats = lambda: gathered.append(1) or real()
    engine._stats_at = time.monotonic()
    for _ in range(3):
        engine.report(final=False)
    assert gathered == []
    # An adapter added while idle changes the stats at once.
    files = svc_models.adapters["b"]
    engine.add_adapter(
        B,
        (files / "adapter_config.json").read_bytes(),
        (files / "adapter_model.safetensors").read_bytes(),
    )
    engine.report(final=False)
    assert gathered == [1] and ours.recv()[1].stats.adapters_host == 1


def test_a_service_that_stops_reading_does_not_stop_the_step_thread(svc_models):
    """Reports go out on a thread of their own: with the service not reading, reports far
    larger than the socket's buffer leave report() at once (before, the step thread blocked in
    the send until the service read again and the GPU idled meanwhile); once it reads, every
    one arrives, in order, and close_reports() returns after the last."""
    from multiprocessing import Pipe

    from services.inference.engine_process import ProcessEngine

    ours, theirs = Pipe()
    engine = ProcessEngine(_config(svc_models), theirs)
    tokens = tuple(range(4096))  # some 12 KB pickled: 64 reports hold several socket buffers
    start = time.monotonic()
    for i in range(64):
        engine._deliver([GenerationOutput(f"r{i}", tokens, "", None, 2, len(tokens))])
        engine.report(final=False)
    assert time.monotonic() - start < 2.0, "report() waited for the service to read"
    assert [ours.recv()[1].outputs[0][0] for _ in range(64)] == [f"r{i}" for i in range(64)]
    engine.close_reports()
    assert not ours.poll(0.1)


def test_report_sender_bounds_what_it_holds_and_drops_after_the_service_is_gone():
    """At max_pending queued reports put() waits for the socket (a service slower than the
    engine for good holds it back, memory stays bounded); after the service closed its end,
    puts neither block nor raise, and close() returns."""
    import threading
    from multiprocessing import Pipe

    from services.inference.engine_process import ReportSender

    ours, theirs = Pipe()
    sender = ReportSender(theirs, max_pending=2)
    big = ("report", b"x" * (4 << 20))  # blocks the sending thread: nobody reads yet
    done = threading.Event()

    def fill() -> None:
        for _ in range(4):  # one in the send, two queued, the fourth waits
            sender.put(big)
        done.set()

    filler = threading.Thread(target=fill, daemon=True)
    filler.start()
    assert not done.wait(0.5), "put() went past max_pending while nothing was read"
    assert [len(ours.recv()[1]) for _ in range(4)] == [4 << 20] * 4
    assert done.wait(5)
    ours.close()
    for _ in range(8):
        sender.put(big)  # the first fails in the send; the rest are dropped
    sender.close()
    assert sender.gone


class _NeedsTwo(Exception):
    """Pickles (its args), but cannot be rebuilt from them on the other side."""

    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what}: {why}")


def test_errors_that_would_not_reach_the_service_go_as_engine_errors():
    """An error whose class cannot be rebuilt from its args, or that holds what does not
    pickle, goes as an EngineError naming it (sent as it was, it would keep the whole report,
    every request's tokens in it, from the service, or break the service's reader); the
    engine's own errors and plain ones pass unchanged."""
    import pickle
    import threading

    from services.inference.engine_process import portable

    held = RuntimeError("lock held")
    held.lock = threading.Lock()
    for exc in (_NeedsTwo("adapter a", "bad bytes"), held):
        out = portable(exc)
        assert type(out) is EngineError
        assert str(out) == f"{type(exc).__name__}: {exc}"
        assert str(pickle.loads(pickle.dumps(out))) == str(out)
    for exc in (InvalidRequest("prompt too long"), ValueError("temperature < 0")):
        assert portable(exc) is exc


def test_report_sender_drops_a_message_that_does_not_pickle_and_goes_on(caplog):
    """A message that cannot be pickled is logged and dropped, nothing of it written, and the
    next one arrives whole: a dead sending thread would leave the step thread blocked in put()
    once the queue filled."""
    import threading
    from multiprocessing import Pipe

    from services.inference.engine_process import ReportSender

    ours, theirs = Pipe()
    sender = ReportSender(theirs)
    sender.put(("report", threading.Lock()))
    for i in range(4):
        sender.put(("report", i))
    got = []
    for _ in range(4):
        assert ours.poll(5), f"the sender stopped after {got}"
        got.append(ours.recv())
    assert got == [("report", i) for i in range(4)]
    sender.close()
    assert not ours.poll(0.1)
    assert "a 'report' message could not be sent to the service; dropped" in caplog.text
