"""What a client's own mistake costs the logs and what its message says; gauges true when idle.

Client errors (a Rejected) are logged in one line at INFO, or WARNING for overload and outages, with no
traceback, by Ray Serve's own code paths (its proxy's get_grpc_response_status, fed what a replica
raises); our own faults keep theirs. The edge's messages say the limit in force. The running gauge reads
0 once the last session has retired.
"""

import logging
import pickle

import grpc
import pytest
from dflash.api.v1 import generate_pb2
from dflash.params import MAX_SEED, SamplingParams
from dflash.service.config import ServiceConfig
from dflash.service.ingress import ClientErrorLogFilter, Ingress, Rejected, quiet_client_errors
from dflash.service.metrics import ServiceMetrics
from dflash.service.step_telemetry import StepTelemetry
from tiny import engine_for, tiny_drafter, tiny_target


class Records(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def serve_log():
    """What Ray Serve's logger emits (with the filter the ingress module installs on it)."""
    import ray.serve._private.grpc_util  # noqa: F401 (its import sets up the logger's handlers: first)

    logger = logging.getLogger("ray.serve")
    handler = Records()
    logger.addHandler(handler)
    quiet_client_errors()
    yield handler.records
    logger.removeHandler(handler)


def proxy_status(exc):
    """The status Ray's gRPC proxy answers for an exception a replica raised, logged as the proxy logs it:
    inside the except block, the remote error as the proxy receives it (pickled, then a RayTaskError
    that is also an instance of its cause, as ray.get raises it)."""
    from ray.exceptions import RayTaskError
    from ray.serve._private.grpc_util import get_grpc_response_status

    remote = RayTaskError("Generate", "Traceback (most recent call last): ...", pickle.loads(pickle.dumps(exc)))
    try:
        raise remote.as_instanceof_cause()
    except BaseException as received:  # noqa: BLE001 - the proxy's own `except BaseException`
        return get_grpc_response_status(received, None, "request-1")


def user_set_status(cause, code):
    """What the replica raises when a deployment set `code` on its grpc_context and raised `cause`."""
    from ray.serve.exceptions import gRPCStatusError

    try:
        raise cause
    except Exception as e:  # noqa: BLE001
        wrapped = gRPCStatusError(original_exception=e, code=code, details=str(e))
        wrapped.__cause__ = e
        return wrapped


@pytest.mark.parametrize("code, level", [("INVALID_ARGUMENT", logging.INFO), ("UNAUTHENTICATED", logging.INFO),
                                         ("NOT_FOUND", logging.INFO), ("ABORTED", logging.INFO),
                                         ("RESOURCE_EXHAUSTED", logging.WARNING), ("UNAVAILABLE", logging.WARNING)])
def test_a_client_error_is_one_line_without_a_traceback_and_keeps_its_status(serve_log, code, level):
    details = f"max_new_tokens: must be between 1 and 4096, got 0 ({code})"
    status = proxy_status(user_set_status(Rejected(code, details), getattr(grpc.StatusCode, code)))
    assert status.code == getattr(grpc.StatusCode, code) and status.message == details
    [record] = serve_log
    assert record.levelno == level and record.exc_info is None and record.exc_text is None
    line = logging.Formatter().format(record)
    assert "\n" not in line and "Traceback" not in line and f"{code}: {details}" in line


def test_our_own_fault_keeps_its_traceback(serve_log):
    status = proxy_status(user_set_status(RuntimeError("a bug of ours"), grpc.StatusCode.INTERNAL))
    assert status.code == grpc.StatusCode.INTERNAL
    [record] = serve_log
    assert record.levelno == logging.ERROR and record.exc_info is not None
    assert "Traceback" in logging.Formatter().format(record)


def test_the_filter_is_installed_once_and_passes_other_records():
    quiet_client_errors()
    quiet_client_errors()
    assert sum(isinstance(f, ClientErrorLogFilter) for f in logging.getLogger("ray.serve").filters) == 1
    plain = logging.LogRecord("ray.serve", logging.ERROR, __file__, 1, "replica died", (), None)
    assert ClientErrorLogFilter().filter(plain) and plain.levelno == logging.ERROR and plain.msg == "replica died"


# --- the edge's messages -----------------------------------------------------------------------------

def admit(limits=None, **fields):
    config = ServiceConfig.from_dict({"limits": limits or {}})
    return Ingress(config).admit(generate_pb2.GenerateRequest(prompt="def f(x):", **fields), {})


@pytest.mark.parametrize("limit, value", [(None, 0), (None, 4097), (100, 0), (100, 101)])
def test_max_new_tokens_out_of_range_names_the_configured_limit(limit, value):
    """Was: 0 refused with "between 1 and 1048576", the engine's bound, not the server's (4096)."""
    limits = {"max_new_tokens": limit} if limit else None
    with pytest.raises(Rejected) as err:
        admit(limits, max_new_tokens=value)
    assert err.value.code == "INVALID_ARGUMENT"
    assert err.value.message == (f"max_new_tokens: must be between 1 and {limit or 4096} "
                                 f"(this server's limits.max_new_tokens), got {value}")
    assert admit(limits, max_new_tokens=limit or 4096).params["max_new_tokens"] == (limit or 4096)


def test_every_uint64_seed_is_admitted():
    assert admit(seed=MAX_SEED).params["seed"] == MAX_SEED
    assert admit(seed=1 << 63).params["seed"] == 1 << 63


# --- gauges when idle ------------------------------------------------------------------------------------

def gauge(metrics, name):
    return metrics.registry.get_sample_value(name)


def test_running_sessions_reads_zero_once_the_last_session_retires():
    """Was: set before the step's finished sessions retire, and written only while steps run: an idle
    server read 1 until the series disappeared."""
    target = tiny_target("qwen3", max_positions=128)
    engine = engine_for(target, tiny_drafter(target, block_size=4))
    metrics = ServiceMetrics("prometheus")
    engine.observer = StepTelemetry(metrics)
    streams = [engine.generate([3, 4, 5 + i], SamplingParams(max_new_tokens=6 + 3 * i, ignore_eos=True))
               for i in range(2)]
    first = next(streams[0]), next(streams[1])
    assert all(r.stats.index == 0 for r in first)
    assert gauge(metrics, "dflash_running_sessions") == 2
    list(streams[0])  # the first finishes; the second still runs
    assert gauge(metrics, "dflash_running_sessions") == 1
    list(streams[1])
    assert engine.num_running == 0
    assert gauge(metrics, "dflash_running_sessions") == 0 and gauge(metrics, "dflash_queued_sessions") == 0


def test_running_sessions_reads_zero_after_a_cancel_that_no_step_followed():
    """With the step loop running, the last stream cancelled between steps: the loop retires it and the
    gauge reads 0 though no step ran after."""
    import time

    target = tiny_target("qwen3", max_positions=128)
    engine = engine_for(target, tiny_drafter(target, block_size=4))
    metrics = ServiceMetrics("prometheus")
    engine.observer = StepTelemetry(metrics)
    engine.start_loop()
    stream = engine.generate([3, 4, 5], SamplingParams(max_new_tokens=100, ignore_eos=True))
    next(stream)
    stream.close()  # cancels the request
    deadline = time.monotonic() + 10
    while engine.num_running and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert engine.num_running == 0 and gauge(metrics, "dflash_running_sessions") == 0


def test_the_client_summary_says_what_the_policy_did_with_each_round():
    from dflash.commands.client import round_breakdown

    def r(index, draft, committed, arm, reason):
        return generate_pb2.RoundStats(index=index, draft_tokens=draft, committed=committed, policy_arm=arm,
                                       policy_reason=reason)

    rounds = [r(0, 0, 1, "", ""), r(1, 15, 4, "full", "best"), r(2, 15, 2, "full", "best"),
              r(3, 0, 1, "plain", "exploring"), r(4, 0, 1, "plain", "best"), r(5, 0, 1, "plain", "best")]
    assert round_breakdown(rounds) == " (drafted 2 at tau 3.00; 3 plain: measured faster 2, exploring 1)"
    assert round_breakdown(rounds[:3]) == ""  # every decoding round drafted
    assert round_breakdown([rounds[0], rounds[3]]) == ""  # none did: tau says it all
