"""The Helm chart (helm/), checked by rendering: no cluster or helm binary exists here.

helm-python-sdk renders the real chart through Helm's own Go SDK (bundled as a shared library), for
the default values and every ci/*-values.yaml. Each rendered object is validated: standard kinds with
kubernetes-validate (strict), the RayService against KubeRay's CRD schema (../shared/schemas), and
its serveConfigV2 against Ray Serve's schema and the service's own config code, which builds the
application's deployment graph without loading any model.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (dev extra) renders the chart")

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "helm"
CRD_SCHEMA = REPO.parent / "shared" / "schemas" / "rayservice-v1.openapi.json"
VARIANTS = ["default"] + sorted(p.name.removesuffix("-values.yaml") for p in (CHART / "ci").glob("*-values.yaml"))
KUBE_VERSIONS = ("1.27.0", "1.37.0")  # the chart's kubeVersion floor and the newest schemas kubernetes-validate has


def variant_values(variant: str) -> dict:
    return {} if variant == "default" else yaml.safe_load((CHART / "ci" / f"{variant}-values.yaml").read_text())


def render(values: dict | None = None, release: str = "dflash", namespace: str = "dflash") -> dict[str, str]:
    """Template path -> rendered text, as `helm template` would print it."""
    with helm.Chart.load(str(CHART)) as chart:
        return chart.render(values or {}, name=release, namespace=namespace, is_install=True)


def objects(rendered: dict[str, str]) -> list[dict]:
    return [doc for path, text in sorted(rendered.items()) if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


@functools.cache
def variant_objects(variant: str) -> tuple:
    return tuple(objects(render(variant_values(variant))))


def one(objs, kind: str, name_suffix: str = "") -> dict:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind} *{name_suffix}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def rayservice(variant: str) -> dict:
    return one(variant_objects(variant), "RayService")


def serve_config(variant: str) -> dict:
    return yaml.safe_load(rayservice(variant)["spec"]["serveConfigV2"])


def groups(variant: str) -> dict[str, dict]:
    """groupName -> group spec; the head group as "head"."""
    cluster = rayservice(variant)["spec"]["rayClusterConfig"]
    return {"head": cluster["headGroupSpec"], **{g["groupName"]: g for g in cluster["workerGroupSpecs"]}}


def pod_specs(obj: dict) -> list[dict]:
    """Every pod spec inside an object (Ray groups, StatefulSet template, bare Pod)."""
    if obj["kind"] == "Pod":
        return [obj["spec"]]
    if obj["kind"] == "StatefulSet":
        return [obj["spec"]["template"]["spec"]]
    if obj["kind"] == "RayService":
        return [g["template"]["spec"] for g in groups_of(obj)]
    return []


def groups_of(rs: dict) -> list[dict]:
    cluster = rs["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]


# --- the chart renders and lints -------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_lint_has_no_warnings(variant):
    report = helm.lint(str(CHART), variant_values(variant), strict=True, namespace="dflash")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


@pytest.mark.parametrize("variant", VARIANTS)
def test_renders_the_expected_objects(variant):
    kinds = sorted(o["kind"] for o in variant_objects(variant))
    internal_redis = variant_values(variant).get("redis", {}).get("mode", "internal") == "internal"
    expected = ["NetworkPolicy", "Pod", "RayService", "Service", "ServiceAccount"]
    if internal_redis:
        expected += ["NetworkPolicy", "Secret", "Service", "StatefulSet"]
    assert kinds == sorted(expected)


# --- every object is valid -------------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_standard_objects_pass_kubernetes_validate_strict(variant):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for obj in variant_objects(variant):
        if obj["apiVersion"] == "ray.io/v1":
            continue
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


def unknown_fields(value, schema: dict, path: str = "") -> list[str]:
    """Fields the API server would prune: KubeRay's CRD schema does not forbid them, so look."""
    if schema.get("x-kubernetes-preserve-unknown-fields") or not isinstance(value, (dict, list)):
        return []
    if isinstance(value, list):
        return [p for i, item in enumerate(value) for p in unknown_fields(item, schema.get("items", {}), f"{path}[{i}]")]
    props, extra = schema.get("properties"), schema.get("additionalProperties")
    out = []
    for key, item in value.items():
        if props is not None and key in props:
            out += unknown_fields(item, props[key], f"{path}.{key}")
        elif isinstance(extra, dict):
            out += unknown_fields(item, extra, f"{path}.{key}")
        elif props is not None:
            out.append(f"{path}.{key}")
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_rayservice_matches_kuberay_schema(variant):
    if not CRD_SCHEMA.is_file():
        pytest.skip(f"KubeRay's RayService schema is not here ({CRD_SCHEMA}): shared/ is not beside the repo")
    spec_schema = crd_spec_schema()
    rs = rayservice(variant)
    crd_validator().validate(rs["spec"])
    assert unknown_fields(rs["spec"], spec_schema, "spec") == []


@functools.cache
def crd_spec_schema() -> dict:
    return json.loads(CRD_SCHEMA.read_text())["properties"]["spec"]


@functools.cache
def crd_validator():
    import jsonschema

    schema = crd_spec_schema()
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    cls.check_schema(schema)
    return cls(schema)


@pytest.mark.parametrize("variant", VARIANTS)
def test_serve_config_passes_ray_serve_schema(variant):
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(serve_config(variant))


# --- the service understands the rendered serveConfigV2 ----------------------------------------------

def build_graph(app: dict):
    """Import the application builder and build its deployment graph; no Ray cluster, no model."""
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.build_app import build_app

    builder = import_attr(app["import_path"])
    return build_app(call_user_app_builder_with_args_if_necessary(builder, app["args"]), name=app["name"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_service_config_builds_the_deployment_graph(variant):
    from dflash.service.config import ServiceConfig

    config = serve_config(variant)
    (app,) = config["applications"]
    service = ServiceConfig.from_dict(app["args"])
    built = build_graph(app)
    deployments = {d.name: d for d in built.deployments}
    expected = {"ingress", "verifier"} | ({"drafter"} if service.mode == "disaggregated" else set())
    assert set(deployments) == expected
    assert built.ingress_deployment_name == "ingress"
    assert config["grpc_options"]["port"] == service.grpc_port

    # Each worker group offers one custom resource; only its own deployment asks for it.
    offered = {name: ray_resources(g) for name, g in groups(variant).items()}
    assert offered["head"] == {}
    for name, dep in deployments.items():
        asked = dep.ray_actor_options.get("resources", {})
        if name == "ingress":
            assert asked == {}, "the ingress runs on the head, which offers no custom resource"
            continue
        (resource,) = asked
        assert offered[name] == {resource: offered[name][resource]}, f"{name} must land on its own group"
        group = groups(variant)[name]
        gpus = float(group["rayStartParams"]["num-gpus"])
        replicas = offered[name][resource] / asked[resource]
        assert dep.ray_actor_options.get("num_gpus", 0) * replicas <= gpus
        auto = dep._deployment_config.autoscaling_config
        assert auto is not None and auto.min_replicas <= auto.max_replicas


@pytest.mark.parametrize("variant", VARIANTS)
def test_autoscaling_configs_are_rays_own(variant):
    """Serve ignores autoscaling_config keys it does not know, so each rendered one holds only fields of
    Ray's AutoscalingConfig; the drafter's names the draft-load policy, which its kwargs build."""
    from ray.serve.config import AutoscalingConfig

    from dflash.service.autoscaling import POLICY_FUNCTION

    args = serve_config(variant)["applications"][0]["args"]
    for name in ("ingress", "verifier", "drafter"):
        raw = args[name]["autoscaling_config"]
        assert set(raw) <= set(AutoscalingConfig.model_fields), f"{name}: {sorted(raw)}"
        auto = AutoscalingConfig.model_validate(raw)
        if name != "drafter":
            assert auto.policy.is_default_policy_function()
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["drafter"]["autoscaling"]
    wanted = {**defaults, **variant_values(variant).get("drafter", {}).get("autoscaling", {})}
    assert auto.policy.policy_function == POLICY_FUNCTION
    policy = auto.policy.get_policy()(**auto.policy.policy_kwargs)
    assert policy.target_inflight_drafts == wanted["targetInflightDrafts"]
    assert (auto.upscale_delay_s, auto.downscale_delay_s) == (wanted["upscaleDelaySeconds"], wanted["downscaleDelaySeconds"])


def test_colocated_mode_has_no_drafter_group():
    from dflash.service.config import ServiceConfig

    objs = objects(render({"mode": "colocated"}))
    rs = one(objs, "RayService")
    assert [g["groupName"] for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]] == ["verifier"]
    (app,) = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]
    assert ServiceConfig.from_dict(app["args"]).mode == "colocated"
    assert {d.name for d in build_graph(app).deployments} == {"ingress", "verifier"}


def ray_resources(group: dict) -> dict:
    raw = group["rayStartParams"].get("resources")
    return json.loads(json.loads(raw)) if raw else {}  # KubeRay wants the JSON quoted once more


def test_a_value_the_service_does_not_understand_fails():
    from dflash.service.config import ConfigError

    (app,) = serve_config("default")["applications"]
    for bad in ({**app["args"], "not_a_setting": 1},
                {**app["args"], "redis": {**app["args"]["redis"], "ttl": 5}},
                {**app["args"], "limits": {**app["args"]["limits"], "max_new_tokens": "many"}}):
        with pytest.raises(ConfigError):
            build_graph({**app, "args": bad})


def test_grpc_servicers_are_the_services():
    from dflash.service.app import SERVICERS
    from ray._common.utils import import_attr

    functions = serve_config("default")["grpc_options"]["grpc_servicer_functions"]
    assert functions == list(SERVICERS)
    for function in functions:
        assert callable(import_attr(function))


def test_secrets_and_per_pod_values_reach_the_service_config():
    """The DFLASH_* variables on the Ray containers (secrets, the pod's address) are keys the
    service's config accepts; secret values are stand-ins here."""
    from dflash.service.config import load_config

    for variant in VARIANTS:
        for group in groups(variant).values():
            env = {e["name"]: e.get("value", "from-a-secret") for e in group["template"]["spec"]["containers"][0]["env"]}
            dflash_env = {k: v for k, v in env.items() if k.startswith("DFLASH_")}
            config = load_config(env=dflash_env)
            assert config.redis.url and config.drafter_net.host == "$(POD_IP)"


# --- the shape the issue asks for --------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_gpu_split(variant):
    values = variant_values(variant)
    g = groups(variant)
    head = g["head"]["template"]["spec"]["containers"][0]
    assert g["head"]["rayStartParams"]["num-gpus"] == "0"
    assert "nvidia.com/gpu" not in json.dumps(head["resources"])
    cpu_only = values.get("image", {}).get("flavor") == "cpu"
    for role in ("verifier", "drafter"):
        spec = g[role]["template"]["spec"]
        limits = spec["containers"][0]["resources"]["limits"]
        wanted = values.get(role, {}).get("pods", {}).get("nodeSelector")
        if wanted is not None:  # exactly the variant's selector: Helm merges maps with the defaults
            assert spec.get("nodeSelector", {}) == {k: v for k, v in wanted.items() if v is not None}
        if cpu_only:
            assert "nvidia.com/gpu" not in limits and "nodeSelector" not in spec
            continue
        assert limits["nvidia.com/gpu"] >= 1
        assert spec["nodeSelector"], f"{role} pods need their GPU node group"
        assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    if not cpu_only:
        assert g["verifier"]["template"]["spec"]["nodeSelector"] != g["drafter"]["template"]["spec"]["nodeSelector"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_grpc_port_is_exposed_as_serve_grpc(variant):
    rs = rayservice(variant)
    port = serve_config(variant)["grpc_options"]["port"]
    for group in groups_of(rs):
        ports = {p["name"]: p["containerPort"] for p in group["template"]["spec"]["containers"][0]["ports"]}
        assert ports["serve-grpc"] == port
    # KubeRay's serve Service keeps only the HTTP port named "serve": the chart's own Service carries gRPC
    # to the Ray pods whose proxy KubeRay marked healthy.
    svc = one(variant_objects(variant), "Service", "-grpc")
    (svc_port,) = svc["spec"]["ports"]
    tls = variant_values(variant).get("tls", {})
    public = ("grpc-tls", "grpc-tls", tls.get("port", 9443)) if tls.get("enabled") else ("serve-grpc", "serve-grpc", port)
    assert (svc_port["name"], svc_port["targetPort"], svc_port["port"]) == public  # TLS: test_tls_sidecar_*
    ray_labels = groups(variant)["head"]["template"]["metadata"]["labels"]
    selector = dict(svc["spec"]["selector"])
    assert selector.pop("ray.io/serve") == "true"
    assert selector.items() <= ray_labels.items()
    assert rs["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True


def test_tls_sidecar_serves_the_public_port():
    """tls.enabled: a tls-front sidecar in the head pod only, the Secret mounted read-only, the Service and
    the helm test pod on its port; the sidecar's command line is one `dflash` parses."""
    from dflash.cli import build_parser

    values = variant_values("tls")
    objs = variant_objects("tls")
    g = groups("tls")
    head = g["head"]["template"]["spec"]
    ray, sidecar = head["containers"]
    assert ray["name"] == "ray-head" and sidecar["name"] == "tls-front" and sidecar["image"] == ray["image"]
    assert all(len(g[role]["template"]["spec"]["containers"]) == 1 for role in ("verifier", "drafter"))
    args = build_parser().parse_args(sidecar["command"][1:] + sidecar["args"])
    grpc_port = serve_config("tls")["grpc_options"]["port"]
    assert (args.listen, args.upstream) == ("0.0.0.0:9443", f"127.0.0.1:{grpc_port}") and not args.client_ca
    assert {p["name"]: p["containerPort"] for p in sidecar["ports"]} == {"grpc-tls": 9443}
    (mount,) = sidecar["volumeMounts"]
    assert mount["readOnly"] is True and args.cert == f"{mount['mountPath']}/tls.crt" and args.key == f"{mount['mountPath']}/tls.key"
    volume = {v["name"]: v for v in head["volumes"]}[mount["name"]]
    assert volume["secret"]["secretName"] == values["tls"]["existingSecret"] == "dflash-tls"
    assert not any(m["name"] == mount["name"] for m in ray["volumeMounts"]), "only the sidecar reads the key"
    svc = one(objs, "Service", "-grpc")
    assert svc["spec"]["selector"]["dflash.dev/role"] == "head" == g["head"]["template"]["metadata"]["labels"]["dflash.dev/role"]
    env = env_of(one(objs, "Pod")["spec"]["containers"][0])
    assert env["TARGET"]["value"] == f"{svc['metadata']['name']}:9443" and env["TLS_SERVER_NAME"]["value"] == "dflash.example.com"
    notes = render(values)["dflash/templates/NOTES.txt"]
    assert "grpcurl -cacert ca.crt -authority dflash.example.com" in notes and "-plaintext" not in notes


def test_tls_client_auth_passes_the_secrets_ca():
    rs = one(objects(render({"tls": {"enabled": True, "existingSecret": "t", "clientAuth": True, "port": 8443}})), "RayService")
    sidecar = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][1]
    assert "--client-ca=/etc/dflash/tls/ca.crt" in sidecar["args"] and "--listen=0.0.0.0:8443" in sidecar["args"]


def test_names_fit_kuberay_limits():
    long_release = "a-very-long-release-name-for-a-customer-cluster-prod"
    objs = objects(render({}, release=long_release))
    name = one(objs, "RayService")["metadata"]["name"]
    assert len(name) <= 47 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name)
    assert len(name + "-serve-svc") <= 63  # the Service KubeRay derives from it
    assert all(len(o["metadata"]["name"]) <= 63 for o in objs)


@pytest.mark.parametrize("variant", VARIANTS)
def test_standard_labels(variant):
    for obj in variant_objects(variant):
        labels = obj["metadata"]["labels"]
        for key in ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
                    "app.kubernetes.io/managed-by", "helm.sh/chart"):
            assert key in labels, f"{obj['kind']}/{obj['metadata']['name']} lacks {key}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_containers_are_locked_down(variant):
    for obj in variant_objects(variant):
        for spec in pod_specs(obj):
            assert spec["securityContext"]["runAsNonRoot"] is True
            assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
            for c in spec.get("initContainers", []) + spec["containers"]:
                sc = c["securityContext"]
                assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
                assert sc["readOnlyRootFilesystem"] is True, f"{c['name']} has a writable root"
                assert c["image"].split(":")[-1] not in ("", "latest"), f"{c['name']} image is not pinned"
    autoscaler = rayservice(variant)["spec"]["rayClusterConfig"]["autoscalerOptions"]["securityContext"]
    assert autoscaler["runAsNonRoot"] is True and autoscaler["capabilities"]["drop"] == ["ALL"]


def env_of(container: dict) -> dict:
    return {e["name"]: e for e in container.get("env", [])}


@pytest.mark.parametrize("variant", VARIANTS)
def test_redis(variant):
    objs = variant_objects(variant)
    env = env_of(groups(variant)["verifier"]["template"]["spec"]["containers"][0])
    if variant_values(variant).get("redis", {}).get("mode") == "external":
        assert not [o for o in objs if o["kind"] == "StatefulSet"]
        assert env["DFLASH_REDIS__URL"]["valueFrom"]["secretKeyRef"]["name"] == "dflash-redis-url"
        return
    sts = one(objs, "StatefulSet", "-redis")
    container = sts["spec"]["template"]["spec"]["containers"][0]
    assert "--appendonly yes" in container["args"][0]
    assert "$REDIS_PASSWORD" in container["args"][0] and "requirepass" in container["args"][0]
    assert env_of(container)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == one(objs, "Secret")["metadata"]["name"]
    assert "ping" in " ".join(container["readinessProbe"]["exec"]["command"])
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert {"name": "data", "mountPath": "/data"} in container["volumeMounts"]
    assert env["DFLASH_REDIS__URL"]["value"].startswith("redis://:$(REDIS_PASSWORD)@")


@pytest.mark.parametrize("variant", VARIANTS)
def test_model_sources(variant):
    source = variant_values(variant).get("model", {}).get("source", "hub")
    args = serve_config(variant)["applications"][0]["args"]["model"]
    for role in ("verifier", "drafter"):
        spec = groups(variant)[role]["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        if source == "hub":
            (init,) = spec["initContainers"]
            assert args["target"] == "/models/target" and args["drafter"] == "/models/drafter"
            assert "snapshot_download" in init["args"][0]
            if variant == "gpu-split":
                assert env_of(init)["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "hf-token"
        elif source == "pvc":
            assert volumes["models"]["persistentVolumeClaim"]["readOnly"] is True
            assert args["target"].startswith("/models/") and "initContainers" not in spec
        else:
            assert "models" not in volumes and "initContainers" not in spec
            assert args["target"] is None  # the demo pair baked into the image


@pytest.mark.parametrize("variant", VARIANTS)
def test_otel_and_auth_env(variant):
    values = variant_values(variant)
    for group in groups(variant).values():
        env = env_of(group["template"]["spec"]["containers"][0])
        if values.get("otel", {}).get("endpoint"):
            assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == values["otel"]["endpoint"]
            assert env["OTEL_SERVICE_NAME"]["value"] == "dflash"
        else:
            assert not [k for k in env if k.startswith("OTEL_")]
        if values.get("auth", {}).get("enabled"):
            assert env["DFLASH_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == values["auth"]["existingSecret"]
        else:
            assert "DFLASH_AUTH_TOKEN" not in env


@pytest.mark.parametrize("variant", VARIANTS)
def test_network_policies(variant):
    objs = variant_objects(variant)
    ray = one(objs, "NetworkPolicy", "-ray")
    open_rules = [r for r in ray["spec"]["ingress"] if "from" not in r]
    public = "grpc-tls" if variant_values(variant).get("tls", {}).get("enabled") else "serve-grpc"
    assert open_rules == [{"ports": [{"port": public, "protocol": "TCP"}]}], "only gRPC is open to all"
    if any(o["kind"] == "StatefulSet" for o in objs):
        redis = one(objs, "NetworkPolicy", "-redis")
        (rule,) = redis["spec"]["ingress"]
        (peer,) = rule["from"]
        assert peer["podSelector"]["matchLabels"] == ray["spec"]["podSelector"]["matchLabels"]


def test_helm_test_pod_runs_a_generate_call():
    pod = one(variant_objects("gpu-split"), "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    container = pod["spec"]["containers"][0]
    assert "GenerationStub" in container["args"][0] and ".Generate(" in container["args"][0]
    env = env_of(container)
    assert env["TARGET"]["value"] == f"{one(variant_objects('gpu-split'), 'Service', '-grpc')['metadata']['name']}:9000"
    assert "AUTH_TOKEN" in env


def test_notes_show_port_forward_and_grpcurl():
    notes = render({})["dflash/templates/NOTES.txt"]
    assert "kubectl -n dflash port-forward svc/dflash-grpc 9000:9000" in notes
    assert "grpcurl -plaintext" in notes and "dflash.v1.Generation/Generate" in notes


# --- values: documented and schema-checked -----------------------------------------------------------

def test_every_value_has_a_comment():
    """Every key has a comment above it or on its line; what lies under a "# --" value is its content."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    missing, inside = [], None  # inside: indentation of the documented value being read
    for i, line in enumerate(lines):
        match = re.match(r"^(\s*)(?:- )?([A-Za-z][\w./-]*):", line)
        if not match or line.lstrip().startswith("#"):
            continue
        indent = len(match.group(1))
        if inside is not None and indent > inside:
            continue
        inside = None
        previous = next((p for p in reversed(lines[:i]) if p.strip()), "").strip()
        if "#" not in line and not previous.startswith("#"):
            missing.append(f"line {i + 1}: {line.strip()}")
        if previous.startswith("# --"):
            inside = indent
    assert missing == []


BAD_VALUES = [
    ({"model": {"source": "s3"}}, "/model/source"),
    ({"mode": "split"}, "/mode"),
    ({"redis": {"mode": "cluster"}}, "/redis/mode"),
    ({"verifier": {"autoscaling": {"minReplicas": -1}}}, "/verifier/autoscaling/minReplicas"),
    ({"drafter": {"autoscaling": {"minReplicas": 0}}}, "/drafter/autoscaling/minReplicas"),
    ({"drafter": {"autoscaling": {"targetInflightDrafts": 0}}}, "/drafter/autoscaling/targetInflightDrafts"),
    ({"drafter": {"rayResource": "drafter gpu"}}, "/drafter/rayResource"),
    ({"grpc": {"port": 70000}}, "/grpc/port"),
    ({"image": {"flavor": "rocm"}}, "/image/flavor"),
    ({"verifier": {"pods": {"gpus": "one"}}}, "/verifier/pods/gpus"),
    ({"sessions": {"ttlSeconds": 0}}, "/sessions/ttlSeconds"),
    ({"fullnameOverride": "Dflash_Prod"}, "/fullnameOverride"),
    ({"replicaCount": 3}, "replicaCount"),
    ({"redis": {"persistance": {"size": "1Gi"}}}, "persistance"),
]


@pytest.mark.parametrize(("values", "where"), BAD_VALUES, ids=[w for _, w in BAD_VALUES])
def test_schema_rejects_bad_values(values, where):
    with pytest.raises(helm.HelmValuesError, match=re.escape(where)):
        render(values)


@pytest.mark.parametrize(("values", "message"), [
    ({"auth": {"enabled": True}}, "auth.existingSecret"),
    ({"redis": {"mode": "external"}}, "redis.external.existingSecret"),
    ({"model": {"source": "pvc"}}, "model.pvc.claimName"),
    ({"tls": {"enabled": True}}, "tls.existingSecret"),
    ({"tls": {"enabled": True, "existingSecret": "tls", "port": 9000}}, "tls.port 9000 is taken"),
    ({"drafter": {"gpusPerReplica": 1, "replicasPerPod": 2}}, "exceeds pods.gpus"),
])
def test_inconsistent_values_fail_with_a_message(values, message):
    with pytest.raises(helm.HelmError, match=re.escape(message)):
        render(values)
