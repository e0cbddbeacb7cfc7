"""Building an engine from directories (or hub ids): target, tokenizer, drafter, checked against each other."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from .drafter.checkpoint import check_compatible, load_config, load_drafter, resolve_dir
from .drafter.config import DFlashConfig
from .drafter.local import LocalDrafter
from .drafter.model import DFlashDraftModel
from .drafter.protocol import Drafter
from .engine import SpeculativeEngine, StepObserver
from .errors import CheckpointError, DFlashError
from .fused_norms import fuse_rms_norms
from .journal import RoundJournal
from .packed_linear import can_pack, pack_linear, pack_linears
from .scheduler import SchedulerConfig
from .target import TargetModel

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


# The oldest Linux driver each CUDA major release runs on (NVIDIA's minor version compatibility table).
MIN_DRIVER_FOR_CUDA = {"11": "450.80.02", "12": "525.60.13", "13": "580"}
DRIVER_VERSION_FILE = Path("/proc/driver/nvidia/version")


def resolve_device(device: str) -> torch.device:
    """"auto" is cuda where CUDA works and cpu elsewhere; an explicit cuda device must work.

    When it does not, the error names what this torch is built for and the driver it found: the Helm
    chart asks for cuda on pods that requested GPUs, so a node driver too old for the image fails the
    replica at start instead of running it on the CPU beside an idle GPU.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise DFlashError(f"unknown device '{device}'; use cpu, cuda, cuda:N or auto") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise DFlashError(cuda_unusable_message(device))
    return resolved


def cuda_unusable_message(device: str) -> str:
    """Why `device` cannot run here: a CPU-only torch, or the CUDA build and the driver it needs vs found."""
    built = torch.version.cuda
    if built is None:
        return (f"device '{device}' asked for, but torch {torch.__version__} is a CPU-only build; use the CUDA "
                "image (docker/Dockerfile.cuda) or device cpu")
    needed = MIN_DRIVER_FOR_CUDA.get(built.split(".")[0])
    needs = f"NVIDIA driver {needed} or newer" if needed else f"an NVIDIA driver that supports CUDA {built}"
    driver = nvidia_driver_version()
    found = (f"this node's driver is {driver}" if driver
             else f"no NVIDIA driver is visible here ({DRIVER_VERSION_FILE} is missing: "
                  "no GPU given to this container?)")
    return (f"device '{device}' asked for, but CUDA is not usable: torch {torch.__version__} is built for CUDA "
            f"{built}, which needs {needs}; {found}. Upgrade the node's driver, use an image whose torch fits it, "
            "or set the device to cpu")


def nvidia_driver_version() -> str | None:
    """The loaded NVIDIA kernel driver's version, e.g. "535.104.05"; None where none is loaded."""
    try:
        text = DRIVER_VERSION_FILE.read_text()
    except OSError:
        return None
    match = re.search(r"Kernel Module\b.*?\s(\d+\.\d+(?:\.\d+)?)\s", text)
    return match.group(1) if match else None


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype | str:
    if dtype == "auto":
        return "auto" if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise DFlashError(f"unknown dtype '{dtype}'; use auto, float32, bfloat16 or float16")
    return DTYPES[dtype]


def resolve_drafter_dtype(dtype: str, target_dtype: torch.dtype | str, device: torch.device) -> torch.dtype | str:
    """The drafter's dtype. auto: bfloat16 where the target runs in float32 on a CPU with AMX tiles, the
    target's dtype elsewhere. The drafter's numerics decide how many proposals the target accepts, never
    the output, and AMX runs the drafter's small bf16 matmuls in about half the time of float32's
    (docs/service.md, "The drafter in bf16")."""
    if dtype == "auto":
        return torch.bfloat16 if target_dtype == torch.float32 and can_pack(device) else target_dtype
    return resolve_dtype(dtype, device)


def local_drafter(draft_model: DFlashDraftModel, embed_tokens: nn.Module, lm_head: nn.Module,
                  heads_shared: bool = True) -> LocalDrafter:
    """A LocalDrafter over the target's embedding and LM head, in the drafter's dtype: the target's own
    modules when the dtypes match, otherwise copies made once (on an 8B target in float32, 1.2 GB each in
    bf16). The drafter's Linear layers, and a head that is the drafter's alone (a copy, or
    `heads_shared=False`: a drafter replica's), are packed for AMX where that is exact (packed_linear.py)."""
    dtype = next(draft_model.parameters()).dtype
    if embed_tokens.weight.dtype != dtype:
        embed_tokens = nn.Embedding.from_pretrained(embed_tokens.weight.detach().to(dtype), freeze=True,
                                                    padding_idx=embed_tokens.padding_idx)
    if lm_head.weight.dtype != dtype:
        copy = nn.Linear(lm_head.in_features, lm_head.out_features, bias=lm_head.bias is not None, device="meta")
        copy.weight = nn.Parameter(lm_head.weight.detach().to(dtype), requires_grad=False)
        if lm_head.bias is not None:
            copy.bias = nn.Parameter(lm_head.bias.detach().to(dtype), requires_grad=False)
        lm_head, heads_shared = copy, False
    if not heads_shared:
        lm_head = pack_linear(lm_head)
    pack_linears(draft_model)
    return LocalDrafter(draft_model, embed_tokens, lm_head)


def prepare_for_inference(model: nn.Module) -> nn.Module:
    """What every model the engine (or a baseline beside it) runs gets: the device's weight layout
    (`lay_out_for_device`) and its RMSNorms as single calls where that is bit-identical
    (fused_norms.py). Values and outputs unchanged; not for a model that is trained or saved afterwards."""
    fuse_rms_norms(lay_out_for_device(model))
    return model


def lay_out_for_device(model: nn.Module) -> nn.Module:
    """For inference on CPU: every nn.Linear weight [out, in] stored column-major (values and shape
    unchanged, only strides), so the `weight.t()` that F.linear multiplies by is a contiguous [in, out]
    matrix. MKL's GEMM runs faster on that layout for the engine's shapes: a decode step, a 16-token
    verify and a drafter block 7-10% each (benchmarks/weight_layout.py). Other devices are left as they are.
    Not for a model that is trained or saved afterwards (safetensors wants contiguous tensors)."""
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.weight.device.type == "cpu" and module.weight.is_contiguous():
            module.weight.data = module.weight.data.t().contiguous().t()
    return model


def load_target(path_or_id: str | Path, device: torch.device,
                dtype: torch.dtype | str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Load any AutoModelForCausalLM and its tokenizer (None when the directory has none)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the loading bar would interleave with streamed text
    directory = resolve_dir(path_or_id, "target")
    if not (directory / "config.json").is_file():
        raise CheckpointError(f"target directory '{directory}' has no config.json")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype)
    except Exception as exc:  # transformers raises ValueError/KeyError/OSError/safetensors errors here
        raise CheckpointError(
            f"cannot load target '{directory}' as a Hugging Face causal LM: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}"
        ) from None
    model = model.to(device).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    except Exception:  # no tokenizer files: the engine still works on token ids
        tokenizer = None
    return model, tokenizer


def eos_ids(model: PreTrainedModel) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None) if model.generation_config else None
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def build_engine(
    target: str | Path,
    drafter: str | Path | None = None,
    *,
    device: str = "auto",
    dtype: str = "auto",
    drafter_dtype: str = "auto",
    scheduler: SchedulerConfig = SchedulerConfig(),
    observer: StepObserver | None = None,
    journal: RoundJournal | None = None,
    remote_drafter: Callable[[DFlashConfig], Drafter] | None = None,
) -> SpeculativeEngine:
    """Target (+ drafter) directories in, a ready engine out; mismatches raise CheckpointError.

    The one place an engine is assembled, in process and in the service alike. With `remote_drafter`,
    only the drafter's config is read here and the drafter itself is what the callable builds from it
    (the service's gRPC client of the drafter replicas); otherwise it runs in this process.
    """
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    model, tokenizer = load_target(target, dev, torch_dtype)
    prepare_for_inference(model)
    embed_rows = model.get_input_embeddings().weight.shape[0]
    engine_drafter: Drafter | None = None
    layer_ids: tuple[int, ...] = ()
    if drafter is not None and remote_drafter is not None:
        draft_config = load_config(resolve_dir(drafter, "drafter"))
        check_compatible(draft_config, model.config, embed_rows)
        engine_drafter, layer_ids = remote_drafter(draft_config), draft_config.target_layer_ids
    elif drafter is not None:
        draft_model = load_drafter(drafter, device=dev, dtype=resolve_drafter_dtype(drafter_dtype, model.dtype, dev))
        prepare_for_inference(draft_model)
        check_compatible(draft_model.config, model.config, embed_rows)
        layer_ids = draft_model.config.target_layer_ids
    target_model = TargetModel(model, layer_ids)
    if drafter is not None and remote_drafter is None:
        engine_drafter = local_drafter(draft_model, target_model.embed_tokens, target_model.lm_head)
    return SpeculativeEngine(target_model, engine_drafter, tokenizer, eos_ids(model), scheduler, observer=observer,
                             journal=journal)
