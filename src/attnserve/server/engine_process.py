"""The engine process: the scheduler and the model, stepped on this process's main thread.

The HTTP process spawns it (`EngineProcess` in engine_client.py) and keeps one
end of a pipe open for as long as it lives. Here the engine is built, then the
pipe carries one message back: ("ready", facts the HTTP side needs) or
("failed", the exception that stopped the start-up). After that the pipe only
tells of the parent's death (EOF), even by SIGKILL: the loop then ends on its
own, and a step that does not return within PARENT_GONE_EXIT_S ends the process
anyway, so no engine outlives its server.

Requests, aborts and state queries come over ZeroMQ as pickled tuples; every
loop iteration sends what it produced (acceptances, token deltas, state
replies) as one pickled list. Pickle carries whole dataclasses (TokenDelta,
SamplingParams), so a field added to them travels without changes here; both
ends are the same program on one machine, talking over IPC sockets in a
private directory.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import pickle
import signal
import sys
import threading
import time
from functools import partial

import zmq

from attnserve.distributed.launch import failure_reporters
from attnserve.engine.config import EngineConfig
from attnserve.engine.engine import Engine
from attnserve.engine.loop import EngineLoop

log = logging.getLogger("attnserve.engine")

PARENT_CHECK_MS = 200  # while idle, how often the loop looks whether the HTTP process is gone
PARENT_GONE_EXIT_S = 10.0  # how long a step may keep a parentless engine process alive
EXIT_GRACE_S = 20.0  # how long the process may take to end once its loop has (else: stacks on stderr, exit 1)


def to_wire(obj) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def from_wire(data: bytes):
    return pickle.loads(data)


def portable_error(exc: BaseException) -> Exception:
    """An exception that unpickles on the other side: ValueError (bad input) stays one, the rest become a
    RuntimeError with the same message."""
    kind = ValueError if isinstance(exc, ValueError) else RuntimeError
    return kind(str(exc) or repr(exc))


def engine_state(engine: Engine) -> dict:
    """What /server_info and /metrics read: requests and KV pages now, plus the engine's counters."""
    return {**engine.state(), "stats": engine.stats()}


class _RemoteHandle:
    """The engine side of one request: what EngineLoop delivers to it goes into the next outgoing message."""

    def __init__(self, rid: int, outbox: list):
        self.rid = rid
        self._outbox = outbox

    def deliver(self, item) -> None:
        if isinstance(item, BaseException):
            item = portable_error(item)
        self._outbox.append(("item", self.rid, item))


class ProcessLoop(EngineLoop):
    """EngineLoop run on this process's main thread, its commands read from the HTTP process's socket."""

    def __init__(self, engine: Engine, commands: zmq.Socket, outputs: zmq.Socket, parent_gone: threading.Event):
        super().__init__(engine)
        self._in, self._out = commands, outputs
        self._outbox: list = []
        self._parent_gone = parent_gone

    def run(self) -> None:
        self._run()
        if self.error is not None:
            self._outbox.append(("failed", repr(self.error)))
        self.flush()

    def flush(self) -> None:
        if self._outbox:
            self._out.send(to_wire(self._outbox), copy=False)
            self._outbox.clear()  # in place: the handles hold this list

    def _take_commands(self, block: bool) -> bool:
        """Send what the last step produced, then read the socket (waiting for a message when idle) and apply
        its commands; False once asked to shut down or the HTTP process is gone."""
        self.flush()
        while not self._parent_gone.is_set():
            if not self._in.poll(PARENT_CHECK_MS if block else 0):
                if block:
                    continue
                return True
            while True:
                try:
                    cmd = from_wire(self._in.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                self._translate(cmd)
            return super()._take_commands(block=False)
        return False

    def _translate(self, cmd: tuple) -> None:
        """A wire command as the base loop's command; a state query is answered at once (this is the loop's
        thread, between steps)."""
        kind = cmd[0]
        if kind == "add":
            rid, prompt_ids, params, speculative = cmd[1:]
            handle = _RemoteHandle(rid, self._outbox)
            try:
                req = self.engine.make_request(prompt_ids, params, rid=rid, speculative=speculative)
            except ValueError as exc:  # bad input goes back to its sender
                handle.deliver(exc)
                handle.deliver(None)
                return
            self._commands.put(("add", handle, req))
        elif kind == "state":
            self._outbox.append(("state", cmd[1], engine_state(self.engine)))
        elif kind in ("abort", "stop", "shutdown"):
            self._commands.put(cmd)
        else:
            log.warning("engine process: unknown command %r", kind)

    def _add(self, handle, req) -> None:
        super()._add(handle, req)
        if handle.rid in self._handles:
            self._outbox.append(("accepted", handle.rid))


def _watch_parent(conn, parent_gone: threading.Event) -> None:
    """Blocks on the pipe to the HTTP process; its EOF means that process is gone."""
    try:
        while True:
            conn.recv()
    except (EOFError, OSError):
        pass
    parent_gone.set()
    time.sleep(PARENT_GONE_EXIT_S)
    log.error("the HTTP process is gone and the engine did not stop within %.0f s: exiting", PARENT_GONE_EXIT_S)
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


def _report_failure(address: str, message: str) -> None:
    """Tell the HTTP process why the engine process is about to end, from the thread that saw it: a context
    and socket of its own (ZeroMQ sockets are not shared between threads), terminated before returning so the
    message is out before the process exits."""
    context = zmq.Context()
    sock = context.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(address)
    sock.send(to_wire([("failed", message)]))
    sock.close()
    context.term()  # waits (up to the linger) until the message has left


def run_engine_process(config: EngineConfig, addresses: tuple[str, str], conn, setup=None) -> None:
    """The engine process's entry point. `addresses`: (commands, outputs) ZeroMQ endpoints the HTTP process
    bound; `conn`: this end of the pipe; `setup(engine)`: run once the engine is built (tests inject faults)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the HTTP process stops us
    parent_gone = threading.Event()
    threading.Thread(target=_watch_parent, args=(conn, parent_gone), name="attnserve-parent-watch",
                     daemon=True).start()  # from the start: a parent killed during the model load counts too
    try:
        from attnserve.engine.llm import LLM

        engine = LLM(config=config).engine
        if setup is not None:
            setup(engine)
        facts = ready_facts(engine)
    except BaseException as exc:  # the HTTP process reports it and exits
        if not isinstance(exc, (ValueError, FileNotFoundError, ImportError)):  # not a refusal: keep the traceback
            log.error("the engine failed to start", exc_info=exc)
        try:
            conn.send(("failed", exc))
        except Exception:  # noqa: BLE001 - an exception that does not pickle
            conn.send(("failed", RuntimeError(repr(exc))))
        sys.exit(1)
    context = zmq.Context()
    failure_reporters.append(partial(_report_failure, addresses[1]))
    commands, outputs = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    for sock, address in ((commands, addresses[0]), (outputs, addresses[1])):
        sock.setsockopt(zmq.LINGER, 2000)  # what is queued at exit still goes out, unless nobody listens
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.connect(address)
    conn.send(("ready", facts))
    loop = ProcessLoop(engine, commands, outputs, parent_gone)
    try:
        loop.run()
    finally:
        # the loop has ended, so must the process: a clean-up or exit handler that hangs prints every
        # thread's stack and the process exits 1 anyway (the HTTP side then reports the exit code)
        faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True)
        engine.close()
        commands.close()
        outputs.close()
        context.term()
    sys.exit(0 if loop.error is None else 1)
