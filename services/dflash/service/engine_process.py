"""The verifier's engine core in a process of its own: its forward shares a GIL with nothing that relays.

In the verifier replica, the threads that turn rounds into gRPC messages (Serve's event loops, grpc's
writes, the store's calls) want the GIL between the torch operators of every step; the engine thread
gave it up at each operator and slept a quarter of its time waiting to win it back (docs/service.md,
"Measured"). vLLM V1 splits its EngineCore from the API server for the same reason (`EngineCoreProc`).
Here the replica keeps everything that talks to clients, and a child process runs the engine:

  replica (EngineProcess)                      child (`python -m dflash.service.engine_process`)
  Verifier: sessions, relays, spans    <--->   SpeculativeEngine, its step loop and its journal

The child owns a connection of its own to the session store, so a step's rounds are stored before they
are sent back, exactly as in process: what reaches the replica has been made durable, and fencing (a
resume that took the session over) is decided where the rounds are written. Messages, pickled over one
socket pair (multiprocessing.connection), at most one a step each way for all sessions:

  replica -> child  ("submit", request_id, fields)   ("cancel", request_id)   ("stop",)
  child -> replica  ("ready", facts) or ("failed", text)   ("submitted", request_id, error or None)
                    ("out", [(request_id, rounds, finish_reason, ended, error), ...])   once a step
                    ("step", report)   ("sessions", running, waiting)   for metrics and spans

The child exits when its socket closes: its replica stopped it, or died, however that happened (the
kernel closes a dead process's sockets; PR_SET_PDEATHSIG would not do, as it fires when the thread that
started the child ends). When the child dies, every open stream fails with EngineProcessError and the replica's
health check fails, so Serve replaces the replica; the sessions stay resumable in the store.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from ..errors import DFlashError
from ..generation import Generation, RoundOutput, wake
from ..intake import RequestLimits, new_generation
from ..params import SamplingParams
from ..scheduler import SchedulerConfig

if TYPE_CHECKING:
    from ..engine import StepReport

log = logging.getLogger("dflash.service")

START_TIMEOUT_S = 900.0  # loading a large target from a slow disk; the child says at once if it fails
SUBMIT_TIMEOUT_S = 60.0


class EngineProcessError(DFlashError):
    """The engine process is gone (it crashed or was killed): this replica can no longer decode."""


@dataclass(frozen=True)
class EngineFacts:
    """What the replica needs of the engine to check requests the same way (sent once, at start)."""

    limits: RequestLimits
    eos_token_ids: frozenset[int]
    config: SchedulerConfig
    tokenizer: bytes  # pickled (None pickled when the target has none)


@dataclass(frozen=True)
class RemoteStep:
    """A step's report as sent: StepReport's fields, each round as (request_id, RoundStats)."""

    start_ns: int
    end_ns: int
    draft_ms: float
    verify_ms: float
    num_tokens: int
    rounds: list[tuple[str, object]]
    verify_lengths: list[int]
    prefill_tokens: int
    num_running: int
    num_waiting: int


class EngineProcess:
    """The replica's side: what the Verifier uses of a SpeculativeEngine (start, submit, cancel, encode,
    stream_batches, start_loop; streams woken through their listener once a step), with the engine in a
    child process. `observer` (StepTelemetry) gets every step's report here, in the replica."""

    def __init__(self, config: dict, observer: object | None = None, start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.observer = observer
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        # The child imports this package the way this process did (an editable install, or a PYTHONPATH).
        env["PYTHONPATH"] = os.pathsep.join(p for p in [os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__)))), env.get("PYTHONPATH", "")] if p)
        self._proc = subprocess.Popen([sys.executable, "-m", "dflash.service.engine_process", str(theirs.fileno())],
                                      pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        self._conn = Connection(ours.detach())
        self._send_lock = threading.Lock()
        self._gens: dict[str, Generation] = {}
        self._acks: dict[str, Future] = {}
        self._lock = threading.Lock()  # _gens, _acks and _dead, between the reader and the streams' threads
        self._dead: EngineProcessError | None = None
        self.num_running = self.num_waiting = 0
        self._send(("config", config))
        if not self._conn.poll(start_timeout_s):
            self.close()
            raise EngineProcessError(f"the engine process did not start within {start_timeout_s:.0f} s")
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            code = self._proc.wait()
            raise EngineProcessError(f"the engine process exited while starting (exit code {code}); "
                                     "its log has the reason") from None
        if kind != "ready":
            self.close()
            raise EngineProcessError(f"the engine process could not start: {payload}")
        facts: EngineFacts = payload
        self.limits, self.eos_token_ids, self.config = facts.limits, facts.eos_token_ids, facts.config
        self.tokenizer = pickle.loads(facts.tokenizer)
        self._reader = threading.Thread(target=self._read, daemon=True, name="dflash-engine-process-reader")
        self._reader.start()

    # -- what the Verifier calls ------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._dead is None

    @property
    def pid(self) -> int:
        return self._proc.pid

    def start(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
              committed_ids: list[int] | None = None, seed: int | None = None,
              stream_interval_ms: float | None = None) -> Generation:
        """Checked here as the engine checks it (the same limits and tokenizer): errors name the field."""
        return new_generation(self.limits, prompt_ids, params, tokenizer=self.tokenizer,
                              eos_token_ids=self.eos_token_ids, request_id=request_id, committed_ids=committed_ids,
                              seed=seed, stream_interval_ms=stream_interval_ms)

    def submit(self, gen: Generation) -> None:
        """Queue it in the child's engine; raises what the engine's submit raised there (QueueFullError)."""
        ack: Future = Future()
        with self._lock:
            if self._dead is not None:
                raise self._dead
            if gen.request_id in self._gens:
                raise DFlashError(f"request {gen.request_id} is already running")
            self._gens[gen.request_id] = gen
            self._acks[gen.request_id] = ack
        interval = None if gen.stream_interval_s is None else gen.stream_interval_s * 1000
        self._send(("submit", gen.request_id, {
            "prompt_ids": gen.prompt_ids, "params": gen.params, "committed_ids": gen.output_ids or None,
            "seed": gen.seed, "stream_interval_ms": interval, "session_id": gen.session_id, "owner": gen.owner}))
        error = ack.result(SUBMIT_TIMEOUT_S)
        if error is not None:
            with self._lock:
                self._gens.pop(gen.request_id, None)
            raise error

    def cancel(self, gen: Generation) -> None:
        """Stop a request: its stream ends now; the child frees its caches after the step in progress."""
        if not gen.finished:
            gen.cancelled = True
        gen.wakeup.set()
        with self._lock:
            known = self._gens.pop(gen.request_id, None) is gen
        if known and self._dead is None:
            try:
                self._send(("cancel", gen.request_id))
            except OSError:
                pass  # the child is gone: the reader fails what is left

    def start_loop(self) -> None:
        """The child's loop always runs."""

    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise DFlashError("this engine has no tokenizer; pass token ids")
        return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]

    def stream_batches(self, gen: Generation) -> Iterator[list[RoundOutput]]:
        """As SpeculativeEngine.stream_batches with its loop running: every round ready when woken."""
        try:
            while True:
                if not gen.outbox and not gen.settled:
                    gen.wakeup.wait()
                    gen.wakeup.clear()
                rounds = gen.take_ready()
                if rounds:
                    yield rounds
                if rounds is not None and (not rounds or rounds[-1].finish_reason is not None):
                    return
        finally:
            if not gen.finished:
                self.cancel(gen)

    def close(self) -> None:
        """Stop the child (it also stops by itself when this process goes)."""
        try:
            self._send(("stop",))
        except OSError:
            pass
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._conn.close()

    # -- the reader -------------------------------------------------------------------------------

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                self._died()
                return
            try:
                self._handle(message)
            except Exception:  # noqa: BLE001 - a bug here must not stop every stream's output
                log.exception("engine process: handling %s failed", message[0])

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "out":
            self._deliver(message[1])
        elif kind == "submitted":
            with self._lock:
                ack = self._acks.pop(message[1], None)
            if ack is not None:
                ack.set_result(message[2])
        elif kind == "step":
            self._on_step(message[1])
        elif kind == "sessions":
            self.num_running, self.num_waiting = message[1], message[2]
            if self.observer is not None:
                self.observer.on_sessions(message[1], message[2])

    def _deliver(self, outputs: list) -> None:
        woken: list[Generation] = []
        with self._lock:
            for request_id, rounds, finish_reason, ended, error in outputs:
                gen = self._gens.get(request_id)
                if gen is None:
                    continue  # cancelled here meanwhile
                gen.outbox.extend(rounds)
                if finish_reason is not None:
                    gen.finish_reason = finish_reason
                if error is not None:
                    gen.error = error
                if ended:
                    gen.ended = True
                    del self._gens[request_id]
                woken.append(gen)
        wake(woken)

    def _on_step(self, step: RemoteStep) -> None:
        if self.observer is None:
            return
        from ..engine import StepReport

        with self._lock:
            rounds = [(self._gens[r], RoundOutput([], "", stats, self._gens[r].stats))
                      for r, stats in step.rounds if r in self._gens]
        self.observer.on_remote_step(StepReport(step.start_ns, step.end_ns, step.draft_ms, step.verify_ms,
                                                step.num_tokens, rounds, step.verify_lengths, step.prefill_tokens,
                                                step.num_running, step.num_waiting))

    def _died(self) -> None:
        try:
            code = self._proc.wait(1)
        except subprocess.TimeoutExpired:
            code = None
        error = EngineProcessError(
            f"server: the engine process exited (exit code {code}); this replica is being replaced, and a stream "
            "that had begun resumes with session_id and tokens_received to get the rest")
        if code is None or code:
            log.error("the engine process (pid %d) is gone, exit code %s", self._proc.pid, code)
        with self._lock:
            self._dead = error
            gens, self._gens = list(self._gens.values()), {}
            acks, self._acks = list(self._acks.values()), {}
        for ack in acks:
            ack.set_result(error)
        for gen in gens:
            gen.error = gen.error or error
            gen.ended = True
        wake(gens)


# -- the child ------------------------------------------------------------------------------------


class _Channel:
    """The child's end: sends from the engine's loop, its delivery thread and the command reader."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()

    def send(self, message: tuple) -> None:
        try:
            with self.lock:
                self.conn.send(message)
        except OSError:
            os._exit(0)  # the replica is gone: so is everything this process was doing for it


class _Relay:
    """The child's OutputListener and StepObserver: each step's woken streams and report, sent back."""

    def __init__(self, channel: _Channel) -> None:
        self.channel = channel
        self.gens: dict[str, Generation] = {}
        self.lock = threading.Lock()

    def publish(self, gens: list[Generation]) -> None:
        outputs = []
        for gen in gens:
            rounds = []
            while gen.outbox:
                rounds.append(gen.outbox.popleft())
            error = _portable(gen.error) if gen.ended and gen.error is not None else None
            outputs.append((gen.request_id, rounds, gen.finish_reason, gen.ended, error))
            if gen.ended:
                with self.lock:
                    self.gens.pop(gen.request_id, None)
        if outputs:
            self.channel.send(("out", outputs))

    def step_scope(self) -> AbstractContextManager:
        return nullcontext()  # the step's span is made in the replica, from the report

    def on_step(self, report: StepReport) -> None:
        rounds = [(gen.request_id, out.stats) for gen, out in report.rounds]
        self.channel.send(("step", RemoteStep(report.start_ns, report.end_ns, report.draft_ms, report.verify_ms,
                                              report.num_tokens, rounds, list(report.verify_lengths),
                                              report.prefill_tokens, report.num_running, report.num_waiting)))

    def on_sessions(self, num_running: int, num_waiting: int) -> None:
        self.channel.send(("sessions", num_running, num_waiting))


def _portable(error: BaseException) -> BaseException:
    """`error` if it survives pickling, else a DFlashError with its text (the replica reads only that)."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any exception type may end a step
        return DFlashError(str(error))


def _serve(conn: Connection) -> None:
    from .config import ServiceConfig
    from .parts import build_verifier_engine, set_threads
    from .session_store import open_store

    channel = _Channel(conn)
    _, config = conn.recv()
    try:
        cfg = ServiceConfig.for_replica(config)
        set_threads(cfg)
        store = open_store(cfg.redis.url, cfg.redis.ttl_s, cfg.redis.key_prefix, cfg.redis.socket_timeout_s)
        relay = _Relay(channel)
        engine = build_verifier_engine(cfg, store, None, observer=relay)
        engine.start_loop()
    except Exception as exc:  # noqa: BLE001 - the replica shows why it could not start
        log.exception("engine process: start failed")
        channel.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    channel.send(("ready", EngineFacts(engine.limits, engine.eos_token_ids, engine.config,
                                       pickle.dumps(engine.tokenizer))))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            os._exit(0)
        if message[0] == "stop":
            os._exit(0)
        if message[0] == "submit":
            _, request_id, fields = message
            error = None
            try:
                gen = engine.start(fields["prompt_ids"], fields["params"], request_id, fields["committed_ids"],
                                   fields["seed"], fields["stream_interval_ms"])
                gen.session_id, gen.owner, gen.listener = fields["session_id"], fields["owner"], relay
                with relay.lock:
                    relay.gens[request_id] = gen
                engine.submit(gen)
            except DFlashError as exc:
                with relay.lock:
                    relay.gens.pop(request_id, None)
                error = _portable(exc)
            channel.send(("submitted", request_id, error))
        elif message[0] == "cancel":
            with relay.lock:
                gen = relay.gens.pop(message[1], None)
            if gen is not None:
                engine.cancel(gen)


def main() -> None:
    """The child: argv[1] is its end of the socket pair."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    conn = Connection(int(sys.argv[1]))
    _serve(conn)
    os._exit(0)


if __name__ == "__main__":  # run as a module: its classes must pickle under their package name
    from dflash.service import engine_process

    engine_process.main()
