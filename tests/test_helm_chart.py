"""The Helm chart (helm/), checked by rendering: no cluster or helm binary exists here.

helm-python-sdk renders the real chart through Helm's own Go SDK (bundled as a shared library), for
the default values and every ci/*-values.yaml. Each rendered object is validated: standard kinds with
kubernetes-validate (strict), the RayService against KubeRay's CRD schema (../shared/schemas), and
its serveConfigV2 against Ray Serve's schema and the service's own config code, which builds the
application's deployment graph without loading any model (through Serve's own private build and
override code: tests/ray_internals.py says why each is private).

What KubeRay does with the rendered RayService is read from its controller code (ray-project/kuberay,
ray-operator/controllers/ray, release 1.6, the oldest the chart supports): `kuberay_problems` restates
the validation it applies, and each test names the controller behaviour it relies on.
"""

from __future__ import annotations

import functools
import json
import os
import pkgutil
import re
import shutil
from pathlib import Path

import pytest
import yaml
from ray_internals import app_code_version, autoscaler_token_paths, build_application, deployed

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


def pod_templates(obj: dict) -> list[dict]:
    """Every pod (metadata and spec) an object makes: Ray groups, StatefulSet and Deployment templates, a bare Pod."""
    if obj["kind"] == "Pod":
        return [obj]
    if obj["kind"] in ("StatefulSet", "Deployment"):
        return [obj["spec"]["template"]]
    if obj["kind"] == "RayService":
        return [g["template"] for g in groups_of(obj)]
    return []


def pod_specs(obj: dict) -> list[dict]:
    return [t["spec"] for t in pod_templates(obj)]


def groups_of(rs: dict) -> list[dict]:
    cluster = rs["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]


def merged_values(variant: str) -> dict:
    """values.yaml with the variant's values over it, merged as Helm merges them (null drops a key)."""
    def merge(base: dict, over: dict) -> dict:
        out = dict(base)
        for key, item in over.items():
            if item is None:
                out.pop(key, None)
            elif isinstance(item, dict) and isinstance(out.get(key), dict):
                out[key] = merge(out[key], item)
            else:
                out[key] = item
        return out

    return merge(yaml.safe_load((CHART / "values.yaml").read_text()), variant_values(variant))


def value(variant: str, dotted: str):
    node = merged_values(variant)
    for key in dotted.split("."):
        node = node[key]
    return node


def public_grpc_service(variant: str) -> str:
    """The Service clients call: KubeRay's serve Service, or with TLS the chart's Service of the TLS front."""
    if variant_values(variant).get("tls", {}).get("enabled"):
        return one(variant_objects(variant), "Service", "-grpc-tls")["metadata"]["name"]
    return rayservice(variant)["spec"]["serveService"]["metadata"]["name"]


# --- the chart renders and lints -------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_lint_has_no_warnings(variant):
    report = helm.lint(str(CHART), variant_values(variant), strict=True, namespace="dflash")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


@pytest.mark.parametrize("variant", VARIANTS)
def test_renders_the_expected_objects(variant):
    kinds = sorted(o["kind"] for o in variant_objects(variant))
    internal_redis = value(variant, "redis.mode") == "internal"
    # Ray pods' NetworkPolicy, the helm test Pod, two accounts (head, workers), a budget per worker group.
    expected = ["NetworkPolicy", "Pod", "RayService", "ServiceAccount", "ServiceAccount",
                "PodDisruptionBudget", "PodDisruptionBudget"]
    if internal_redis:
        # Its Secret, its ClusterIP Service and the StatefulSet's headless one, the StatefulSet, its budget.
        expected += ["NetworkPolicy", "Secret", "Service", "Service", "StatefulSet", "PodDisruptionBudget"]
    if value(variant, "tls.enabled"):
        expected += ["Deployment", "Service", "NetworkPolicy", "PodDisruptionBudget"]
    if not value(variant, "drafter.net.auth.existingSecret"):
        expected += ["Secret"]  # the Drafter API's token, generated
    if value(variant, "openai.enabled"):
        expected += ["Service"]  # the OpenAI API's, on the HTTP proxy
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
        return [p for i, item in enumerate(value)
                for p in unknown_fields(item, schema.get("items", {}), f"{path}[{i}]")]
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


def kuberay_problems(rs: dict) -> list[str]:
    """What KubeRay's validation (utils/validation.go: ValidateRayServiceSpec, ValidateRayClusterSpec)
    refuses in a RayService, restated for the fields this chart sets. Refused specs never get a cluster."""
    spec, problems = rs["spec"], []
    cluster = spec["rayClusterConfig"]
    autoscaling = cluster.get("enableInTreeAutoscaling", False)
    v2 = autoscaling and (cluster.get("autoscalerOptions") or {}).get("version") == "v2"
    head = cluster["headGroupSpec"]
    head_env = {e["name"] for e in head["template"]["spec"]["containers"][0].get("env", [])}
    if v2 and head["template"]["spec"].get("restartPolicy", "Never") != "Never":
        problems.append("head: autoscaler v2 needs restartPolicy Never or unset")
    for group in cluster["workerGroupSpecs"]:
        name = group["groupName"]
        if not autoscaling and ("minReplicas" not in group or "maxReplicas" not in group):
            problems.append(f"{name}: min and max replicas are required without the autoscaler")
        if group.get("minReplicas", 0) > group.get("maxReplicas", float("inf")):
            problems.append(f"{name}: minReplicas above maxReplicas")
        if "idleTimeoutSeconds" in group and not v2:
            problems.append(f"{name}: idleTimeoutSeconds is set, but autoscaler v2 is not enabled")
        if v2 and group["template"]["spec"].get("restartPolicy", "Never") != "Never":
            problems.append(f"{name}: autoscaler v2 needs restartPolicy Never or unset")
    if "gcsFaultToleranceOptions" in cluster:
        if "redis-password" in head["rayStartParams"]:
            problems.append("head: redis-password in rayStartParams with gcsFaultToleranceOptions")
        problems += [f"head: {var} env var with gcsFaultToleranceOptions"
                     for var in ("REDIS_PASSWORD", "RAY_REDIS_ADDRESS") if var in head_env]
    elif "RAY_REDIS_ADDRESS" in head_env:
        problems.append("head: RAY_REDIS_ADDRESS without gcsFaultToleranceOptions")
    if "REDIS_USERNAME" in head_env or "redis-username" in head["rayStartParams"]:
        problems.append("head: a Redis username outside gcsFaultToleranceOptions")
    upgrade = (spec.get("upgradeStrategy") or {}).get("type")
    if upgrade not in (None, "NewCluster", "None", "NewClusterWithIncrementalUpgrade"):
        problems.append(f"upgradeStrategy.type {upgrade} is not one KubeRay knows")
    return problems


@pytest.mark.parametrize("variant", VARIANTS)
def test_kuberay_accepts_the_rayservice(variant):
    assert kuberay_problems(rayservice(variant)) == []


@pytest.mark.parametrize("variant", VARIANTS)
def test_serve_config_passes_ray_serve_schema(variant):
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(serve_config(variant))


# --- the service understands the rendered serveConfigV2 ----------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_service_config_builds_the_deployment_graph(variant):
    from dflash.service.config import ServiceConfig

    config = serve_config(variant)
    (app,) = config["applications"]
    service = ServiceConfig.from_dict(app["args"])
    built = build_application(app)
    separate = service.ingress_placement == "separate"
    assert service.ingress_placement == value(variant, "ingress.placement")
    expected = {"verifier"} | ({"ingress"} if separate else set()) | (
        {"drafter"} if service.mode == "disaggregated" else set())
    assert {d.name for d in built.deployments} == expected
    assert built.ingress_deployment_name == ("ingress" if separate else "verifier")
    assert config["grpc_options"]["port"] == service.grpc_port

    # Each group offers one custom resource; only its own deployment asks for it, and every replica Serve
    # may want fits the pods the group may have.
    g = groups(variant)
    offered = {name: ray_resources(group) for name, group in g.items()}
    for name, info in deployed(app).items():
        group = "head" if name == "ingress" else name
        options = info.replica_config.ray_actor_options
        (resource,) = options.get("resources", {})
        assert offered[group] == {resource: offered[group][resource]}, f"{name} must land on its own group"
        assert not [other for other, res in offered.items() if resource in res and other != group]
        per_pod = offered[group][resource] / options["resources"][resource]
        assert options.get("num_gpus", 0) * per_pod <= float(g[group]["rayStartParams"]["num-gpus"])
        auto = info.deployment_config.autoscaling_config
        pods = 1 if group == "head" else g[group]["maxReplicas"]
        assert auto is not None and auto.min_replicas <= auto.max_replicas <= per_pod * pods


@pytest.mark.parametrize("variant", VARIANTS)
def test_autoscaling_configs_are_rays_own(variant):
    """Serve ignores autoscaling_config keys it does not know, so each rendered one holds only fields of
    Ray's AutoscalingConfig; the drafter's names the draft-load policy, which its kwargs build."""
    from dflash.service.autoscaling import POLICY_FUNCTION
    from ray.serve.config import AutoscalingConfig

    overrides = {d["name"]: d for d in serve_config(variant)["applications"][0]["deployments"]}
    assert ("ingress" in overrides) == (value(variant, "ingress.placement") == "separate")
    for name in ("ingress", "verifier", "drafter"):
        if name not in overrides:
            continue
        raw = overrides[name]["autoscaling_config"]
        assert set(raw) <= set(AutoscalingConfig.model_fields), f"{name}: {sorted(raw)}"
        auto = AutoscalingConfig.model_validate(raw)
        if name != "drafter":
            assert auto.policy.is_default_policy_function()
    wanted = value(variant, "drafter.autoscaling")
    assert auto.policy.policy_function == POLICY_FUNCTION
    policy = auto.policy.get_policy()(**auto.policy.policy_kwargs)
    assert policy.target_inflight_drafts == wanted["targetInflightDrafts"]
    assert (auto.upscale_delay_s, auto.downscale_delay_s) == (wanted["upscaleDelaySeconds"],
                                                              wanted["downscaleDelaySeconds"])


SERVE_TWEAKS = {
    "ingress": {"maxOngoingRequests": 32, "autoscaling": {"maxReplicas": 3, "targetOngoingRequests": 16}},
    "verifier": {"cpusPerReplica": 3, "maxQueuedRequests": 8, "autoscaling": {"minReplicas": 2, "maxReplicas": 3}},
    "drafter": {"maxOngoingRequests": 8, "autoscaling": {"maxReplicas": 6, "upscaleDelaySeconds": 10}},
}


def app_config(values: dict) -> dict:
    (app,) = yaml.safe_load(one(objects(render(values)), "RayService")["spec"]["serveConfigV2"])["applications"]
    return app


def test_serve_options_are_overrides_that_keep_the_code_version():
    """Serve restarts every replica of an application whose code version changes, and the code version
    hashes the import path, `args` and the autoscaling policies (deploy_utils.get_app_code_version), not
    the deployments' other options. Replicas, limits and actor options therefore travel as `deployments:`
    overrides: tuning them restarts no verifier (only changed actor options restart that deployment)."""
    before, after = app_config({}), app_config(SERVE_TWEAKS)
    assert after["args"] == before["args"] and after["deployments"] != before["deployments"]
    assert app_code_version(after) == app_code_version(before)
    effective = deployed(after)
    verifier = effective["verifier"]
    assert (verifier.deployment_config.autoscaling_config.min_replicas,
            verifier.deployment_config.autoscaling_config.max_replicas) == (2, 3)
    assert verifier.replica_config.ray_actor_options["num_cpus"] == 3
    assert verifier.deployment_config.max_queued_requests == 8
    assert effective["ingress"].deployment_config.max_ongoing_requests == 32
    assert effective["drafter"].deployment_config.autoscaling_config.upscale_delay_s == 10
    # The application's own settings are its code: changing them restarts it, as it must.
    assert app_code_version(app_config({"limits": {"maxNewTokens": 512}})) != app_code_version(before)
    # So is a policy's argument (Serve hashes the policy): documented in values.yaml and docs/kubernetes.md.
    policy_arg = app_config({"drafter": {"autoscaling": {"targetInflightDrafts": 3}}})
    assert app_code_version(policy_arg) != app_code_version(before)


def test_args_stay_the_applications_own_configuration():
    """`args` is the service's ServiceConfig tree minus the deployments (their options are overrides):
    the same tree `dflash serve` reads, so the local service and the chart share one config code."""
    from dflash.service.config import ServiceConfig

    args = app_config({})["args"]
    assert not {"ingress", "verifier", "drafter"} & set(args)
    tree = ServiceConfig.from_dict(args).to_dict()
    assert {k: v for k, v in tree.items() if k in args} == {k: tree[k] for k in args}


def test_colocated_mode_has_no_drafter_group():
    from dflash.service.config import ServiceConfig

    objs = objects(render({"mode": "colocated"}))
    rs = one(objs, "RayService")
    assert [g["groupName"] for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]] == ["verifier"]
    (app,) = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]
    assert ServiceConfig.from_dict(app["args"]).mode == "colocated"
    assert set(deployed(app)) == {"ingress", "verifier"}
    budgets = [o["metadata"]["name"] for o in objs if o["kind"] == "PodDisruptionBudget"]
    assert budgets == ["dflash-verifier", "dflash-redis"]


def kuberay_resources_map(params: dict) -> dict:
    """KubeRay's reading of rayStartParams["resources"] (common/pod.go, getResourcesMap, v1.6.0 to v1.7.0):
    strings.Trim(s, "'\\"` ") and json.Unmarshal into map[string]float64. An error there makes
    addWellKnownAcceleratorResources give up (generateRayStartCommand logs it)."""
    raw = params.get("resources")
    if raw is None:
        return {}
    resources = json.loads(raw.strip("'\"` "))
    assert isinstance(resources, dict) and all(isinstance(v, (int, float)) for v in resources.values())
    return {k: float(v) for k, v in resources.items()}


def ray_resources(group: dict) -> dict:
    return kuberay_resources_map(group["rayStartParams"])


def test_a_value_the_service_does_not_understand_fails():
    from dflash.service.config import ConfigError

    (app,) = serve_config("default")["applications"]
    for bad in ({**app["args"], "not_a_setting": 1},
                {**app["args"], "redis": {**app["args"]["redis"], "ttl": 5}},
                {**app["args"], "limits": {**app["args"]["limits"], "max_new_tokens": "many"}}):
        with pytest.raises(ConfigError):
            build_application({**app, "args": bad})


@pytest.mark.parametrize("variant", VARIANTS)
def test_grpc_servicers_are_the_services(variant):
    """Serve's gRPC proxy gets what `dflash serve` gives it (app.grpc_options) for the rendered args:
    servicers.py's services (lenient decoding), reflection among them only with `reflection` on, and
    Ray's own reflection, which answers anyone, off."""
    from dflash.service.app import grpc_options
    from dflash.service.config import ServiceConfig

    config = serve_config(variant)
    (app,) = config["applications"]
    service = ServiceConfig.from_dict(app["args"])
    wanted = grpc_options(service)
    rendered = config["grpc_options"]
    assert rendered["grpc_servicer_functions"] == list(wanted.grpc_servicer_functions)
    assert rendered["enable_reflection"] is False is wanted.enable_reflection
    assert rendered["port"] == wanted.port
    assert service.reflection is value(variant, "grpc.reflection")
    reflection = [f for f in rendered["grpc_servicer_functions"] if "Reflection" in f]
    assert bool(reflection) is value(variant, "grpc.reflection")
    for function in rendered["grpc_servicer_functions"]:
        assert function.startswith("dflash.service.servicers.") and callable(pkgutil.resolve_name(function))


def test_reflection_off_leaves_it_out():
    from dflash.service.app import grpc_options
    from dflash.service.config import ServiceConfig

    rs = one(objects(render({"grpc": {"reflection": False}})), "RayService")
    config = yaml.safe_load(rs["spec"]["serveConfigV2"])
    (app,) = config["applications"]
    assert app["args"]["reflection"] is False and config["grpc_options"]["enable_reflection"] is False
    assert config["grpc_options"]["grpc_servicer_functions"] == \
        list(grpc_options(ServiceConfig.from_dict(app["args"])).grpc_servicer_functions)
    assert not [f for f in config["grpc_options"]["grpc_servicer_functions"] if "Reflection" in f]


def dflash_env(container: dict) -> dict:
    """The container's DFLASH_* variables; values from Secrets are stand-ins."""
    return {e["name"]: e.get("value", "from-a-secret")
            for e in container.get("env", []) if e["name"].startswith("DFLASH_")}


def test_secrets_and_per_pod_values_reach_the_service_config():
    """The DFLASH_* variables on the Ray containers (secrets, the pod's address) are keys the
    service's config accepts; secret values are stand-ins here."""
    from dflash.service.config import load_config

    for variant in VARIANTS:
        for group in groups(variant).values():
            config = load_config(env=dflash_env(group["template"]["spec"]["containers"][0]))
            assert config.redis.url and config.drafter_net.host == "$(POD_IP)"


def test_every_ray_pod_starts_its_workers_at_the_chart_niceness():
    """Ray reads RAY_worker_niceness when it starts a node; its default (15) would put the replicas below Ray's
    own processes in the pod."""
    for values, want in (({}, "0"), ({"workerNiceness": 5}, "5")):
        for group in groups_of(one(objects(render(values)), "RayService")):
            env = {e["name"]: e.get("value") for e in group["template"]["spec"]["containers"][0]["env"]}
            assert env["RAY_worker_niceness"] == want, group.get("groupName", "head")


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
        requests = spec["containers"][0]["resources"]["requests"]
        assert limits["nvidia.com/gpu"] >= 1 and limits["nvidia.com/gpu"] == requests["nvidia.com/gpu"]
        assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    selectors = [g[role]["template"]["spec"].get("nodeSelector") for role in ("verifier", "drafter")]
    if all(selectors):  # a variant that names both node groups names two different ones
        assert selectors[0] != selectors[1]


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_head_hosts_the_ingress_and_nothing_else(variant):
    """`num-cpus: "0"` keeps every CPU-asking task and actor off the head; the ingress asks for no CPU but
    for a resource only the head offers, so it never lands on a GPU pod, where it would keep that pod
    busy and stop Ray's autoscaler from removing it."""
    head = groups(variant)["head"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    replicas = deployed(serve_config(variant)["applications"][0])
    if value(variant, "ingress.placement") == "verifier":  # the verifiers answer: the head hosts no replica
        assert "ingress" not in replicas
        return
    ingress = replicas["ingress"].replica_config.ray_actor_options
    assert ingress.get("num_cpus") == 0 and ingress.get("num_gpus", 0) == 0
    assert set(ingress["resources"]) == set(ray_resources(head)) == {value(variant, "ingress.rayResource")}
    assert ray_resources(head)[value(variant, "ingress.rayResource")] == value(variant, "head.maxIngressReplicas")


# 1. The autoscaler's API token ----------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_only_the_autoscaler_gets_an_api_token(variant):
    """KubeRay binds its autoscaler Role (pods get/list/watch/patch, rayclusters get/patch) to the head
    pod's service account, and refuses a head that names an account which does not exist
    (common/rbac.go, RayClusterReconciler.reconcileAutoscaler*). Ray's autoscaler reads the token and CA
    at the in-cluster paths (kuberay/node_provider.py, reread every minute). The chart gives the head an
    account of its own and projects that account's token into the autoscaler container only: no Ray
    process, and no worker, holds a token."""
    token_path, ca_path = autoscaler_token_paths()
    objs = variant_objects(variant)
    cluster = one(objs, "RayService")["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]["template"]["spec"]
    accounts = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ServiceAccount"}
    assert head["serviceAccountName"] in accounts
    assert all(a["automountServiceAccountToken"] is False for a in accounts.values())
    for obj in objs:
        for template in pod_templates(obj):
            assert template["spec"]["automountServiceAccountToken"] is False
            if template["spec"] is not head:
                assert template["spec"]["serviceAccountName"] != head["serviceAccountName"]
    token_dir = os.path.dirname(token_path)
    assert os.path.dirname(ca_path) == token_dir
    (mount,) = [m for m in cluster["autoscalerOptions"]["volumeMounts"] if m["mountPath"] == token_dir]
    assert mount["readOnly"] is True
    sources = {v["name"]: v for v in head["volumes"]}[mount["name"]]["projected"]["sources"]
    files = {s["serviceAccountToken"]["path"] for s in sources if "serviceAccountToken" in s}
    files |= {i["path"] for s in sources for kind in ("configMap", "downwardAPI")
              for i in s.get(kind, {}).get("items", [])}
    wanted = {token_path, ca_path}
    assert {os.path.basename(path) for path in wanted} <= files
    for obj in objs:
        for spec in pod_specs(obj):
            for c in spec.get("initContainers", []) + spec["containers"]:
                assert not [m for m in c.get("volumeMounts", []) if m["name"] == mount["name"]
                            or m["mountPath"].startswith("/var/run/secrets")], f"{c['name']} holds an API token"
    assert not [o for o in objs if o["kind"] in ("Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")], \
        "KubeRay creates the autoscaler's Role and RoleBinding itself, per cluster"


def test_without_the_autoscaler_no_pod_gets_a_token():
    rs = one(objects(render({"autoscaler": {"enabled": False}})), "RayService")
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    assert "autoscalerOptions" not in rs["spec"]["rayClusterConfig"]
    assert not [v for v in head["volumes"] if "projected" in v]


# 2. The operator reaches the dashboard and the Serve proxy --------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_the_operator_reaches_the_dashboard_and_the_serve_proxy(variant):
    """KubeRay reads Serve's applications from the head's dashboard (8265) and checks the Serve proxy's
    health on 8000 at the head pod's IP (RayServiceReconciler.updateHeadPodServeLabel): a head whose
    proxy it cannot reach never gets ray.io/serve=true and never serves."""
    operator = value(variant, "networkPolicy.operator")
    ray = one(variant_objects(variant), "NetworkPolicy", "-ray")
    (rule,) = [r for r in ray["spec"]["ingress"] if 8265 in {p["port"] for p in r.get("ports", [])}]
    assert sorted(p["port"] for p in rule["ports"]) == [8000, 8265]
    (peer,) = rule["from"]
    assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": operator["namespace"]}
    assert peer["podSelector"]["matchLabels"] == operator["podLabels"]


def test_the_operator_namespace_defaults_to_where_kuberay_installs_it():
    """KubeRay's Helm chart installs into the release namespace, and its README installs into `default`;
    its kustomize install (ray-operator/config/default) uses `default` too. Both label the operator's
    pods app.kubernetes.io/component: kuberay-operator."""
    operator = yaml.safe_load((CHART / "values.yaml").read_text())["networkPolicy"]["operator"]
    assert operator == {"namespace": "default", "podLabels": {"app.kubernetes.io/component": "kuberay-operator"}}
    peer = one(objects(render({"networkPolicy": {"operator": {"podLabels": None}}})), "NetworkPolicy", "-ray")
    (rule,) = [r for r in peer["spec"]["ingress"] if {p["port"] for p in r.get("ports", [])} == {8000, 8265}]
    assert rule["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "default"}}}]


# 3. gRPC goes to the cluster that serves ----------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_grpc_reaches_only_the_serving_cluster(variant):
    """During an upgrade two RayClusters run. KubeRay moves its serve Service (selector ray.io/cluster and
    ray.io/serve) to the new cluster only once its applications run, while the new head is labelled
    ray.io/serve=true as soon as its proxy answers. Since KubeRay 1.6 that Service carries every head port
    named "serve" or "serve-*" (common/service.go, BuildServeService). So the chart names only the gRPC
    port that way and makes that Service the public endpoint (spec.serveService); with TLS, the TLS front
    Deployment forwards to it. No Service of the chart carries gRPC to Ray pods (the HTTP API's selects
    them for the HTTP proxy alone: test_the_openai_api_is_served_on_the_http_proxy)."""
    objs = variant_objects(variant)
    rs = one(objs, "RayService")
    grpc_port = serve_config(variant)["grpc_options"]["port"]
    for group in groups_of(rs):
        ports = {p["name"]: p["containerPort"] for p in group["template"]["spec"]["containers"][0]["ports"]}
        assert ports["serve-grpc"] == grpc_port
        assert {name for name in ports if name == "serve" or name.startswith("serve-")} == {"serve-grpc"}
    for svc in (o for o in objs if o["kind"] == "Service" and not o["metadata"]["name"].endswith("-http")):
        assert "ray.io/serve" not in svc["spec"]["selector"]
        assert svc["spec"]["selector"].get("app.kubernetes.io/component") != "ray"
    serve = rs["spec"]["serveService"]
    (port,) = serve["spec"]["ports"]
    assert (port["name"], port["port"], port["targetPort"]) == ("serve-grpc", grpc_port, "serve-grpc")
    assert serve["metadata"]["name"] == "dflash-grpc"
    if value(variant, "tls.enabled"):
        front = one(objs, "Deployment", "-tls-front")["spec"]["template"]["spec"]["containers"][0]
        assert f"--upstream={serve['metadata']['name']}:{grpc_port}" in front["args"]
        assert serve["spec"]["type"] == "ClusterIP" and public_grpc_service(variant) == "dflash-grpc-tls"
    else:
        assert serve["metadata"]["name"] == public_grpc_service(variant)
        assert serve["spec"]["type"] == value(variant, "grpc.serviceType") and port["appProtocol"] == "grpc"
    assert len(serve["metadata"]["name"]) <= 63


def test_the_openai_api_is_served_on_the_http_proxy():
    """The ingress serves the OpenAI API on Serve's HTTP proxy (http_options, Ray's HTTPOptionsSchema), in
    every pod that runs a proxy: EveryNode puts one on the head and on each node with a replica (Serve's
    controller, _update_proxy_nodes). KubeRay checks it at the container port named "serve", else 8000
    (utils.FindContainerPort): on the head at each reconcile, labelling it ray.io/serve (updateHeadPodServeLabel),
    on workers in their readiness probe (common/pod.go), where BuildPod labels them ray.io/serve=true.
    "<full>-http" selects exactly those pods, as KubeRay's serve Service does, but of any cluster; the
    NetworkPolicy opens 8000 to grpcFrom's peers; NOTES show Ray's health path. KubeRay v1.6.0 to v1.7.0."""
    from dflash.service.config import ServiceConfig

    grpc_from = [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}]
    values = {"openai": {"port": 80, "serviceType": "LoadBalancer",
                         "serviceAnnotations": {"service.beta.kubernetes.io/aws-load-balancer-type": "nlb"}},
              "networkPolicy": {"grpcFrom": grpc_from}}
    objs = objects(render(values))
    rs = one(objs, "RayService")
    config = yaml.safe_load(rs["spec"]["serveConfigV2"])
    assert config["http_options"] == {"host": "0.0.0.0", "port": 8000} and config["proxy_location"] == "EveryNode"
    assert ServiceConfig.from_dict(config["applications"][0]["args"]).openai.enabled
    for group in groups_of(rs):
        ports = {p["name"]: p["containerPort"] for p in group["template"]["spec"]["containers"][0]["ports"]}
        assert ports["http-proxy"] == 8000 and "serve" not in ports  # KubeRay checks 8000; off the gRPC Service

    http = one(objs, "Service", "-http")
    assert http["metadata"]["name"] == "dflash-http" and http["spec"]["type"] == "LoadBalancer"
    assert http["metadata"]["annotations"] == values["openai"]["serviceAnnotations"]
    assert http["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http-proxy", "protocol": "TCP",
                                      "appProtocol": "http"}]
    head, worker = ({**g["template"]["metadata"]["labels"], "ray.io/cluster": "dflash-a"} for g in groups_of(rs)[:2])
    assert selects(http, {**head, "ray.io/serve": "true"}) and selects(http, {**worker, "ray.io/serve": "true"})
    assert not selects(http, {**head, "ray.io/serve": "false"})  # KubeRay found its proxy unhealthy
    assert selects(http, {**head, "ray.io/serve": "true", "ray.io/cluster": "dflash-b"})  # a starting cluster too

    ray = one(objs, "NetworkPolicy", "-ray")
    assert {"ports": [{"port": 8000, "protocol": "TCP"}], "from": grpc_from} in ray["spec"]["ingress"]
    text = notes(values, is_install=True)
    assert "kubectl -n dflash port-forward svc/dflash-http 80:80" in text and "localhost:80/-/healthz" in text
    assert '"model": "target"' in text  # ServiceConfig.model_name of /models/target

    off = objects(render({"openai": {"enabled": False}}))
    (app,) = yaml.safe_load(one(off, "RayService")["spec"]["serveConfigV2"])["applications"]
    assert not ServiceConfig.from_dict(app["args"]).openai.enabled
    assert not [o for o in off if o["metadata"]["name"] == "dflash-http"]
    rules = one(off, "NetworkPolicy", "-ray")["spec"]["ingress"]
    assert [r for r in rules if r.get("ports") == [{"port": 8000, "protocol": "TCP"}]] == []  # the operator's stays
    assert "/-/healthz" not in notes({"openai": {"enabled": False}}, is_install=True)


# 4. Upgrades: what replaces the GPU cluster --------------------------------------------------------------

def test_a_chart_version_bump_keeps_the_ray_cluster(tmp_path):
    """KubeRay hashes spec.rayClusterConfig (replica counts aside) and prepares a whole new RayCluster when
    the hash changes (rayservice_controller.go, shouldPrepareNewCluster): a chart label in a pod template
    would make every chart release a second full GPU cluster."""
    chart = tmp_path / "dflash"
    shutil.copytree(CHART, chart)
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    (chart / "Chart.yaml").write_text(yaml.safe_dump({**meta, "version": "9.9.9"}))

    def cluster(path: Path) -> dict:
        with helm.Chart.load(str(path)) as c:
            rendered = c.render({}, name="dflash", namespace="dflash", is_install=True)
        return one(objects(rendered), "RayService")["spec"]["rayClusterConfig"]

    assert cluster(chart) == cluster(CHART)


@pytest.mark.parametrize("variant", VARIANTS)
def test_pod_templates_carry_no_chart_version(variant):
    for obj in variant_objects(variant):
        if obj["kind"] == "Pod":  # the helm test pod is created per test run
            continue
        for template in pod_templates(obj):
            labels = template["metadata"]["labels"]
            assert not {"helm.sh/chart", "app.kubernetes.io/version"} & set(labels), obj["metadata"]["name"]
            assert labels["app.kubernetes.io/instance"] == "dflash"


@pytest.mark.parametrize("strategy", ["NewCluster", "None"])
def test_upgrade_strategy(strategy):
    rs = one(objects(render({"upgradeStrategy": strategy})), "RayService")
    assert rs["spec"]["upgradeStrategy"] == {"type": strategy}
    assert kuberay_problems(rs) == []
    assert rayservice("default")["spec"]["upgradeStrategy"] == {"type": "NewCluster"}


def test_changed_proxy_options_make_a_new_cluster():
    """Serve applies grpc_options only when it starts: on a running cluster the dashboard's
    serve_start_async finds Serve up and keeps the proxy's options (ray/serve/_private/api.py). So the
    head pod carries their hash, and a change (reflection on or off, the request timeout) goes through
    upgradeStrategy like any cluster change; changes to the application alone keep the cluster."""
    def cluster(values: dict) -> dict:
        return one(objects(render(values)), "RayService")["spec"]["rayClusterConfig"]

    base = cluster({})
    for change in ({"grpc": {"reflection": False}}, {"grpc": {"requestTimeoutSeconds": 30}}):
        changed = cluster(change)
        assert changed != base
        assert changed["workerGroupSpecs"] == base["workerGroupSpecs"], "only the head pod changes"
    for same in (SERVE_TWEAKS, {"limits": {"maxNewTokens": 512}}):
        assert cluster(same) == base


def kuberay_hashed_spec(rs: dict) -> dict:
    """What KubeRay hashes to decide whether the running RayCluster still fits the RayService: spec.rayClusterConfig
    without suspend (rayservice_controller.go, rayClusterSpecForHashing), the upgrade strategy, every group's
    tolerations and scheduling gates, and the worker groups' replicas, minReplicas, maxReplicas and workersToDelete
    (utils/util.go, GenerateHashWithoutReplicasAndWorkersToDelete; v1.6.0 to v1.7.0). Equal here: KubeRay keeps
    the running cluster as it is (shouldUpdateCluster, shouldPrepareNewCluster)."""
    spec = json.loads(json.dumps(rs["spec"]["rayClusterConfig"]))
    spec.pop("suspend", None)
    spec.pop("upgradeStrategy", None)
    for group in [spec["headGroupSpec"], *spec.get("workerGroupSpecs", [])]:
        group["template"]["spec"].pop("tolerations", None)
        group["template"]["spec"].pop("schedulingGates", None)
    for group in spec.get("workerGroupSpecs", []):
        for key in ("replicas", "minReplicas", "maxReplicas"):
            group.pop(key, None)
        group.get("scaleStrategy", {}).pop("workersToDelete", None)
    return spec


TAINT = [{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}]


@pytest.mark.parametrize(("role", "change"), [
    ("verifier", {"pods": {"maxReplicas": 6}}),
    ("verifier", {"pods": {"minReplicas": 2}}),
    ("verifier", {"pods": {"tolerations": TAINT}}),
    ("drafter", {"pods": {"maxReplicas": 12}}),
    ("drafter", {"pods": {"minReplicas": 0}}),
    ("drafter", {"pods": {"tolerations": TAINT}}),
    ("head", {"tolerations": TAINT}),
], ids=lambda x: x if isinstance(x, str) else json.dumps(x)[:40])
def test_bounds_and_tolerations_reach_the_ray_cluster(role, change):
    """KubeRay leaves a worker group's min/max replicas and all tolerations out of its cluster hash, so by
    themselves a raised pods.maxReplicas or a new toleration never reach the running RayCluster (the autoscaler
    stays capped; kuberay#4568). The chart hashes them into that group's pod template: the change goes through
    upgradeStrategy like any cluster change, and only that group's template differs."""
    base = one(objects(render({})), "RayService")
    changed = one(objects(render({role: change})), "RayService")
    assert kuberay_hashed_spec(changed) != kuberay_hashed_spec(base)
    for name, group in {g.get("groupName", "head"): g for g in groups_of(changed)}.items():
        before = {g.get("groupName", "head"): g for g in groups_of(base)}[name]
        same = group["template"]["metadata"] == before["template"]["metadata"]
        assert same is (name != role), name
    assert kuberay_problems(changed) == []


def test_serve_only_changes_keep_the_ray_cluster():
    base = kuberay_hashed_spec(one(objects(render({})), "RayService"))
    assert kuberay_hashed_spec(one(objects(render(SERVE_TWEAKS)), "RayService")) == base
    assert kuberay_hashed_spec(one(objects(render({"tls": {"enabled": True, "existingSecret": "t"}})),
                                   "RayService")) == base, "switching TLS replaces no cluster"


@pytest.mark.parametrize("role", ["verifier", "drafter"])
def test_a_budget_changes_with_its_pods(role):
    """A worker group's budget (minAvailable: pods.minReplicas) is never ahead of its pods: whatever changes it
    also changes what KubeRay hashes for that group, so the pods of the new bounds come with the same upgrade
    (with NewCluster both clusters' pods count towards it until the old one goes)."""
    def budget_and_group(values: dict) -> tuple[dict, dict]:
        objs = objects(render(values))
        budget = one(objs, "PodDisruptionBudget", f"-{role}")["spec"]
        (group,) = [g for g in kuberay_hashed_spec(one(objs, "RayService"))["workerGroupSpecs"]
                    if g["groupName"] == role]
        return budget, group

    base_budget, base_group = budget_and_group({})
    new_budget, new_group = budget_and_group({role: {"pods": {"minReplicas": 2, "maxReplicas": 8}}})
    assert new_budget["minAvailable"] == 1 != base_budget["minAvailable"]
    assert new_group != base_group


def kuberay_reconcile_serve_service(existing: dict | None, rs: dict, cluster: str) -> dict:
    """The serve Service after KubeRay points it at a ready `cluster` (rayservice_controller.go, reconcileServices;
    common/service.go, BuildServeService): created from spec.serveService with its metadata when absent; when
    present and its selector names another cluster, only its spec is replaced (clusterIP kept), metadata untouched;
    otherwise left alone. v1.6.0 to v1.7.0."""
    serve = json.loads(json.dumps(rs["spec"]["serveService"]))
    serve["spec"]["selector"] = {"ray.io/cluster": cluster, "ray.io/serve": "true"}
    if existing is None:
        return serve
    if existing["spec"]["selector"].get("ray.io/cluster") == cluster:
        return existing
    spec = dict(serve["spec"])
    if "clusterIP" in existing["spec"]:
        spec["clusterIP"] = existing["spec"]["clusterIP"]
    return {**existing, "spec": spec}


# The public Service chart 0.1.0 rendered (helm/templates/service-grpc.yaml at a17a396^, default values): Helm's,
# selecting every Ray pod of the release whose proxy KubeRay marked healthy, of any cluster.
SERVICE_0_1_0 = {
    "apiVersion": "v1", "kind": "Service",
    "metadata": {"name": "dflash-grpc",
                 "labels": {"app.kubernetes.io/managed-by": "Helm", "helm.sh/chart": "dflash-0.1.0"}},
    "spec": {"type": "ClusterIP", "clusterIP": "10.0.0.9",
             "selector": {"app.kubernetes.io/component": "ray", "app.kubernetes.io/instance": "dflash",
                          "app.kubernetes.io/name": "dflash", "ray.io/serve": "true"},
             "ports": [{"name": "serve-grpc", "port": 9000, "targetPort": "serve-grpc", "protocol": "TCP",
                        "appProtocol": "grpc"}]},
}


def selects(service: dict, pod_labels: dict) -> bool:
    return service["spec"]["selector"].items() <= pod_labels.items()


def test_the_0_1_0_service_is_handed_over_without_a_gap():
    """Upgrading from 0.1.0, Helm deletes its dflash-grpc Service, and KubeRay creates its serve Service only once
    the new cluster's applications run: minutes without the public Service. docs/kubernetes.md's procedure keeps
    Helm's Service (helm.sh/resource-policy=keep) pinned to the old cluster (ray.io/cluster); KubeRay then takes it
    over at the switch by name, keeping its address, because the chart's serve Service has 0.1.0's name and port."""
    rs = rayservice("default")
    new_head = {**groups("default")["head"]["template"]["metadata"]["labels"],
                "ray.io/cluster": "dflash-new", "ray.io/serve": "true"}  # labelled as soon as its proxy answers
    old_head = {**new_head, "ray.io/cluster": "dflash-old"}
    assert selects(SERVICE_0_1_0, new_head), "unpinned, 0.1.0's Service would send calls to the starting cluster"
    pinned = json.loads(json.dumps(SERVICE_0_1_0))
    pinned["spec"]["selector"]["ray.io/cluster"] = "dflash-old"
    assert selects(pinned, old_head) and not selects(pinned, new_head)
    switched = kuberay_reconcile_serve_service(pinned, rs, "dflash-new")
    assert switched["metadata"]["name"] == SERVICE_0_1_0["metadata"]["name"]
    assert switched["spec"]["clusterIP"] == "10.0.0.9"
    assert [(p["name"], p["port"]) for p in switched["spec"]["ports"]] == [("serve-grpc", 9000)]
    assert selects(switched, new_head) and not selects(switched, old_head)


def test_switching_tls_never_collides_with_kuberays_service():
    """KubeRay creates the serve Service under spec.serveService's name; Helm refuses to create an object of that
    name it does not own. The name is the same with TLS on or off (so no stale serve Service is left either way),
    and the chart never renders a Service of that name."""
    plain = objects(render({}))
    tls = objects(render({"tls": {"enabled": True, "existingSecret": "t"}}))
    serve_names = {one(objs, "RayService")["spec"]["serveService"]["metadata"]["name"] for objs in (plain, tls)}
    assert serve_names == {"dflash-grpc"}
    chart_services = {o["metadata"]["name"] for objs in (plain, tls) for o in objs if o["kind"] == "Service"}
    assert not serve_names & chart_services
    assert "dflash-grpc-tls" in chart_services


def notes(values: dict, **flags) -> str:
    with helm.Chart.load(str(CHART)) as chart:
        return chart.render(values, name="dflash", namespace="dflash", **flags)["dflash/templates/NOTES.txt"]


def test_service_type_and_annotations_reach_the_running_service():
    """KubeRay copies spec.serveService's annotations only when it creates the Service and replaces only its spec,
    only when it switches clusters (reconcileServices). The chart puts them on spec.serveService for a first
    creation, and on an upgrade NOTES print the kubectl commands that apply them to the running Service, which
    KubeRay keeps (it never writes an existing Service's metadata, nor its spec between switches)."""
    values = {"grpc": {"serviceType": "LoadBalancer",
                       "serviceAnnotations": {"service.beta.kubernetes.io/aws-load-balancer-type": "nlb"}}}
    serve = one(objects(render(values)), "RayService")["spec"]["serveService"]
    assert serve["metadata"]["annotations"] == values["grpc"]["serviceAnnotations"]
    assert serve["spec"]["type"] == "LoadBalancer"
    created = kuberay_reconcile_serve_service(None, {"spec": {"serveService": serve}}, "dflash-a")
    assert created["metadata"]["annotations"] == values["grpc"]["serviceAnnotations"]
    upgrade = notes(values, is_upgrade=True)
    assert """kubectl -n dflash patch service dflash-grpc -p '{"spec":{"type":"LoadBalancer"}}'""" in upgrade
    assert ("kubectl -n dflash annotate service dflash-grpc --overwrite "
            "'service.beta.kubernetes.io/aws-load-balancer-type=nlb'") in upgrade
    assert "patch service" not in notes(values, is_install=True)
    with_tls = notes({"tls": {"enabled": True, "existingSecret": "t"}, **values}, is_upgrade=True)
    assert """patch service dflash-grpc -p '{"spec":{"type":"ClusterIP"}}'""" in with_tls
    assert "annotate service dflash-grpc" not in with_tls  # with TLS they are on the front's Service, Helm's
    tls_objs = objects(render({"tls": {"enabled": True, "existingSecret": "t"}, **values}))
    tls_service = one(tls_objs, "Service", "-grpc-tls")
    assert tls_service["metadata"]["annotations"] == values["grpc"]["serviceAnnotations"]


# 6. A GPU pod never runs on the CPU -----------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_pods_with_gpus_stop_at_start_when_cuda_is_unusable(variant, monkeypatch):
    """`model.device: auto` means cuda on pods that requested GPUs (the chart sets DFLASH_MODEL__DEVICE
    there), so a node driver too old for the image's torch stops the replica with a message naming both,
    instead of it running on the CPU while holding the GPU. There is no GPU here: the CUDA probe is faked."""
    import torch
    from dflash import loading
    from dflash.errors import DFlashError
    from dflash.service.config import load_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(loading, "nvidia_driver_version", lambda: "470.82.01")
    args = serve_config(variant)["applications"][0]["args"]
    for name, group in groups(variant).items():
        container = group["template"]["spec"]["containers"][0]
        device = load_config(env=dflash_env(container), base=args).model.device
        if container["resources"].get("limits", {}).get("nvidia.com/gpu"):
            assert device == "cuda", name
            with pytest.raises(DFlashError, match=r"CUDA 12\.8.*525\.60\.13.*470\.82\.01"):
                loading.resolve_device(device)
        else:
            assert device == value(variant, "model.device") and loading.resolve_device(device).type == "cpu"


# 7. Group idle timeouts need autoscaler v2 ------------------------------------------------------------------

@pytest.mark.parametrize(("autoscaler", "per_group"), [({"version": "v2"}, True), ({"version": "v1"}, False),
                                                       ({"enabled": False}, False)], ids=["v2", "v1", "off"])
def test_group_idle_timeouts_only_with_autoscaler_v2(autoscaler, per_group):
    """KubeRay refuses a worker group's idleTimeoutSeconds unless autoscaler v2 is on (validation.go)."""
    rs = one(objects(render({"autoscaler": autoscaler})), "RayService")
    assert kuberay_problems(rs) == []
    for group in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        assert ("idleTimeoutSeconds" in group) is per_group
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


# 8. Disruptions: budgets, GCS fault tolerance, the model cache -------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_disruption_budgets(variant):
    """One budget per worker group, Redis and the TLS front, each selecting exactly its own pods. KubeRay's
    RayCluster has no scale subresource, so for Ray pods Kubernetes honours only an integer minAvailable
    (not maxUnavailable, whose eviction check needs the owner's scale). The default lets one pod of a group go
    at a time, so a group of one still drains: a budget allows currentHealthy - desiredHealthy disruptions
    (PodDisruptionBudgetStatus), so minAvailable equal to the group's pods allows none."""
    objs = variant_objects(variant)
    pods = {role: groups(variant)[role]["template"]["metadata"]["labels"] for role in ("verifier", "drafter")}
    if value(variant, "redis.mode") == "internal":
        pods["redis"] = one(objs, "StatefulSet")["spec"]["template"]["metadata"]["labels"]
    if value(variant, "tls.enabled"):
        pods["tls-front"] = one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    covered = {}
    for budget in (o for o in objs if o["kind"] == "PodDisruptionBudget"):
        selector = budget["spec"]["selector"]["matchLabels"]
        (name,) = [n for n, labels in pods.items() if selector.items() <= labels.items()]
        covered[name] = budget["spec"]
    assert set(covered) == set(pods)
    for role in ("verifier", "drafter"):
        group_min = value(variant, f"{role}.pods.minReplicas")
        assert covered[role]["minAvailable"] == max(0, group_min - 1)
        assert group_min - covered[role]["minAvailable"] >= 1, "a drain can take one pod of a full-size group"
        assert "maxUnavailable" not in covered[role] and covered[role]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


@pytest.mark.parametrize("variant", VARIANTS)
def test_gcs_state_lives_in_redis(variant):
    """With gcsFaultToleranceOptions the head keeps the cluster's state in Redis: a restarted head resumes
    it and the worker pods (the GPUs, the loaded models) keep serving meanwhile."""
    objs = variant_objects(variant)
    rs = one(objs, "RayService")
    options = rs["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    if value(variant, "redis.mode") == "internal":
        assert options["redisAddress"] == f"{one(objs, 'Service', '-redis')['metadata']['name']}:6379"
        assert options["redisPassword"]["valueFrom"]["secretKeyRef"] == {
            "name": one(objs, "Secret", "-redis")["metadata"]["name"], "key": value(variant, "redis.auth.key")}
    else:
        external = value(variant, "gcsFaultTolerance.external")
        assert options["redisAddress"] == external["address"]
        assert options["redisPassword"]["valueFrom"]["secretKeyRef"]["name"] == external["passwordSecret"]["name"]
    assert kuberay_problems(rs) == []


def test_gcs_fault_tolerance_can_be_turned_off():
    rs = one(objects(render({"gcsFaultTolerance": {"enabled": False}})), "RayService")
    assert "gcsFaultToleranceOptions" not in rs["spec"]["rayClusterConfig"]


def quantity(text) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    match = re.fullmatch(r"([\d.]+)([A-Za-z]*)", str(text))
    return float(match.group(1)) * units.get(match.group(2), 1)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_object_store_stays_in_dev_shm(variant, monkeypatch, tmp_path):
    """Each Ray pod mounts the chart's /dev/shm (so KubeRay adds none of its own, sized to the memory:
    common/pod.go, addEmptyDir). Left unset, Ray sizes its object store at 30% of the container's memory, capped
    at 10 GB (resolve_object_store_memory), more than that /dev/shm, and puts it in /tmp
    (determine_plasma_store_config). The chart sets object-store-memory to four fifths of the volume, which
    Ray's own code, reading that volume's size, places in /dev/shm. Ray 2.60."""
    import ray._common.utils
    import ray._private.utils
    from ray._private.services import determine_plasma_store_config

    fell_back = []
    for name, group in groups(variant).items():
        spec = group["template"]["spec"]
        shm = quantity(next(v for v in spec["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"])
        memory = quantity(spec["containers"][0]["resources"]["limits"]["memory"])
        monkeypatch.setattr(ray._private.utils, "get_shared_memory_bytes", lambda shm=shm: int(shm))
        monkeypatch.setattr(ray._common.utils, "get_system_memory", lambda memory=memory: int(memory))
        store = int(group["rayStartParams"]["object-store-memory"])
        assert store == int(shm * 0.8), name
        assert determine_plasma_store_config(store, str(tmp_path))[0] == "/dev/shm", name
        unset = ray._private.utils.resolve_object_store_memory(int(memory))
        fell_back.append(determine_plasma_store_config(unset, str(tmp_path))[0] == str(tmp_path))
    if variant == "default":
        assert all(fell_back), "the chart's defaults without object-store-memory: every store in /tmp"


@pytest.mark.parametrize("variant", VARIANTS)
def test_gpu_pods_are_guaranteed(variant):
    """Kubernetes gives a pod the Guaranteed QoS class only when every container, init containers too, has cpu
    and memory limits equal to its requests; the fetch-models init container's made GPU pods Burstable."""
    for name, group in groups(variant).items():
        spec = group["template"]["spec"]
        if "nvidia.com/gpu" not in spec["containers"][0]["resources"].get("limits", {}):
            continue
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            res = container["resources"]
            for kind in ("cpu", "memory"):
                assert quantity(res["requests"][kind]) == quantity(res["limits"][kind]), (name, container["name"], kind)


def test_drafter_pods_fit_an_8_vcpu_32_gib_l4_machine():
    """g6.2xlarge and g2-standard-8: 8 vCPU, 32 GiB, less the kubelet's reservations (about 2 GiB there);
    the drafter's requests (the Ray container's, which exceed the init container's) leave room for them."""
    spec = groups("default")["drafter"]["template"]["spec"]
    requests = spec["containers"][0]["resources"]["requests"]
    assert quantity(requests["cpu"]) <= 7 and quantity(requests["memory"]) <= 28 * 2**30
    assert value("external-redis", "drafter.pods.nodeSelector")["node.kubernetes.io/instance-type"] == "g6.2xlarge"


@pytest.mark.parametrize("variant", VARIANTS)
def test_downloaded_models_are_kept_or_their_disk_is_requested(variant):
    """A hub download lands on a persistent claim (a replaced pod finds the files), or on an emptyDir
    whose size the pod requests as ephemeral storage, so the scheduler places it where the disk is."""
    for role in ("verifier", "drafter"):
        spec = groups(variant)[role]["template"]["spec"]
        models = {v["name"]: v for v in spec["volumes"]}.get("models", {})
        requests = spec["containers"][0]["resources"]["requests"]
        if "emptyDir" in models:
            assert quantity(requests["ephemeral-storage"]) >= quantity(models["emptyDir"]["sizeLimit"])
        else:
            assert "ephemeral-storage" not in requests


def test_the_chart_can_create_the_model_cache_claim():
    objs = objects(render({"model": {"hub": {"cache": {"create": True, "storageClass": "nfs", "size": "100Gi"}}}}))
    pvc = one(objs, "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"] and pvc["spec"]["storageClassName"] == "nfs"
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep", "uninstall keeps the downloads"
    for group in one(objs, "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        volumes = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
        assert volumes["models"]["persistentVolumeClaim"] == {"claimName": pvc["metadata"]["name"]}


# Minor: the images KubeRay starts, the files the values name ---------------------------------------------

def test_ray_stays_on_path_in_a_login_shell():
    """KubeRay starts Ray with `bash -lc` when the operator runs with ENABLE_LOGIN_SHELL=true
    (utils.GetContainerCommand); Debian's /etc/profile then resets PATH, so each image puts its
    virtualenv back on it from /etc/profile.d."""
    for dockerfile in sorted((REPO / "docker").glob("Dockerfile.*")):
        runtime = re.sub(r"\\\n", " ", dockerfile.read_text().split(" AS runtime", 1)[1])
        profile = [line for line in runtime.splitlines() if line.startswith("RUN") and "/etc/profile.d/" in line]
        assert [line for line in profile if "/opt/venv/bin" in line], \
            f"{dockerfile.name}: no /etc/profile.d script puts the venv on PATH"


def test_files_the_values_point_to_exist():
    text = (CHART / "values.yaml").read_text() + (CHART / "Chart.yaml").read_text()
    paths = set(re.findall(r"\b((?:docker|docs|helm|k8s)/[\w./-]*\w)", text))
    assert "docker/README.md" in paths
    assert [p for p in paths if not (REPO / p).exists()] == []


# --- TLS, names, labels, security, Redis, models ------------------------------------------------------

def test_tls_front_serves_the_public_port():
    """tls.enabled: a tls-front Deployment (same image) serves the TLS port with the Secret mounted
    read-only and forwards to KubeRay's serve Service; the public Service and the helm test pod use its
    port; its command line is one `dflash` parses. No Ray pod carries a sidecar."""
    from dflash.cli import build_parser

    values = variant_values("tls")
    objs = variant_objects("tls")
    rs = one(objs, "RayService")
    assert all(len(g["template"]["spec"]["containers"]) == 1 for g in groups_of(rs))
    deployment = one(objs, "Deployment", "-tls-front")
    assert deployment["spec"]["replicas"] == value("tls", "tls.replicas") >= 2
    spec = deployment["spec"]["template"]["spec"]
    (front,) = spec["containers"]
    assert front["image"] == groups("tls")["head"]["template"]["spec"]["containers"][0]["image"]
    args = build_parser().parse_args(front["command"][1:] + front["args"])
    grpc_port = serve_config("tls")["grpc_options"]["port"]
    upstream = f"{rs['spec']['serveService']['metadata']['name']}:{grpc_port}"
    assert (args.listen, args.upstream) == ("0.0.0.0:9443", upstream) and not args.client_ca
    assert {p["name"]: p["containerPort"] for p in front["ports"]} == {"grpc-tls": 9443}
    (mount,) = front["volumeMounts"]
    assert mount["readOnly"] is True
    assert args.cert == f"{mount['mountPath']}/tls.crt" and args.key == f"{mount['mountPath']}/tls.key"
    volume = {v["name"]: v for v in spec["volumes"]}[mount["name"]]
    assert volume["secret"]["secretName"] == values["tls"]["existingSecret"] == "dflash-tls"
    svc = one(objs, "Service", "-grpc-tls")
    assert svc["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert svc["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    (port,) = svc["spec"]["ports"]
    assert (port["name"], port["port"], port["targetPort"]) == ("grpc-tls", 9443, "grpc-tls")
    env = env_of(one(objs, "Pod")["spec"]["containers"][0])
    assert env["TARGET"]["value"] == f"{svc['metadata']['name']}:9443"
    assert env["TLS_SERVER_NAME"]["value"] == "dflash.example.com"
    notes = render(values)["dflash/templates/NOTES.txt"]
    assert "grpcurl -cacert ca.crt -authority dflash.example.com" in notes and "-plaintext" not in notes


def test_tls_client_auth_passes_the_secrets_ca():
    objs = objects(render({"tls": {"enabled": True, "existingSecret": "t", "clientAuth": True, "port": 8443}}))
    (front,) = one(objs, "Deployment", "-tls-front")["spec"]["template"]["spec"]["containers"]
    assert "--client-ca=/etc/dflash/tls/ca.crt" in front["args"] and "--listen=0.0.0.0:8443" in front["args"]


def test_names_fit_kuberay_limits():
    long_release = "a-very-long-release-name-for-a-customer-cluster-prod"
    objs = objects(render({}, release=long_release))
    rs = one(objs, "RayService")
    name = rs["metadata"]["name"]
    assert len(name) <= 47 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name)
    assert len(name + "-serve-svc") <= 63  # the Service KubeRay derives from it
    assert len(rs["spec"]["serveService"]["metadata"]["name"]) <= 63
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
    # every step durable before it is streamed, as the embedded redis-server of `dflash serve`
    assert f"--appendfsync {value(variant, 'redis.appendfsync')}" in container["args"][0]
    assert value(variant, "redis.appendfsync") == "always"
    assert "$REDIS_PASSWORD" in container["args"][0] and "requirepass" in container["args"][0]
    secret_ref = env_of(container)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert secret_ref["name"] == one(objs, "Secret", "-redis")["metadata"]["name"]
    assert "ping" in " ".join(container["readinessProbe"]["exec"]["command"])
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert {"name": "data", "mountPath": "/data"} in container["volumeMounts"]
    secret = env["SESSIONS_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert secret["name"] == one(objs, "Secret", "-redis")["metadata"]["name"]
    assert env["DFLASH_REDIS__URL"]["value"].startswith("redis://:$(SESSIONS_REDIS_PASSWORD)@")


@pytest.mark.parametrize("variant", VARIANTS)
def test_model_sources(variant):
    source = value(variant, "model.source")
    args = serve_config(variant)["applications"][0]["args"]["model"]
    for role in ("verifier", "drafter"):
        spec = groups(variant)[role]["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        if source == "hub":
            (init,) = spec["initContainers"]
            assert args["target"] == "/models/target" and args["drafter"] == "/models/drafter"
            assert "snapshot_download" in init["args"][0]
            claim = value(variant, "model.hub.cache.claimName")
            if claim:
                assert volumes["models"]["persistentVolumeClaim"] == {"claimName": claim}
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
    """Clients reach one port: the Ray pods' gRPC port, or with TLS only the TLS front's port (the Ray
    pods' gRPC port then admits the front alone). Only Ray pods reach Redis."""
    objs = variant_objects(variant)
    ray = one(objs, "NetworkPolicy", "-ray")
    ray_open = [r for r in ray["spec"]["ingress"] if "from" not in r]
    if value(variant, "tls.enabled"):
        front = one(objs, "NetworkPolicy", "-tls-front")
        assert ([r for r in front["spec"]["ingress"] if "from" not in r]
                == [{"ports": [{"port": "grpc-tls", "protocol": "TCP"}]}])
        assert ray_open == [{"ports": [{"port": 8000, "protocol": "TCP"}]}], "the HTTP API: plaintext, beside the front"
        (rule,) = [r for r in ray["spec"]["ingress"] if r.get("ports") == [{"port": "serve-grpc", "protocol": "TCP"}]]
        (peer,) = rule["from"]
        assert peer["podSelector"]["matchLabels"] == front["spec"]["podSelector"]["matchLabels"]
    else:
        assert ray_open == [{"ports": [{"port": "serve-grpc", "protocol": "TCP"}]},
                            {"ports": [{"port": 8000, "protocol": "TCP"}]}], "only gRPC and HTTP are open to all"
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
    assert env["TARGET"]["value"] == f"{public_grpc_service('gpu-split')}:9000"
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
    # KubeRay's incremental upgrade shifts traffic with a Gateway HTTPRoute to the HTTP port; gRPC never uses it.
    ({"upgradeStrategy": "NewClusterWithIncrementalUpgrade"}, "/upgradeStrategy"),
    ({"verifier": {"pods": {"disruptionBudget": {"minAvailable": "50%"}}}},
     "/verifier/pods/disruptionBudget/minAvailable"),
    ({"networkPolicy": {"operator": {"namespace": ""}}}, "/networkPolicy/operator/namespace"),
    ({"drafter": {"net": {"auth": {"key": ""}}}}, "/drafter/net/auth/key"),
    ({"drafter": {"net": {"auth": {"existingSecret": "Drafter_Token"}}}}, "/drafter/net/auth/existingSecret"),
    ({"drafter": {"net": {"tls": {"existingSecret": "t", "serverName": "bad name"}}}}, "/drafter/net/tls/serverName"),
    ({"drafter": {"net": {"tls": {"enabled": True}}}}, "enabled"),
    ({"grpc": {"reflection": "yes"}}, "/grpc/reflection"),
    ({"openai": {"serviceType": "ExternalName"}}, "/openai/serviceType"),
    ({"openai": {"port": 0}}, "/openai/port"),
    ({"limits": {"maxPromptChars": 0}}, "/limits/maxPromptChars"),
    ({"workerNiceness": 20}, "/workerNiceness"),
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
    # Across fields, which JSON Schema cannot compare (values.schema.json says so in its $comment):
    ({"verifier": {"pods": {"minReplicas": 5}}},
     "verifier.pods.minReplicas (5) is above verifier.pods.maxReplicas (4)"),
    ({"drafter": {"autoscaling": {"minReplicas": 9}}},
     "drafter.autoscaling.minReplicas (9) is above drafter.autoscaling.maxReplicas (8)"),
    ({"ingress": {"autoscaling": {"minReplicas": 3}}},
     "ingress.autoscaling.minReplicas (3) is above ingress.autoscaling.maxReplicas (2)"),
    ({"verifier": {"autoscaling": {"maxReplicas": 6}}},
     "verifier.autoscaling.maxReplicas (6) replicas need more than verifier.pods.maxReplicas (4) pods"),
    ({"ingress": {"autoscaling": {"maxReplicas": 5}}},
     "ingress.autoscaling.maxReplicas (5) is above head.maxIngressReplicas (4)"),
    ({"redis": {"mode": "external", "external": {"existingSecret": "url"}}}, "gcsFaultTolerance.external.address"),
    ({"model": {"hub": {"cache": {"create": True, "claimName": "mine"}}}}, "model.hub.cache: claimName or create"),
    ({"drafter": {"net": {"tls": {"existingSecret": "drafter-tls"}}}},
     "drafter.net.tls.existingSecret needs drafter.net.tls.serverName"),
    ({"drafter": {"net": {"tls": {"serverName": "drafter.internal"}}}},
     "drafter.net.tls.serverName is only used with drafter.net.tls.existingSecret"),
    ({"verifier": {"pods": {"shmSize": "80Gi"}}},
     "verifier.pods.shmSize (80Gi) is above the container's memory limit (64Gi)"),
    ({"head": {"shmSize": "2Pi"}}, '"2Pi": use a number of bytes'),
])
def test_inconsistent_values_fail_with_a_message(values, message):
    with pytest.raises(helm.HelmError, match=re.escape(message)):
        render(values)


def test_schema_says_where_cross_field_checks_live():
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert "dflash.validate" in schema["$comment"]


# 9. The internal Drafter API: a shared token from a Secret, optional mutual TLS ----------------------------

DRAFTER_TLS_DIR = "/etc/dflash/drafter-tls"


def secret_value(secret: dict, key: str) -> str:
    import base64

    return base64.b64decode(secret["data"][key]).decode()


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_drafter_token_reaches_the_verifier_and_the_drafters(variant):
    """Drafter replicas refuse calls without drafter_net.token and the verifier sends it, so both get it,
    from the same Secret (drafter.net.auth.existingSecret, or one the chart generates). The head (ingress,
    Serve controller) never calls a drafter and does not get it."""
    from dflash.service.config import load_config

    objs = variant_objects(variant)
    auth = value(variant, "drafter.net.auth")
    if auth["existingSecret"]:
        name = auth["existingSecret"]
        assert not [o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"] == name]
    else:
        secret = one(objs, "Secret", "-drafter-auth")
        name = secret["metadata"]["name"]
        assert secret["type"] == "Opaque" and set(secret["data"]) == {auth["key"]}
        token = secret_value(secret, auth["key"])
        assert len(token) >= 32 and token.isalnum()
    g = groups(variant)
    args = serve_config(variant)["applications"][0]["args"]
    assert "token" not in args["drafter_net"]
    for role, group in g.items():
        container = group["template"]["spec"]["containers"][0]
        env = env_of(container)
        if role == "head":
            assert "DFLASH_DRAFTER_NET__TOKEN" not in env
            continue
        assert env["DFLASH_DRAFTER_NET__TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": name, "key": auth["key"]}
        assert load_config(env=dflash_env(container), base=args).drafter_net.token == "from-a-secret"


def chart_with_existing_secrets(tmp_path: Path, kept: dict[str, str]) -> Path:
    """A copy of the chart whose `lookup` of a Secret finds one holding `kept` (key -> value), as on a
    cluster where the release is installed; rendering offline, lookup finds nothing."""
    import base64

    chart = tmp_path / "dflash"
    shutil.copytree(CHART, chart)
    data = " ".join(f'"{k}" "{base64.b64encode(v.encode()).decode()}"' for k, v in kept.items())
    for template in ("redis.yaml", "drafter-auth.yaml"):
        path = chart / "templates" / template
        text = path.read_text()
        assert text.count('lookup "v1" "Secret" .Release.Namespace $name') == 1, template
        path.write_text(text.replace('lookup "v1" "Secret" .Release.Namespace $name', f'dict "data" (dict {data})'))
    return chart


def test_generated_secrets_are_kept_across_upgrades(tmp_path):
    """The Drafter API's token and the Redis password the chart generates are read back from the installed
    Secret on an upgrade (lookup), as a `helm upgrade` renders them: a new token would lock the running
    verifier out of drafter replicas started with the old one."""
    chart = chart_with_existing_secrets(tmp_path, {"token": "kept-drafter-token", "redis-password": "kept-password"})
    with helm.Chart.load(str(chart)) as c:
        objs = objects(c.render({}, name="dflash", namespace="dflash", is_upgrade=True))
    assert secret_value(one(objs, "Secret", "-drafter-auth"), "token") == "kept-drafter-token"
    assert secret_value(one(objs, "Secret", "-redis"), "redis-password") == "kept-password"
    # A fresh install (nothing to look up) gets new random ones.
    first, second = (one(objects(render({})), "Secret", "-drafter-auth") for _ in range(2))
    assert secret_value(first, "token") != secret_value(second, "token")


def test_secret_values_appear_only_in_secrets():
    """The token and password the chart generates, and nothing of a Secret the user names, appear in no
    rendered object but their own Secret (nor in NOTES): pods read them through secretKeyRef."""
    import base64

    for values in ({}, variant_values("gpu-split"), variant_values("drafter-mtls")):
        rendered = render(values)
        objs = objects(rendered)
        secrets = [o for o in objs if o["kind"] == "Secret"]
        plain = [secret_value(s, k) for s in secrets for k in s["data"]]
        assert all(len(p) >= 32 for p in plain)
        needles = plain + [base64.b64encode(p.encode()).decode() for p in plain]
        for obj in objs:
            if obj["kind"] == "Secret":
                continue
            text = yaml.safe_dump(obj) + json.dumps(obj)
            if obj["kind"] == "RayService":  # the Serve config is a YAML string inside it: read it too
                text += json.dumps(yaml.safe_load(obj["spec"]["serveConfigV2"]))
            assert not [n for n in needles if n in text], f"{obj['kind']}/{obj['metadata']['name']} holds a secret"
        assert not [n for n in needles if n in rendered["dflash/templates/NOTES.txt"]]
        # Every env value that names a token or password comes from a Secret, never inline.
        for obj in objs:
            for spec in pod_specs(obj):
                for c in spec.get("initContainers", []) + spec["containers"]:
                    for e in c.get("env", []):
                        if re.search(r"(^|_)(TOKEN|PASSWORD)$", e["name"]) and "value" in e:
                            pytest.fail(f"{c['name']}: {e['name']} is inline")


@pytest.mark.parametrize("variant", VARIANTS)
def test_drafter_mutual_tls(variant):
    """drafter.net.tls.existingSecret: its tls.crt, tls.key and ca.crt are mounted read-only on the verifier
    and drafter pods (a missing key stops the pod at mount), and the DFLASH_DRAFTER_NET__TLS_* variables
    name those files and the fixed name replicas' certificates are checked against (they advertise pod
    IPs). The service's config reads them as mutual TLS. The head gets none of it."""
    from dflash.service.config import load_config

    tls = value(variant, "drafter.net.tls")
    args = serve_config(variant)["applications"][0]["args"]
    for role, group in groups(variant).items():
        spec = group["template"]["spec"]
        (container,) = spec["containers"]
        env = env_of(container)
        tls_env = {k: e["value"] for k, e in env.items() if k.startswith("DFLASH_DRAFTER_NET__TLS_")}
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        if role == "head" or not tls["existingSecret"]:
            assert tls_env == {} and "drafter-tls" not in volumes and "drafter-tls" not in mounts
            assert not load_config(env=dflash_env(container), base=args).drafter_net.tls
            continue
        secret = volumes["drafter-tls"]["secret"]
        assert secret["secretName"] == tls["existingSecret"]
        assert sorted(i["key"] for i in secret["items"]) == ["ca.crt", "tls.crt", "tls.key"]
        assert all(i["key"] == i["path"] for i in secret["items"]) and secret["defaultMode"] == 0o440
        mount = mounts["drafter-tls"]
        assert mount["readOnly"] is True and mount["mountPath"] == DRAFTER_TLS_DIR
        assert tls_env == {"DFLASH_DRAFTER_NET__TLS_CERT_FILE": f"{DRAFTER_TLS_DIR}/tls.crt",
                           "DFLASH_DRAFTER_NET__TLS_KEY_FILE": f"{DRAFTER_TLS_DIR}/tls.key",
                           "DFLASH_DRAFTER_NET__TLS_CA_FILE": f"{DRAFTER_TLS_DIR}/ca.crt",
                           "DFLASH_DRAFTER_NET__TLS_SERVER_NAME": tls["serverName"]}
        net = load_config(env=dflash_env(container), base=args).drafter_net
        assert net.tls and net.tls_server_name == tls["serverName"] == "drafter.dflash.internal"


def test_a_ci_variant_locks_the_drafter_api_down():
    """helm/ci/drafter-mtls-values.yaml renders the token from an existing Secret, mutual TLS and reflection off."""
    assert value("drafter-mtls", "drafter.net.auth.existingSecret") == "dflash-drafter-auth"
    assert value("drafter-mtls", "drafter.net.tls.existingSecret") and value("drafter-mtls", "grpc.reflection") is False
    secrets = [o["metadata"]["name"] for o in variant_objects("drafter-mtls") if o["kind"] == "Secret"]
    assert not [name for name in secrets if "drafter" in name]


# Second review (issue 36), 7: GPU nodes without GPU Feature Discovery ------------------------------------------

def test_gpu_groups_need_no_gpu_feature_discovery():
    """nvidia.com/gpu.product exists only where GPU Feature Discovery runs, and clouds label GPU nodes their own
    way: by default the GPU groups select no node label. Their nvidia.com/gpu request already limits them to
    nodes whose device plugin offers GPUs; NOTES and docs/kubernetes.md say how to pin each group per cloud."""
    objs = variant_objects("default")
    for obj in objs:
        for spec in pod_specs(obj):
            assert "nodeSelector" not in spec and "affinity" not in spec, obj["metadata"]["name"]
    for role in ("verifier", "drafter"):
        resources = groups("default")[role]["template"]["spec"]["containers"][0]["resources"]
        assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] >= 1
    text = render({})["dflash/templates/NOTES.txt"]
    assert "verifier.pods.nodeSelector and drafter.pods.nodeSelector" in text
    pinned = {"verifier": {"pods": {"nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}}},
              "drafter": {"pods": {"nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-l4"}}}}
    assert "nodeSelector" not in render(pinned)["dflash/templates/NOTES.txt"]
    assert "nodeSelector" not in render(variant_values("cpu-demo"))["dflash/templates/NOTES.txt"]  # no GPUs asked
    docs = (REPO / "docs" / "kubernetes.md").read_text()
    for label in ("cloud.google.com/gke-accelerator", "node.kubernetes.io/instance-type",
                  "karpenter.k8s.aws/instance-gpu-name", "kubernetes.azure.com/agentpool", "nvidia.com/gpu.product"):
        assert f"`{label}" in docs, label


# Second review (issue 36), 10: image pull secrets, Redis's governing Service, spreading, Ray resources ----------

def test_every_pod_gets_the_image_pull_secrets():
    """Redis's pod too: a cluster that pulls only from a private mirror needs the secret for redis:* as well."""
    secrets = [{"name": "regcred"}]
    values = {"imagePullSecrets": secrets, "tls": {"enabled": True, "existingSecret": "tls"}}
    templates = [t for o in objects(render(values)) for t in pod_templates(o)]
    kinds = {o["kind"] for o in objects(render(values)) if pod_templates(o)}
    assert kinds == {"RayService", "StatefulSet", "Deployment", "Pod"}
    assert [t["spec"].get("imagePullSecrets") for t in templates] == [secrets] * len(templates)


@pytest.mark.parametrize("variant", VARIANTS)
def test_redis_statefulset_is_governed_by_a_headless_service(variant):
    """A StatefulSet's serviceName must name a headless Service (clusterIP None) selecting its pods: that Service
    gives each pod its DNS name. Clients keep the ClusterIP Service <full>-redis."""
    if value(variant, "redis.mode") != "internal":
        return
    objs = variant_objects(variant)
    sts = one(objs, "StatefulSet", "-redis")
    governing = one(objs, "Service", sts["spec"]["serviceName"])
    assert governing["metadata"]["name"] == sts["spec"]["serviceName"] == f"{sts['metadata']['name']}-headless"
    assert governing["spec"]["clusterIP"] == "None"
    assert selects(governing, sts["spec"]["template"]["metadata"]["labels"])
    client = one(objs, "Service", "-redis")
    assert "clusterIP" not in client["spec"] and client["spec"]["type"] == "ClusterIP"
    assert env_of(groups(variant)["verifier"]["template"]["spec"]["containers"][0])["DFLASH_REDIS__URL"]["value"] \
        .endswith(f"@{client['metadata']['name']}:6379/0")


REDIS_LOOKUP = 'lookup "apps/v1" "StatefulSet" .Release.Namespace $name'


def chart_with_installed_redis(tmp_path: Path, service_name: str, size: str, storage_class: str | None = None) -> Path:
    """A copy of the chart whose `lookup` of the Redis StatefulSet finds one, as the API server returns it on an
    upgrade; rendering offline, lookup finds nothing."""
    chart = tmp_path / "dflash"
    shutil.copytree(CHART, chart)
    path = chart / "templates" / "redis.yaml"
    text = path.read_text()
    assert text.count(REDIS_LOOKUP) == 1
    claim_spec = f'"resources" (dict "requests" (dict "storage" "{size}"))'
    if storage_class is not None:
        claim_spec += f' "storageClassName" "{storage_class}"'
    live = (f'dict "spec" (dict "serviceName" "{service_name}" "volumeClaimTemplates" '
            f'(list (dict "metadata" (dict "name" "data") "spec" (dict {claim_spec}))))')
    path.write_text(text.replace(REDIS_LOOKUP, live))
    return chart


def render_upgrade(chart: Path, values: dict) -> list[dict]:
    with helm.Chart.load(str(chart)) as c:
        return objects(c.render(values, name="dflash", namespace="dflash", is_upgrade=True))


def test_redis_upgrade_keeps_what_a_statefulset_cannot_change(tmp_path):
    """Kubernetes refuses any update of a StatefulSet's serviceName or volumeClaimTemplates (ValidateStatefulSetUpdate:
    "updates to statefulset spec for fields other than 'replicas', ..., 'template', 'updateStrategy', ... are
    forbidden"). An installed release keeps its serviceName (0.1.0 named the ClusterIP Service); a changed
    persistence size or class fails the render with the way out instead of failing in the API server mid-upgrade."""
    chart = chart_with_installed_redis(tmp_path, "dflash-redis", "4Gi")
    sts = one(render_upgrade(chart, {}), "StatefulSet", "-redis")
    assert sts["spec"]["serviceName"] == "dflash-redis"
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "4Gi"
    # The same size written another way is no change.
    assert one(render_upgrade(chart, {"redis": {"persistence": {"size": "4096Mi"}}}), "StatefulSet", "-redis")
    with pytest.raises(helm.HelmError, match=re.escape(
            "redis.persistence.size 8Gi differs from the installed StatefulSet dflash-redis's 4Gi")):
        render_upgrade(chart, {"redis": {"persistence": {"size": "8Gi"}}})
    with pytest.raises(helm.HelmError, match=re.escape('redis.persistence.storageClass "fast" differs')):
        render_upgrade(chart, {"redis": {"persistence": {"storageClass": "fast"}}})
    classed = chart_with_installed_redis(tmp_path / "classed", "dflash-redis-headless", "4Gi", "fast")
    assert one(render_upgrade(classed, {"redis": {"persistence": {"storageClass": "fast"}}}),
               "StatefulSet", "-redis")["spec"]["serviceName"] == "dflash-redis-headless"
    docs = (REPO / "docs" / "kubernetes.md").read_text()
    assert "### Redis's volume" in docs and "--cascade=orphan" in docs


def spread_pods(variant: str) -> dict[str, tuple[dict, dict]]:
    """Pods that run as several replicas: name -> (pod spec, pod labels)."""
    g = groups(variant)
    out = {role: (g[role]["template"]["spec"], g[role]["template"]["metadata"]["labels"])
           for role in ("verifier", "drafter") if role in g}
    if value(variant, "tls.enabled"):
        front = one(variant_objects(variant), "Deployment", "-tls-front")["spec"]["template"]
        out["tls-front"] = (front["spec"], front["metadata"]["labels"])
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_replicas_spread_over_nodes(variant):
    """By default each worker group's pods, and the TLS front's, carry a soft topology spread over nodes whose
    selector counts exactly that group's pods: a node's loss takes fewer verifiers at once, and a pod still
    schedules when the nodes cannot be evened out (ScheduleAnyway). KubeRay copies the pod template's spec into
    each pod as is (common/pod.go, DefaultWorkerPodTemplate); it sets no spread or affinity of its own."""
    pods = spread_pods(variant)
    others = {name: labels for name, (_, labels) in pods.items()}
    others["head"] = groups(variant)["head"]["template"]["metadata"]["labels"]
    for name, (spec, _labels) in pods.items():
        (constraint,) = spec["topologySpreadConstraints"]
        assert constraint["topologyKey"] == "kubernetes.io/hostname" and constraint["maxSkew"] == 1
        assert constraint["whenUnsatisfiable"] == "ScheduleAnyway"
        selector = constraint["labelSelector"]["matchLabels"]
        assert [n for n, pod_labels in others.items() if selector.items() <= pod_labels.items()] == [name]
    assert "topologySpreadConstraints" not in groups(variant)["head"]["template"]["spec"]


def test_spreading_is_configurable():
    zone = {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "DoNotSchedule"}
    mine = {**zone, "labelSelector": {"matchLabels": {"team": "a"}}}
    objs = objects(render({"verifier": {"pods": {"topologySpreadConstraints": [zone]}},
                           "drafter": {"pods": {"topologySpreadConstraints": []}},
                           "tls": {"enabled": True, "existingSecret": "tls", "topologySpreadConstraints": [mine]}}))
    g = {grp.get("groupName", "head"): grp["template"] for grp in groups_of(one(objs, "RayService"))}
    (verifier,) = g["verifier"]["spec"]["topologySpreadConstraints"]
    assert verifier == {**zone, "labelSelector": {"matchLabels": {
        k: g["verifier"]["metadata"]["labels"][k] for k in verifier["labelSelector"]["matchLabels"]}}}
    assert verifier["labelSelector"]["matchLabels"]["dflash.dev/role"] == "verifier"
    assert "topologySpreadConstraints" not in g["drafter"]["spec"]
    assert one(objs, "Deployment", "-tls-front")["spec"]["template"]["spec"]["topologySpreadConstraints"] == [mine]
    with pytest.raises(helm.HelmValuesError, match="whenUnsatisfiable"):
        render({"verifier": {"pods": {"topologySpreadConstraints": [{**zone, "whenUnsatisfiable": "Maybe"}]}}})


def kuberay_start_flag(params: dict, option: str) -> str:
    """The flag KubeRay writes into the Ray container's command (common/pod.go, convertParamMap: " --%s=%s ")."""
    return f" --{option}={params[option]} "


@pytest.mark.parametrize("variant", VARIANTS)
def test_kuberay_parses_the_resources_param(variant):
    """Each group's rayStartParams "resources" is the form KubeRay writes itself ('<json>'): KubeRay parses it
    (getResourcesMap, restated in kuberay_resources_map), Ray's autoscaler reads the same resources from the
    RayCluster (autoscaling_config._get_custom_resources), and bash, which runs KubeRay's `ray start` line
    (/bin/bash -lc), passes Ray's CLI the JSON it parses (parse_resources_json). Ray 2.60, KubeRay v1.6.0 to v1.7.0."""
    import subprocess

    from ray._private.utils import parse_resources_json
    from ray.autoscaler._private.kuberay.autoscaling_config import _get_custom_resources

    for name, group in groups(variant).items():
        params = group["rayStartParams"]
        kuberay = kuberay_resources_map(params)
        assert kuberay and set(kuberay) == {value(variant, "ingress.rayResource" if name == "head"
                                                  else f"{name}.rayResource")}
        assert {k: float(v) for k, v in _get_custom_resources({}, params, name).items()} == kuberay
        word = subprocess.run(["bash", "-c", f"printf '%s\\n'{kuberay_start_flag(params, 'resources')}"],
                              capture_output=True, text=True, check=True).stdout.strip()
        assert word.startswith("--resources=")
        assert parse_resources_json(word.removeprefix("--resources="), None, None) == kuberay


def test_the_old_resources_form_failed_kuberays_parser():
    """The chart rendered "{\\"name\\": n}" until now (backslash-escaped, in double quotes), which Ray's autoscaler
    reads but KubeRay's getResourcesMap cannot: after trimming the quotes the backslashes stay, and json.Unmarshal
    fails."""
    with pytest.raises(json.JSONDecodeError):
        kuberay_resources_map({"resources": '"{\\"dflash_verifier\\": 1}"'})
