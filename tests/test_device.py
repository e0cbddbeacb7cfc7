"""Device resolution (loading.resolve_device): a GPU that CUDA cannot use is an error, never a silent CPU run.

No GPU exists on the machines that run these tests, so the CUDA probe (torch.cuda.is_available, the
CUDA version torch is built for, the driver file under /proc) is faked here: that is the only reason
for the fakes. The Helm chart's part (GPU pods ask for cuda) is checked in test_helm_chart.py.
"""

from __future__ import annotations

import pytest
import torch
from dflash import loading
from dflash.errors import DFlashError

PROPRIETARY = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  470.82.01  Wed Oct 27 21:21:55 UTC 2021\n"
OPEN = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build  (dvs-builder@U16)\n"


@pytest.fixture
def no_usable_cuda(monkeypatch):
    """A CUDA build of torch on a node whose driver is too old for it (what the probe reports there)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(loading, "nvidia_driver_version", lambda: "470.82.01")


def test_cuda_asked_for_but_unusable_names_the_driver_and_the_cuda_version(no_usable_cuda):
    with pytest.raises(DFlashError) as err:
        loading.resolve_device("cuda")
    message = str(err.value)
    assert "CUDA 12.8" in message and "525.60.13 or newer" in message and "470.82.01" in message
    assert "cpu" in message


def test_no_driver_at_all_says_so(no_usable_cuda, monkeypatch):
    monkeypatch.setattr(loading, "nvidia_driver_version", lambda: None)
    with pytest.raises(DFlashError, match="no NVIDIA driver is visible"):
        loading.resolve_device("cuda:0")


def test_a_cpu_only_torch_says_which_image_to_use(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(DFlashError, match="CPU-only build.*Dockerfile.cuda"):
        loading.resolve_device("cuda")


def test_auto_still_means_cpu_without_cuda(no_usable_cuda):
    """Local runs keep the fallback; on Kubernetes the chart asks GPU pods for cuda instead of auto."""
    assert loading.resolve_device("auto") == torch.device("cpu")
    assert loading.resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize(("text", "version"), [(PROPRIETARY, "470.82.01"), (OPEN, "570.86.15"), ("garbage\n", None)])
def test_driver_version_is_read_from_proc(tmp_path, monkeypatch, text, version):
    path = tmp_path / "version"
    path.write_text(text)
    monkeypatch.setattr(loading, "DRIVER_VERSION_FILE", path)
    assert loading.nvidia_driver_version() == version
    monkeypatch.setattr(loading, "DRIVER_VERSION_FILE", tmp_path / "missing")
    assert loading.nvidia_driver_version() is None


def test_cpu_layout_keeps_every_linear_value_and_output_only_its_strides_change():
    """lay_out_for_device: column-major Linear weights on CPU (what build_engine does); same values, same
    outputs, idempotent, and the model still saves (save_drafter makes its tensors contiguous)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 12, bias=False), torch.nn.SiLU(), torch.nn.Linear(12, 5))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 8)
    expected = model(x)
    assert loading.lay_out_for_device(model) is model
    for layer in (model[0], model[2]):
        assert layer.weight.stride() == (1, layer.weight.shape[0]) and layer.weight.t().is_contiguous()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    torch.testing.assert_close(model(x), expected)
    storage = model[0].weight.data_ptr()
    loading.lay_out_for_device(model)
    assert model[0].weight.data_ptr() == storage  # already laid out: left alone
