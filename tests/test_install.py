"""The engine alone installs and runs without the service's, training's or bench's extras.

A real fresh virtual environment: torch (the CPU wheel, first, as the README says), then `pip install .`
with no extras; it must import dflash.engine and run `dflash generate` on the demo pair, and must not
have pulled in Ray, gRPC, Redis, OpenTelemetry or matplotlib.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SERVICE_ONLY = ("ray", "grpc", "redis", "opentelemetry", "prometheus_client", "matplotlib")


@pytest.mark.slow
def test_pip_install_without_extras_runs_the_engine(tmp_path):
    source = tmp_path / "src"
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    torch_version = __import__("torch").__version__.split("+")[0]
    subprocess.run([*pip, f"torch=={torch_version}"], check=True, timeout=900)
    subprocess.run([*pip, str(source)], check=True, timeout=900)
    probe = ("import importlib.util as u, sys; found = [m for m in sys.argv[1:] if u.find_spec(m)]; "
             "sys.exit(' '.join(found) or 0)")
    missing = subprocess.run([str(python), "-c", probe, *SERVICE_ONLY], cwd=tmp_path, capture_output=True, text=True)
    assert missing.returncode == 0, f"the base install pulled in: {missing.stderr}"
    run = subprocess.run([str(python), "-c", "import dflash.engine, dflash.loading"], cwd=tmp_path, timeout=300)
    assert run.returncode == 0
    out = subprocess.run([str(env_dir / "bin" / "dflash"), "generate", "def fibonacci(n):", "--max-new-tokens", "16",
                          "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert '"finish_reason": "length"' in out.stdout and sys.executable != str(python)
