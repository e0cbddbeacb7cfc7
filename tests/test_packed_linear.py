"""The drafter in bf16 beside a float32 target, its Linear layers packed for AMX (packed_linear.py,
loading.resolve_drafter_dtype): same bits as unpacked, and the output still the target's alone.

The packing tests need a CPU with AMX tiles (the machine this project is built and tested on has them);
elsewhere they are skipped, and the dtype rule is checked to leave the drafter in the target's dtype.
"""

from __future__ import annotations

import copy

import pytest
import torch
from dflash.drafter.checkpoint import save_drafter
from dflash.loading import build_engine, resolve_drafter_dtype
from dflash.packed_linear import PackedLinear, can_pack, pack_linear, pack_linears
from dflash.params import SamplingParams
from dflash.scheduler import SchedulerConfig
from tiny import char_tokenizer, prompts, tiny_drafter, tiny_target
from torch import nn

CPU = torch.device("cpu")
amx = pytest.mark.skipif(not can_pack(CPU), reason="needs a CPU with AMX tiles (bf16 matmuls on AMX)")


@amx
def test_packed_layers_give_the_same_bits_and_state_dict_and_copy():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 96, bias=False), nn.SiLU(), nn.Linear(96, 40)).to(torch.bfloat16)
    x = torch.randn(2, 7, 48).to(torch.bfloat16)
    want, state = model(x), {k: v.clone() for k, v in model.state_dict().items()}
    assert pack_linears(model) == 2 and all(isinstance(m, PackedLinear) for m in (model[0], model[2]))
    assert torch.equal(model(x), want)
    got = model.state_dict()
    assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)
    twin = copy.deepcopy(model)
    assert twin[0].packed_weight is not model[0].packed_weight and torch.equal(twin(x), want)
    with torch.inference_mode():
        assert torch.equal(model(x[0]), want[0])  # a 2-D input, under inference mode


def test_only_bf16_linears_are_packed():
    fp32 = nn.Linear(16, 16)
    assert pack_linear(fp32) is fp32
    assert pack_linears(nn.Sequential(nn.Linear(8, 8), nn.ReLU())) == 0


def test_the_drafter_dtype_rule():
    amx_here = can_pack(CPU)
    assert resolve_drafter_dtype("auto", torch.float32, CPU) == (torch.bfloat16 if amx_here else torch.float32)
    assert resolve_drafter_dtype("auto", torch.bfloat16, CPU) == torch.bfloat16
    assert resolve_drafter_dtype("float32", torch.float32, CPU) == torch.float32
    assert resolve_drafter_dtype("auto", torch.float16, torch.device("cuda")) == torch.float16
    assert resolve_drafter_dtype("auto", "auto", torch.device("cuda")) == "auto"  # the checkpoint's, as the target
    with pytest.raises(Exception, match="unknown dtype 'float8'"):
        resolve_drafter_dtype("float8", torch.float32, CPU)


@amx
def test_a_bf16_drafter_beside_a_float32_target_keeps_the_targets_output(tmp_path):
    target = tiny_target("qwen3", layers=3)
    target.save_pretrained(tmp_path / "t")
    char_tokenizer().save_pretrained(tmp_path / "t")
    save_drafter(tiny_drafter(target, block_size=8), tmp_path / "d")
    full = SchedulerConfig(verify_policy="full")  # every round drafts (the adaptive policy's choice is timed)
    engine = build_engine(tmp_path / "t", tmp_path / "d", device="cpu", dtype="float32", scheduler=full)
    same_dtype = build_engine(tmp_path / "t", tmp_path / "d", device="cpu", dtype="float32", drafter_dtype="float32",
                              scheduler=full)
    alone = build_engine(tmp_path / "t", None, device="cpu", dtype="float32")
    drafter = engine.drafter
    assert next(drafter.model.parameters()).dtype == torch.bfloat16
    assert isinstance(drafter.lm_head, PackedLinear) and isinstance(drafter.model.fc, PackedLinear)
    assert drafter.embed_tokens is not engine.target.embed_tokens  # its own bf16 copy
    assert next(same_dtype.drafter.model.parameters()).dtype == torch.float32
    assert same_dtype.drafter.lm_head is same_dtype.target.lm_head  # shared as before
    for p in prompts(4):
        params = SamplingParams(max_new_tokens=40, ignore_eos=True)
        want = alone.run(p, params).token_ids
        got = engine.run(p, params)
        assert got.token_ids == want and same_dtype.run(p, params).token_ids == want
        assert got.stats.draft_tokens > 0  # it did draft
