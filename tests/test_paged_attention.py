"""The paged KV pool and the attention backends: one attention call per layer for every session, equal to
the per-session loop it replaced, and a step whose operator count does not grow with its sessions.

Tiny real Llama / Qwen3 targets (Qwen3 with sliding-window layers in target and drafter) and random
DFlash drafters, fp32, CPU.
The CUDA backend (Flash Attention's varlen kernel over the block table) is covered by the `gpu` tests at
the end, skipped where no GPU exists.
"""

import pytest
import torch
from dflash.attention_backend import AttentionPlan, PaddedSDPA, SessionLoop, SessionSpan, backend_for, write_kv
from dflash.bench.step_ops import count_step_ops
from dflash.block_manager import BlockManager, CacheFullError, CacheShape
from dflash.drafter import DFlashDraftModel
from dflash.drafter.config import DFlashConfig
from dflash.errors import DFlashError
from dflash.params import SamplingParams
from dflash.scheduler import SchedulerConfig
from tiny import engine_for, prompts, tiny_drafter, tiny_target

SHAPE = CacheShape(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, device=torch.device("cpu"))


def test_block_tables_take_pages_as_sessions_grow_and_give_them_back():
    pool = BlockManager(SHAPE, budget_tokens=64, page_tokens=4, max_sessions=2)
    keys = pool.keys
    pool.reserve("a", 10)
    pool.reserve("b", 30)
    assert pool.extend("a", 0, 5) == [0, 1] and pool.length("a") == 5
    assert pool.extend("b", 0, 3) == [2]
    assert pool.extend("a", 5, 4) == [0, 1, 3]  # a third page, from the free list
    assert pool.slots([0, 1, 3], 7, 3) == [1 * 4 + 3, 3 * 4 + 0, 3 * 4 + 1]
    pool.crop("a", 6)
    assert pool.length("a") == 6 and pool.block_table("a") == [0, 1, 3]  # rollback keeps the pages
    assert pool.allocated_bytes == 4 * 4 * SHAPE.bytes_per_token
    with pytest.raises(DFlashError, match="reserved 10 positions, needs 11"):
        pool.extend("a", 6, 5)
    with pytest.raises(DFlashError, match="write starts at 7"):
        pool.extend("a", 7, 1)
    with pytest.raises(CacheFullError, match="0 of 2 sessions are free"):
        pool.reserve("c", 1)
    pool.free("a")
    assert pool.reserved_tokens == 30 and pool.allocated_bytes == 1 * 4 * SHAPE.bytes_per_token
    pool.reserve("c", 34)
    assert pool.extend("c", 0, 34) and pool.keys is keys  # the pool itself was allocated once
    with pytest.raises(CacheFullError, match="64 tokens"):
        BlockManager(SHAPE, 64, 4).reserve("x", 65)


def test_a_growable_pool_doubles_and_keeps_what_sessions_hold():
    pool = BlockManager(SHAPE, budget_tokens=8, page_tokens=4, max_sessions=1, growable=True)
    pool.reserve("a", 8)
    pages = pool.extend("a", 0, 8)
    k = torch.randn(8, 2, 8)
    write_kv(pool.keys[0], pool.values[0], k, -k, torch.tensor(pool.slots(pages, 0, 8)))
    pool.reserve("b", 20)  # neither the tokens nor the session fit: the pool grows
    assert pool.budget_tokens >= 28 and pool.max_sessions >= 2
    assert pool.extend("a", 0, 8) == pages and set(pool.extend("b", 0, 20)).isdisjoint(pages)
    held = pool.keys[0].view(-1, 2, 8)[torch.tensor(pool.slots(pages, 0, 8))]
    assert torch.equal(held, k)


def random_pool(spans_spec, page=4, seed=0):
    """A pool with sessions of (context, queries) and random keys/values everywhere."""
    g = torch.Generator().manual_seed(seed)
    pool = BlockManager(SHAPE, budget_tokens=512, page_tokens=page, max_sessions=len(spans_spec))
    spans = []
    for i, (context, queries) in enumerate(spans_spec):
        pool.reserve(f"s{i}", context + queries)
        pages = pool.extend(f"s{i}", 0, context + queries)
        spans.append(SessionSpan(tuple(pages), context, queries, context + queries))
    pool.keys.copy_(torch.randn(pool.keys.shape, generator=g))
    pool.values.copy_(torch.randn(pool.values.shape, generator=g))
    query = torch.randn(4, sum(q for _, q in spans_spec), 8, generator=g)  # [heads, T, d], GQA 4:2
    return pool, spans, query


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("spec", [[(9, 1)], [(9, 1), (30, 1), (3, 1)], [(7, 16), (22, 16)],
                                  [(0, 40), (13, 1), (5, 16), (1, 3)]])
def test_the_batched_backend_equals_the_per_session_loop(spec, causal, window):
    """Decodes, whole-block verifies, a long prefill chunk beside them (attended on its own), mixed."""
    pool, spans, query = random_pool(spec)
    plan = AttentionPlan(spans, pool.page_tokens, causal, torch.device("cpu"))
    want = SessionLoop().attend(query, pool.keys[1], pool.values[1], plan, 0.3, window)
    got = PaddedSDPA().attend(query, pool.keys[1], pool.values[1], plan, 0.3, window)
    assert got.shape == (query.shape[1], 4, 8)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_backends_are_chosen_by_device_and_named_when_wrong():
    assert backend_for(torch.device("cpu")).name == "padded_sdpa"
    assert backend_for(torch.device("cpu"), "loop").name == "loop"
    with pytest.raises(DFlashError, match="'varlen' runs on CUDA in float16/bfloat16 only, not cpu"):
        backend_for(torch.device("cpu"), "varlen")
    with pytest.raises(DFlashError, match="'flash' is not one of auto"):
        backend_for(torch.device("cpu"), "flash")


@pytest.fixture(scope="module", params=["llama", "qwen3-sliding"])
def pair(request):
    if request.param == "llama":
        target = tiny_target("llama")
        return target, tiny_drafter(target)
    target = tiny_target("qwen3", use_sliding_window=True, sliding_window=6, max_window_layers=1)
    assert "sliding_attention" in target.config.layer_types
    drafter = tiny_drafter(target)
    raw = dict(drafter.config.raw, layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    return target, DFlashDraftModel(DFlashConfig.from_dict(raw)).eval()


def test_the_pool_engine_equals_the_loop_engine_round_for_round(pair):
    """Eight requests at once (greedy and sampled, block sizes 1 to 16): the same tokens and the same
    accepted lengths with the batched backend as with the per-session reference."""
    target, drafter = pair
    requests = [(p, SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=(0.0, 0.9)[i % 2], seed=i,
                                   block_size=(None, 1, 4)[i % 3])) for i, p in enumerate(prompts(8, seed=3, hi=50))]
    runs = []
    for attention in ("loop", "padded_sdpa"):
        engine = engine_for(target, drafter, attention=attention)
        gens = [engine.start(p, params, request_id=f"r{i}") for i, (p, params) in enumerate(requests)]
        for g in gens:
            engine.submit(g)
        while engine.step():
            pass
        runs.append([(g.output_ids, [r.stats.accepted_tokens for r in g.outbox]) for g in gens])
    assert runs[0] == runs[1]


def test_a_steady_step_allocates_no_cache_tensor(pair):
    target, drafter = pair
    engine = engine_for(target, drafter)
    keys, values = engine.cache.keys.data_ptr(), engine.cache.values.data_ptr()
    drafter_keys = engine.drafter.cache.keys.data_ptr()
    for p in prompts(4, seed=9):
        engine.submit(engine.start(p, SamplingParams(max_new_tokens=40, ignore_eos=True)))
    while engine.step():
        pass
    assert (engine.cache.keys.data_ptr(), engine.cache.values.data_ptr()) == (keys, values)
    assert engine.drafter.cache.keys.data_ptr() == drafter_keys
    assert engine.cache.allocated_bytes == 0 and engine.drafter.cache.allocated_bytes == 0


@pytest.mark.parametrize("block_size", [1, None], ids=["plain", "dflash-block"])
def test_step_operators_do_not_grow_with_sessions(pair, block_size):
    """torch's profiler: aten operators of one steady step with 16 sessions <= 1.5x those with 1 (each
    operator is a kernel launch on a GPU)."""
    target, drafter = pair
    engine = engine_for(target, drafter, config=SchedulerConfig(verify_policy="full"))
    batch = prompts(16, seed=4, lo=10, hi=60)
    one = count_step_ops(engine, batch[:1], block_size)
    many = count_step_ops(engine, batch, block_size)
    assert many.operators <= 1.5 * one.operators, (one, many)


@pytest.mark.gpu
def test_the_varlen_backend_equals_the_loop_on_cuda():
    """Flash Attention over the block table (pages of 256), decodes, verifies and a prefill chunk."""
    device = torch.device("cuda")
    shape = CacheShape(1, 2, 64, torch.bfloat16, device)
    pool = BlockManager(shape, budget_tokens=4096, page_tokens=256, max_sessions=4)
    spec = [(300, 1), (17, 16), (0, 200), (600, 16)]
    spans = []
    for i, (context, queries) in enumerate(spec):
        pool.reserve(f"s{i}", context + queries)
        spans.append(SessionSpan(tuple(pool.extend(f"s{i}", 0, context + queries)), context, queries,
                                 context + queries))
    pool.keys.normal_()
    pool.values.normal_()
    query = torch.randn(4, sum(q for _, q in spec), 64, device=device, dtype=torch.bfloat16)
    for causal in (True, False):
        for window in (None, 64):
            plan = AttentionPlan(spans, 256, causal, device)
            want = SessionLoop().attend(query, pool.keys[0], pool.values[0], plan, None, window)
            got = backend_for(device).attend(query, pool.keys[0], pool.values[0], plan, None, window)
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_cuda_graph_steps_equal_eager_steps():
    """Decode and whole-block verify steps replayed from CUDA graphs (bf16, varlen backend) give the
    tokens and accepted lengths of the same engine run eagerly; prefill stays eager."""
    from dflash.drafter.local import LocalDrafter
    from dflash.engine import SpeculativeEngine
    from dflash.target import TargetModel

    target_model = tiny_target("qwen3").to("cuda", torch.bfloat16)
    drafter_model = tiny_drafter(target_model).to("cuda", torch.bfloat16)
    requests = [(p, SamplingParams(max_new_tokens=24, ignore_eos=True, block_size=(None, 1)[i % 2]))
                for i, p in enumerate(prompts(6, seed=3, hi=50))]
    runs = []
    for graphs in (False, True):
        target = TargetModel(target_model, drafter_model.config.target_layer_ids, cuda_graphs=graphs)
        drafter = LocalDrafter(drafter_model, target.embed_tokens, target.lm_head)
        engine = SpeculativeEngine(target, drafter, config=SchedulerConfig(verify_policy="full", max_running=8))
        assert (target.graphs is not None) == graphs and target.attention.name == "varlen"
        gens = [engine.start(p, params, request_id=f"r{i}") for i, (p, params) in enumerate(requests)]
        for g in gens:
            engine.submit(g)
        while engine.step():
            pass
        runs.append([(g.output_ids, [r.stats.accepted_tokens for r in g.outbox]) for g in gens])
    assert runs[0] == runs[1]


def test_graph_buckets_and_the_static_forward_on_cpu():
    """What the CUDA graphs capture, run eagerly here: the static forward (all rows, features) equals the
    packed forward for the same tokens. (The capture and replay themselves are the `gpu` test above.)"""
    from dflash.cuda_graphs import token_buckets
    from dflash.packed_attention import PackedBatch
    from dflash.target import ForwardItem, TargetModel

    assert token_buckets(5) == [1, 2, 4, 16] and token_buckets(40) == [1, 2, 4, 8, 16, 32, 48]
    model = tiny_target("qwen3")
    target = TargetModel(model, (0, 2))
    assert not target.can_use_graphs  # CPU: padded SDPA, no graphs
    items = [ForwardItem("a", (5, 6, 7), 0), ForwardItem("b", (8, 9), 0)]
    want = []
    for attempt in ("packed", "static"):
        cache = target.new_cache(64, 2)
        cache.reserve("a", 10)
        cache.reserve("b", 10)
        if attempt == "packed":
            out = target.forward(cache, items)
            want = (out.logits, out.features)
            continue
        batch = PackedBatch(cache, target.attention, ("a", "b"), (0, 0), (3, 2))
        with torch.inference_mode():
            logits, features = target.forward_static(torch.tensor([5, 6, 7, 8, 9]), batch.positions(target.device),
                                                     batch)
        torch.testing.assert_close(logits.float(), want[0])
        torch.testing.assert_close(features, want[1])
