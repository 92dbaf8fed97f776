"""The engine process: the scheduler and the model, stepped on this process's main thread.

Its owner (the HTTP process, or with --api-workers the server's supervisor;
`EngineProcess.start` in engine_owner.py) spawns it and keeps one end of a pipe
open for as long as it lives. Here the engine is built, then the pipe carries
one message back: ("ready", facts the HTTP side needs) or ("failed", the
exception that stopped the start-up). After that the pipe only tells of the
owner's death (EOF), even by SIGKILL: the loop then ends on its own, and a step
that does not return within PARENT_GONE_EXIT_S ends the process anyway, so no
engine outlives its server.

One ZeroMQ ROUTER socket, bound here, serves every client (each HTTP worker
connects a DEALER under its own identity). Requests, aborts and state queries
come in as the messages of wire.py; every loop iteration sends each client what
it produced for it (acceptances, token deltas, state replies) as one list.
Client request ids are mapped to engine ids, so workers need not agree on
theirs. When a client's process dies, the owner says so ("client_gone") and
its requests are aborted, freeing their KV pages. Last words that cannot go
through the socket (a dead tensor-parallel rank, seen on a watchdog thread) are
written to FAILURE_FILE in the channel's directory, where the owner reads them
once the process has ended.
"""

from __future__ import annotations

import faulthandler
import itertools
import logging
import os
import signal
import sys
import threading
import time
from functools import partial
from pathlib import Path

import zmq

from attnserve.distributed.launch import failure_reporters
from attnserve.engine.config import EngineConfig
from attnserve.engine.engine import Engine
from attnserve.engine.loop import EngineLoop
from attnserve.server.wire import (
    Abort,
    Accepted,
    AddRequest,
    ClientGone,
    EngineFailed,
    RequestItem,
    Shutdown,
    StateQuery,
    StateReply,
    StopRequest,
    from_wire,
    to_wire,
)

log = logging.getLogger("attnserve.engine")

PARENT_CHECK_MS = 200  # while idle, how often the loop looks whether its owner is gone
PARENT_GONE_EXIT_S = 10.0  # how long a step may keep a parentless engine process alive
EXIT_GRACE_S = 20.0  # how long the process may take to end once its loop has (else: stacks on stderr, exit 1)
FAILURE_FILE = "engine-failure.txt"  # in the channel's directory: why the engine process is about to end


def engine_address(channel_dir: str) -> str:
    return f"ipc://{Path(channel_dir, 'engine')}"


def portable_error(exc: BaseException) -> Exception:
    """An exception that unpickles on the other side: ValueError (bad input) stays one, the rest become a
    RuntimeError with the same message."""
    kind = ValueError if isinstance(exc, ValueError) else RuntimeError
    return kind(str(exc) or repr(exc))


def engine_state(engine: Engine) -> dict:
    """What /server_info and /metrics read: requests and KV pages now, plus the engine's counters."""
    return {**engine.state(), "stats": engine.stats()}


class _RemoteHandle:
    """The engine side of one client's request: what EngineLoop delivers goes into that client's next message
    under the client's own request id."""

    def __init__(self, rid: int, client_rid: int, outbox: list):
        self.rid = rid  # the engine's id
        self.client_rid = client_rid
        self._outbox = outbox

    def deliver(self, item) -> None:
        if isinstance(item, BaseException):
            item = portable_error(item)
        self._outbox.append(RequestItem(self.client_rid, item))

    def accepted(self) -> None:
        self._outbox.append(Accepted(self.client_rid))


class ProcessLoop(EngineLoop):
    """EngineLoop run on this process's main thread, its commands read from the clients' socket."""

    def __init__(self, engine: Engine, sock: zmq.Socket, parent_gone: threading.Event):
        super().__init__(engine)
        self._sock = sock
        self._outboxes: dict[bytes, list] = {}  # client identity -> what goes to it next
        self._owners: dict[int, tuple[bytes, int]] = {}  # engine rid -> (client identity, client rid)
        self._engine_rids: dict[tuple[bytes, int], int] = {}  # the reverse
        self._next_rid = itertools.count()
        self._gone: set[bytes] = set()  # clients whose process died: a command of theirs still in flight is dropped
        self._parent_gone = parent_gone

    def run(self, failure_file: Path) -> None:
        self._run()
        if self.error is not None:
            failure_file.write_text(f"the engine failed: {self.error!r}")  # for the owner, once the process ends
            for box in self._outboxes.values():  # every client that has sent something hears it now
                box.append(EngineFailed(repr(self.error)))
        self.flush()

    def flush(self) -> None:
        for identity, box in self._outboxes.items():
            if box:
                self._sock.send_multipart([identity, to_wire(box)], copy=False)
                box.clear()  # in place: the handles hold this list

    def _take_commands(self, block: bool) -> bool:
        """Send what the last step produced, then read the socket (waiting for a message when idle) and apply
        its commands; False once asked to shut down or the owner is gone."""
        self.flush()
        while not self._parent_gone.is_set():
            if not self._sock.poll(PARENT_CHECK_MS if block else 0):
                if block:
                    continue
                return True
            while True:
                try:
                    identity, payload = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._translate(identity, from_wire(payload))
            return super()._take_commands(block=False)
        return False

    def _translate(self, identity: bytes, cmd) -> None:
        """A client's message as the base loop's command; a state query is answered at once (this is the loop's
        thread, between steps)."""
        if identity in self._gone:
            return
        outbox = self._outboxes.setdefault(identity, [])
        match cmd:
            case AddRequest(rid=client_rid, prompt_ids=prompt_ids, params=params, speculative=speculative):
                rid = next(self._next_rid)
                handle = _RemoteHandle(rid, client_rid, outbox)
                try:
                    req = self.engine.make_request(prompt_ids, params, rid=rid, speculative=speculative)
                except ValueError as exc:  # bad input goes back to its sender
                    handle.deliver(exc)
                    handle.deliver(None)
                    return
                self._owners[rid] = (identity, client_rid)
                self._engine_rids[identity, client_rid] = rid
                self._commands.put(("add", handle, req))
            case StateQuery(qid=qid):
                outbox.append(StateReply(qid, engine_state(self.engine)))
            case Abort(rid=client_rid) | StopRequest(rid=client_rid):
                rid = self._engine_rids.get((identity, client_rid))
                if rid is not None:
                    self._commands.put(("abort", rid) if isinstance(cmd, Abort) else ("stop", rid, cmd.stop))
            case ClientGone(identity=gone):  # the owner saw a client's process end
                self._client_gone(gone)
            case Shutdown():
                self._commands.put(("shutdown",))
            case _:
                log.warning("engine process: unknown message %r", cmd)

    def _client_gone(self, identity: bytes) -> None:
        """A client's process is gone: abort its requests (their pages go back) and forget it."""
        rids = [rid for rid, (who, _) in self._owners.items() if who == identity]
        if rids:
            log.warning("a client of the engine disconnected: aborting its %d request(s)", len(rids))
        for rid in rids:
            self._commands.put(("abort", rid))
        self._outboxes.pop(identity, None)
        self._gone.add(identity)

    def _add(self, handle, req) -> None:
        super()._add(handle, req)
        if handle.rid in self._handles:
            handle.accepted()
        else:  # refused: nothing more will come for it
            self._forget(handle.rid)

    def _close(self, rid: int) -> None:
        super()._close(rid)
        self._forget(rid)

    def _forget(self, rid: int) -> None:
        """Drop an ended request's mapping to its client."""
        owner = self._owners.pop(rid, None)
        if owner is not None:
            self._engine_rids.pop(owner, None)


def _watch_parent(conn, parent_gone: threading.Event) -> None:
    """Blocks on the pipe to the owner; its EOF means the owner is gone."""
    try:
        while True:
            conn.recv()
    except (EOFError, OSError):
        pass
    parent_gone.set()
    time.sleep(PARENT_GONE_EXIT_S)
    log.error("the engine process's owner is gone and the engine did not stop within %.0f s: exiting",
              PARENT_GONE_EXIT_S)
    os._exit(1)


def ready_facts(engine: Engine) -> dict:
    """What the HTTP side needs to tokenize, validate and describe requests without the engine."""
    from attnserve.server.info import static_info

    scheduler = engine.scheduler
    return {
        "pid": os.getpid(),
        "tokenizer": engine.tokenizer,
        "chat_template": engine.parts.model.chat_template,
        "max_context_len": engine.max_context_len,
        "pool_tokens": scheduler.allocator.total * scheduler.page_size,  # the most one request can hold
        "info": static_info(engine),
        "state": engine_state(engine),
    }


def _report_failure(path: Path, message: str) -> None:
    """Leave why the engine process is about to end where its owner reads it once the process has ended (the
    thread that saw it cannot use the loop's socket)."""
    path.write_text(message)


def run_engine_process(config: EngineConfig, channel_dir: str, conn, setup=None) -> None:
    """The engine process's entry point. `channel_dir`: the private directory of the socket (and of
    FAILURE_FILE); `conn`: this end of the pipe; `setup(engine)`: run once the engine is built (tests inject
    faults)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: our owner stops us
    parent_gone = threading.Event()
    threading.Thread(target=_watch_parent, args=(conn, parent_gone), name="attnserve-parent-watch",
                     daemon=True).start()  # from the start: a parent killed during the model load counts too
    try:
        from attnserve.engine.llm import LLM

        engine = LLM(config=config).engine
        if setup is not None:
            setup(engine)
        facts = ready_facts(engine)
    except BaseException as exc:  # the owner reports it and exits
        if not isinstance(exc, (ValueError, FileNotFoundError, ImportError)):  # not a refusal: keep the traceback
            log.error("the engine failed to start", exc_info=exc)
        try:
            conn.send(("failed", exc))
        except Exception:  # noqa: BLE001 - an exception that does not pickle
            conn.send(("failed", RuntimeError(repr(exc))))
        sys.exit(1)
    context = zmq.Context()
    failure_file = Path(channel_dir, FAILURE_FILE)
    failure_reporters.append(partial(_report_failure, failure_file))
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 2000)  # what is queued at exit still goes out, unless nobody listens
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(engine_address(channel_dir))  # bound before "ready": clients connect after it
    conn.send(("ready", facts))
    loop = ProcessLoop(engine, sock, parent_gone)
    try:
        loop.run(failure_file)
    finally:
        # the loop has ended, so must the process: a clean-up or exit handler that hangs prints every
        # thread's stack and the process exits 1 anyway (the HTTP side then reports the exit code)
        faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True)
        engine.close()
        sock.close()
        context.term()
    sys.exit(0 if loop.error is None else 1)
