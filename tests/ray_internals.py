"""Every private Ray API the tests read, in one place (read against Ray 2.60).

Each function names the Ray file it reads and why no public API does its job. Where a public one exists
the tests use it instead: ray.serve.schema and ray.serve.config to validate Serve configs,
AutoscalingPolicy.get_policy() for a policy, pkgutil.resolve_name for Serve's import paths ("module:attr"
or "module.attr", as Ray's import_attr takes them). A Ray upgrade that moves one of these breaks here.
Ray is imported inside each function: the chart tests import this module without needing Ray to start.
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable


def build_application(app: dict):
    """The deployment graph Serve's controller builds for one `applications:` entry of a Serve config, with
    no cluster and no model loaded: the builder at `import_path` called with `args` (checked as Serve checks
    them), flattened into a BuiltApplication (`.deployments`, `.ingress_deployment_name`).

    Reads ray/serve/_private/api.py (call_user_app_builder_with_args_if_necessary) and
    ray/serve/_private/build_app.py (build_app), the two calls of build_serve_application in
    ray/serve/_private/application_state.py. Public Serve builds a graph only while deploying it
    (serve.run, `serve deploy`: a running cluster, models loaded), and `serve build` takes an
    Application, not a builder with args."""
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.build_app import build_app

    builder = pkgutil.resolve_name(app["import_path"])
    return build_app(call_user_app_builder_with_args_if_necessary(builder, app["args"]), name=app["name"])


def deployed(app: dict) -> dict:
    """Deployment name -> DeploymentInfo as Serve's controller deploys it: the graph `args` builds, then
    the config's `deployments:` overrides applied by the controller's own override_deployment_info.

    Reads ray/serve/_private/application_state.py (override_deployment_info),
    ray/serve/_private/config.py (ReplicaConfig), ray/serve/_private/deployment_info.py (DeploymentInfo)
    and Deployment._deployment_config. Public Serve shows the effective options only of a running
    deployment (serve.status(), the REST API's DeploymentDetails); restating the override rules here
    would test a copy of them, not Serve's."""
    from ray.serve._private.application_state import override_deployment_info
    from ray.serve._private.config import ReplicaConfig
    from ray.serve._private.deployment_info import DeploymentInfo
    from ray.serve.schema import ServeApplicationSchema

    infos = {}
    for dep in build_application(app).deployments:
        # The controller receives replica configs serialized; here the bound handles in their init args
        # would need a running Serve to copy, and overrides never touch them, so keep the actor options only.
        replica = ReplicaConfig.create(dep.func_or_class, ray_actor_options=dep.ray_actor_options)
        infos[dep.name] = DeploymentInfo(dep._deployment_config, replica, start_time_ms=0, deployer_job_id="")
    return override_deployment_info(infos, ServeApplicationSchema.model_validate(app))


def app_code_version(app: dict) -> str:
    """The code version Serve's controller gives an `applications:` entry; a change restarts every replica.

    Reads ray/serve/_private/deploy_utils.py (get_app_code_version, called by ApplicationState in
    ray/serve/_private/application_state.py). No public API exposes it or says what it hashes."""
    from ray.serve._private.deploy_utils import get_app_code_version
    from ray.serve.schema import ServeApplicationSchema

    return get_app_code_version(ServeApplicationSchema.model_validate(app))


def autoscaler_token_paths() -> tuple[str, str]:
    """(API token, CA certificate): the files Ray's KubeRay autoscaler reads to reach the Kubernetes API.

    Reads ray/autoscaler/_private/kuberay/node_provider.py (IN_CLUSTER_TOKEN_PATH,
    IN_CLUSTER_CA_CERT_PATH). Ray documents no public setting or constant for them; the Kubernetes
    convention alone would not show that Ray reads the files the chart mounts."""
    from ray.autoscaler._private.kuberay import node_provider

    return node_provider.IN_CLUSTER_TOKEN_PATH, node_provider.IN_CLUSTER_CA_CERT_PATH


def deployment_id(name: str, app_name: str):
    """The DeploymentID a Serve AutoscalingContext (public, ray.serve.config) takes as `deployment_id`.

    Reads ray/serve/_private/common.py: Ray exports the class from no public module."""
    from ray.serve._private.common import DeploymentID

    return DeploymentID(name=name, app_name=app_name)


def replica_id(unique_id: str, deployment):
    """A ReplicaID, the key of an AutoscalingContext's `running_replicas` and per-replica metrics.

    Reads ray/serve/_private/common.py: Ray exports the class from no public module."""
    from ray.serve._private.common import ReplicaID

    return ReplicaID(unique_id, deployment)


def controller_policy(policy) -> Callable:
    """The callable Serve's controller runs each tick for a deployment's AutoscalingPolicy: a policy class
    built once with its policy_kwargs, wrapped with Serve's scaling factors, min/max bounds and
    upscale/downscale delays; it takes an AutoscalingContext and returns (replicas, policy state).

    Reads ray/serve/_private/autoscaling_state.py (_resolve_policy_callable) and
    ray/serve/autoscaling_policy.py (_apply_autoscaling_config), composed as DeploymentAutoscalingState
    composes them. Public Serve applies the wrapping only inside a running controller;
    AutoscalingPolicy.get_policy() returns the bare policy."""
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve.autoscaling_policy import _apply_autoscaling_config

    return _apply_autoscaling_config(_resolve_policy_callable(policy))


def controller_metrics(app_name: str, deployment: str) -> dict:
    """The autoscaling metrics Serve's controller holds for a deployment (replicas' record_autoscaling_stats
    among them), name -> value; needs the running Serve instance this process is connected to.

    Reads ray/serve/_private/constants.py (SERVE_CONTROLLER_NAME, SERVE_NAMESPACE) and calls
    ServeController._get_metrics_for_deployment_for_testing (ray/serve/_private/controller.py). The public
    field for this, DeploymentDetails.autoscaling_detail.metrics (ray/serve/schema.py, in serve.status()
    and the REST API), is never filled in Ray 2.60, and no Ray metric exports custom autoscaling metrics."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    return ray.get(controller._get_metrics_for_deployment_for_testing.remote(deployment_id(deployment, app_name)))
