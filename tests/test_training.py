"""Drafter training: blocks and masks by hand, loss goes down, exact resume, engine equality, CLI end to end."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from dflash.cli import main as cli_main
from dflash.drafter.checkpoint import load_drafter
from dflash.drafter.config import DFlashConfig
from dflash.drafter.model import DFlashDraftModel
from dflash.errors import DFlashError
from dflash.loading import build_engine, load_target, resolve_dtype
from dflash.params import SamplingParams
from dflash.scheduler import SchedulerConfig
from dflash.target import TargetModel
from dflash.training import trainer as trainer_module
from dflash.training.blocks import (
    IGNORE,
    block_accuracy,
    block_attention_mask,
    block_sparse_mask,
    default_gamma,
    loss_weights,
    make_blocks,
    miss_weights,
    sample_anchors,
    uncertainty_weights,
)
from dflash.training.config import TrainConfig, TrainConfigError
from dflash.training.data import load_samples, read_records, tokenize
from dflash.training.features import CachedFeatures, OnlineFeatures, cache_features
from dflash.training.regenerate import regenerate
from dflash.training.trainer import Trainer
from tokenizers import Tokenizer, models, pre_tokenizers
from torch.nn.attention.flex_attention import BlockMask
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

VOCAB = 64
MASK_ID = 2
WORDS = [f"w{i}" for i in range(VOCAB - 4)]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and lose a lot when the machine is shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_target(seed: int = 0, layers: int = 4) -> Qwen3ForCausalLM:
    """A random tiny Qwen3; a wide init gives peaked logits, so a few drafter steps visibly lower the loss."""
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=256,
                         eos_token_id=1, pad_token_id=0, initializer_range=0.3)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config).eval()


def counting_target(steps: int = 150) -> Qwen3ForCausalLM:
    """A tiny target trained to continue arithmetic progressions (w3 w5 w7 ...): a drafter can learn it."""
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=256,
                         eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    g = torch.Generator().manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        x = progressions(32, 24, g)
        model(input_ids=x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


def progressions(n: int, length: int, g: torch.Generator) -> torch.Tensor:
    start, step = torch.randint(0, 60, (n, 1), generator=g), torch.randint(1, 4, (n, 1), generator=g)
    return (start + step * torch.arange(length)) % 60 + 4


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, "<mask>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   mask_token="<mask>", unk_token="<unk>")


def words(rng: torch.Generator, n: int) -> str:
    return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=rng).tolist())


def write_data(path, num: int, seed: int = 0) -> None:
    rng = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for i in range(num):
            f.write(json.dumps({"id": f"r{i}", "prompt": words(rng, 6), "response": words(rng, 20)}) + "\n")


def make_trainer(tmp_path, model, tokenizer, **overrides) -> Trainer:
    data = tmp_path / "data.jsonl"
    if not data.exists():
        write_data(data, 8)
    settings = dict(target=str(tmp_path), data=str(data), out_dir=str(tmp_path / "out"), block_size=4,
                    num_layers=1, batch_size=2, max_length=40, max_anchors=6, log_every=1, save_every=2,
                    lr=3e-3, warmup_ratio=0.0, amp="off", save_dtype="float32")
    settings.update(overrides)
    config = TrainConfig(**settings)
    samples, _ = load_samples(config.data, tokenizer, config.max_length)
    drafter_config = DFlashConfig.for_target(model.config, num_layers=1, block_size=config.block_size,
                                             mask_token_id=MASK_ID, target_layer_ids=[1, 2])
    features = OnlineFeatures(model, drafter_config.target_layer_ids, config.needs_last_hidden)
    return Trainer(config, model, drafter_config, samples, features, tokenizer=tokenizer, pad_id=0)


# -- blocks: a hand-checked case ------------------------------------------------------------------------


def test_blocks_hand_checked():
    # 6 tokens: 2 prompt + 4 response; block size 3; anchors at 2 and 4 (the second runs past the end).
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    anchors, valid = torch.tensor([[2, 4]]), torch.tensor([[True, True]])
    b = make_blocks(ids, loss_mask, anchors, valid, block_size=3, mask_token_id=99)

    assert b.token_ids.tolist() == [[12, 99, 99, 14, 99, 99]]
    assert b.positions.tolist() == [[2, 3, 4, 4, 5, 6]]
    # slot k predicts the token AT anchor + k (no shift); slot 0 and positions past the end: no loss.
    assert b.labels.tolist() == [[[IGNORE, 13, 14], [IGNORE, 15, IGNORE]]]
    # the target's logits at label position - 1 predict the label (distillation).
    assert b.teacher_positions.tolist() == [[[1, 2, 3], [3, 4, 5]]]
    # keys: context 0..5 | block 0 (3 tokens) | block 1 (3 tokens)
    #            c0 c1 c2 c3 c4 c5  b0 b0 b0  b1 b1 b1
    block0 = [1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0]  # context strictly before anchor 2, own block only
    block1 = [1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1]  # context strictly before anchor 4, own block only
    expected = torch.tensor([block0] * 3 + [block1] * 3, dtype=torch.bool)
    assert b.attention_mask.shape == (1, 1, 6, 12)
    assert torch.equal(b.attention_mask[0, 0], expected)


def test_labels_skip_prompt_tokens_and_invalid_anchors():
    ids = torch.tensor([[5, 6, 7, 8]])
    loss_mask = torch.tensor([[1, 1, 0, 1]])  # e.g. a second prompt turn inside the sequence
    b = make_blocks(ids, loss_mask, torch.tensor([[0, 1]]), torch.tensor([[True, False]]), 3, 9)
    assert b.labels.tolist() == [[[IGNORE, 6, IGNORE], [IGNORE, IGNORE, IGNORE]]]


def test_loss_weights_and_gamma():
    assert default_gamma(16) == 7 and default_gamma(10) == 5 and default_gamma(8) == 4
    assert default_gamma(12) == pytest.approx(5 + 2 * 2 / 6)
    w = loss_weights(4, gamma=7.0)
    assert w.tolist() == pytest.approx([0.0, 1.0, math.exp(-1 / 7), math.exp(-2 / 7)])


def test_sample_anchors_eligible_sorted_reproducible():
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 1, 1, 0]])
    anchors, valid = sample_anchors(loss_mask, 3, torch.Generator().manual_seed(0))
    again, _ = sample_anchors(loss_mask, 3, torch.Generator().manual_seed(0))
    assert torch.equal(anchors, again)
    # row 0: eligible 2..5 (a response token followed by one); row 1: only 5, then padding
    assert valid.tolist() == [[True, True, True], [True, False, False]]
    assert set(anchors[0].tolist()) <= {2, 3, 4, 5} and anchors[0].tolist() == sorted(anchors[0].tolist())
    assert anchors[1, 0] == 5
    many, many_valid = sample_anchors(loss_mask, 100, torch.Generator().manual_seed(1))
    assert many[0].tolist() == [2, 3, 4, 5] and many_valid.sum() == 5


def test_weighted_anchor_sampling():
    """Unit weights are exactly the uniform draw; heavy weights pull anchors to their positions; weights never
    make an ineligible position an anchor."""
    loss_mask = torch.ones(2, 64, dtype=torch.long)
    loss_mask[1, :40] = 0
    uniform = sample_anchors(loss_mask, 8, torch.Generator().manual_seed(3))
    ones = sample_anchors(loss_mask, 8, torch.Generator().manual_seed(3), torch.ones(2, 64))
    assert torch.equal(uniform[0], ones[0]) and torch.equal(uniform[1], ones[1])
    weights = torch.ones(2, 64)
    weights[:, 48:56] = 50.0
    weights[1, :40] = 1e6  # prompt positions: not eligible whatever their weight
    generator = torch.Generator().manual_seed(0)
    heavy = total = 0
    for _ in range(20):
        anchors, valid = sample_anchors(loss_mask, 8, generator, weights)
        picked = anchors[valid]
        assert not ((anchors[1] < 40) & valid[1]).any()
        heavy += int(((picked >= 48) & (picked < 56)).sum())
        total += picked.numel()
    # uniform sampling would put about 8/63 (row 0) and 8/23 (row 1) of the picks there
    assert heavy > 0.6 * total, (heavy, total)


def test_uncertainty_weights_hand_checked():
    """Position a's weight follows 1 - p(token a | before a) from the logits at a - 1, normalised to mean 1 over
    eligible anchors; share 0 is uniform."""
    ids = torch.tensor([[0, 1, 2, 1]])
    loss_mask = torch.tensor([[0, 1, 1, 1]])  # eligible anchors: 1, 2
    logits = torch.full((1, 4, 3), -1e9)
    logits[0, 0, 1] = 0.0  # p(ids[1]) = 1: no uncertainty at anchor 1
    logits[0, 1, :] = 0.0  # p(ids[2]) = 1/3 at anchor 2
    logits[0, 2, :] = 0.0
    w = uncertainty_weights(logits, ids, loss_mask, share=1.0)
    assert w[0, 1].item() == pytest.approx(0.0, abs=1e-6) and w[0, 2].item() == pytest.approx(2.0, abs=1e-5)
    half = uncertainty_weights(logits, ids, loss_mask, share=0.5)
    assert half[0, 1].item() == pytest.approx(0.5, abs=1e-6) and half[0, 2].item() == pytest.approx(1.5, abs=1e-5)
    assert torch.equal(uncertainty_weights(logits, ids, loss_mask, share=0.0), torch.ones(1, 4))


def test_miss_weights_hand_checked():
    """A probe block sends the next round to its first wrong slot, or past a fully right block; a block that
    runs off the response sends it nowhere; weights have mean 1 over eligible anchors; no start is uniform."""
    # 12 tokens, response from 2; eligible anchors 2..10. Block size 4, probes at 2, 5 and 8.
    loss_mask = torch.tensor([[0, 0] + [1] * 10, [0, 0] + [1] * 10])
    anchors = torch.tensor([[2, 5, 8], [2, 5, 8]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    labels = torch.tensor([[[IGNORE, 13, 14, 15], [IGNORE, 16, 17, 18], [IGNORE, 19, 20, 21]]] * 2)
    predictions = labels.clone()
    predictions[0, 0, 2] = 0  # probe 2: slot 1 right, slot 2 wrong -> next round at 4
    # probe 5: all right -> the bonus token at 9
    labels[0, 2, 3] = IGNORE  # probe 8: slots 1, 2 right, slot 3 past the response -> nowhere
    predictions[1] = 0  # row 1: probes 2 and 5 miss at slot 1 (3 and 6); probe 8 is padding
    w = miss_weights(predictions, labels, anchors, valid, loss_mask, share=1.0)
    assert w[0].nonzero().flatten().tolist() == [4, 9] and w[0, 4].item() == pytest.approx(9 / 2)
    assert w[1].nonzero().flatten().tolist() == [3, 6]
    half = miss_weights(predictions, labels, anchors, valid, loss_mask, share=0.5)
    assert half[0, 4].item() == pytest.approx(0.5 + 0.5 * 9 / 2) and half[0, 5].item() == pytest.approx(0.5)
    none = miss_weights(predictions, labels, anchors, torch.zeros_like(valid), loss_mask, share=1.0)
    assert torch.equal(none, torch.ones(2, 12))


def test_block_accuracy_counts_leading_run():
    labels = torch.tensor([[[IGNORE, 1, 2, 3], [IGNORE, 4, 5, IGNORE]]])
    preds = torch.tensor([[[0, 1, 9, 3], [0, 4, 5, 0]]])
    correct, labelled, accepted = block_accuracy(preds, labels)
    assert correct.tolist() == [0, 2, 1, 1] and labelled.tolist() == [0, 2, 2, 1]
    assert accepted.tolist() == [2]  # only the full block counts: slot 1 right, slot 2 wrong -> 1 + 1


def test_mask_isolates_blocks_in_the_model():
    """Perturbing context at/after an anchor, or another block's tokens, leaves a block's output unchanged."""
    torch.manual_seed(0)
    target = tiny_target()
    config = DFlashConfig.for_target(target.config, num_layers=2, block_size=3, mask_token_id=MASK_ID,
                                     target_layer_ids=[1, 2])
    drafter = DFlashDraftModel(config).eval()
    ids = torch.randint(4, VOCAB, (1, 8))
    b = make_blocks(ids, torch.ones_like(ids), torch.tensor([[2, 5]]), torch.tensor([[True, True]]), 3, MASK_ID)
    feats = torch.randn(1, 8, 64)
    noise = torch.randn(1, 6, 32)
    positions = torch.cat([torch.arange(8)[None], b.positions], dim=1)
    def run(f, n):
        return drafter(n, f, positions, attention_mask=b.attention_mask)

    base = run(feats, noise)
    f2 = feats.clone()
    f2[:, 2:] += 1.0  # context from anchor 0 on: block 0 must not see it, block 1 sees 2..4
    out = run(f2, noise)
    assert torch.allclose(out[:, :3], base[:, :3]) and not torch.allclose(out[:, 3:], base[:, 3:])
    n2 = noise.clone()
    n2[:, 3:] += 1.0  # block 1's tokens: block 0 unchanged
    out = run(feats, n2)
    assert torch.allclose(out[:, :3], base[:, :3])
    n3 = noise.clone()
    n3[:, 2] += 1.0  # the last slot of block 0 changes its first slot too: bidirectional inside a block
    assert not torch.allclose(run(feats, n3)[:, 0], base[:, 0])


def test_sparse_block_mask_is_the_dense_mask():
    """The flex-attention BlockMask (--attention sparse) marks exactly the dense mask's entries, padded
    anchors included."""
    anchors = torch.tensor([[1, 4, 9], [0, 2, 0]])
    sparse = block_sparse_mask(anchors, 12, 4)
    dense = block_attention_mask(anchors, 12, 4)
    b, q, kv = torch.meshgrid(torch.arange(2), torch.arange(12), torch.arange(12 + 12), indexing="ij")
    assert torch.equal(sparse.mask_mod(b, torch.zeros_like(b), q, kv), dense[:, 0])
    assert sparse.shape[-2:] == dense.shape[-2:]


def _loss_with_mask(trainer: Trainer, batch, sparse: bool, monkeypatch):
    """forward_loss with the dense or the sparse mask and the same anchors; checks which mask it built."""
    built = []
    make = trainer_module.make_blocks

    def spy(*args, **kwargs):
        blocks = make(*args, **kwargs)
        built.append(blocks.attention_mask)
        return blocks

    trainer.sparse_mask = sparse
    trainer.anchor_generator.manual_seed(7)
    with monkeypatch.context() as m:
        m.setattr(trainer_module, "make_blocks", spy)
        part = trainer.forward_loss(batch)
    assert isinstance(built[0], BlockMask) == sparse
    return part


@pytest.mark.filterwarnings("ignore:.*flex_attention.*")
@pytest.mark.parametrize("amp", ["off", "bf16"])
def test_sparse_attention_loss_equals_dense(tmp_path, amp, monkeypatch):
    """A training forward with the BlockMask (flex attention: eager here, the dense computation the
    compiled CUDA kernel must match) gives the dense forward's loss, also under bf16 autocast. Forward
    only: PyTorch has no flex-attention backward on CPU, so the sparse step itself is CUDA only."""
    trainer = make_trainer(tmp_path, tiny_target(), tiny_tokenizer(), distill_weight=0.5, amp=amp)
    assert not trainer.sparse_mask  # the default
    batch = trainer.batch([0, 1, 2])
    with torch.no_grad():
        dense, sparse = (_loss_with_mask(trainer, batch, s, monkeypatch) for s in (False, True))
    tol = 1e-5 if amp == "off" else 2e-2
    assert float(sparse.loss) == pytest.approx(float(dense.loss), rel=tol)
    if amp == "off":
        assert torch.equal(sparse.slot_correct, dense.slot_correct)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex attention trains on CUDA only")
def test_sparse_attention_step_equals_dense_on_cuda(tmp_path):
    """GPU check of --attention sparse: compiled flex attention, bf16 autocast, backward; lengths over
    the kernel's 128-token tile and not a multiple of it (context 150, 12 anchors x 16 = 192 queries)."""
    target = tiny_target().to("cuda")
    data = tmp_path / "long.jsonl"
    rng = torch.Generator().manual_seed(0)
    with open(data, "w") as f:
        for i in range(4):
            f.write(json.dumps({"id": f"r{i}", "prompt": words(rng, 10), "response": words(rng, 140)}) + "\n")
    results = {}
    for attention in ("dense", "sparse"):
        trainer = make_trainer(tmp_path, target, tiny_tokenizer(), data=str(data), out_dir=str(tmp_path / attention),
                               attention=attention, amp="bf16", block_size=16, max_anchors=12, max_length=150,
                               distill_weight=0.5)
        assert trainer.sparse_mask == (attention == "sparse")
        trainer.anchor_generator.manual_seed(7)
        part = trainer.forward_loss(trainer.batch([0, 1, 2, 3]))
        part.loss.backward()
        results[attention] = (float(part.loss),
                              {n: p.grad.float().cpu() for n, p in trainer.drafter.named_parameters()})
    (dense_loss, dense_grads), (sparse_loss, sparse_grads) = results["dense"], results["sparse"]
    assert sparse_loss == pytest.approx(dense_loss, rel=2e-2)
    for name, g in dense_grads.items():
        cos = torch.nn.functional.cosine_similarity(sparse_grads[name].flatten(), g.flatten(), dim=0)
        assert cos > 0.98, (name, float(cos))


def test_attention_setting_is_validated(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "w1"}\n')
    with pytest.raises(TrainConfigError, match="--attention"):
        TrainConfig(target=".", data=str(tmp_path / "d.jsonl"), out_dir=str(tmp_path), attention="flash")
    if not torch.cuda.is_available():
        with pytest.raises(DFlashError, match="--attention sparse needs a CUDA device"):
            make_trainer(tmp_path, tiny_target(), tiny_tokenizer(), attention="sparse")


# -- data, features, regeneration -----------------------------------------------------------------------


def test_tokenize_masks_response_only(tmp_path):
    tok = tiny_tokenizer()
    sample = tokenize({"id": "a", "prompt": "w1 w2 w3", "response": "w4 w5"}, tok, max_length=100)
    assert sample.input_ids == [5, 6, 7, 8, 9, 1]  # response gets EOS
    assert sample.loss_mask == [0, 0, 0, 1, 1, 1]
    chat = tokenize({"id": "c", "messages": [{"role": "user", "content": "w1"},
                                             {"role": "assistant", "content": "w2 w3"}]}, tok, 100)
    assert sum(chat.loss_mask) >= 2 and chat.loss_mask[0] == 0
    assert tokenize({"id": "b", "prompt": "w1 w2", "response": "w4 w5"}, tok, max_length=3) is None
    (tmp_path / "bad.jsonl").write_text('{"prompt": "w1"}\nnot json\n')
    with pytest.raises(Exception, match="bad.jsonl:2"):
        read_records(tmp_path / "bad.jsonl")


def test_features_match_engine_target_and_cache(tmp_path):
    model, tok = tiny_target(), tiny_tokenizer()
    write_data(tmp_path / "d.jsonl", 3)
    samples, _ = load_samples(tmp_path / "d.jsonl", tok, 40)
    from dflash.training.data import collate

    batch = collate(samples, [0, 1, 2], 0)
    n0 = len(samples[0].input_ids)
    # the engine's TargetModel picks the same layers (hidden_states[i + 1]), with and without the early exit
    for layer_ids, last_hidden in (((0, 2), False), ((1, 3), False), ((0, 2), True)):
        online = OnlineFeatures(model, layer_ids, with_last_hidden=last_hidden)
        assert online.early_exit == (layer_ids == (0, 2) and not last_hidden)
        engine = TargetModel(model, layer_ids).forward_alone(samples[0].input_ids)
        # float32 rounding only: a batch of three and a lone sequence take different kernels (transformers
        # 5.25 differs from the lone pass by up to 1.6e-5 on features of magnitude ~10)
        assert torch.allclose(online(batch).features[0, :n0], engine.features, atol=1e-4)
    got = OnlineFeatures(model, (1, 3), with_last_hidden=True)(batch)
    cache_features(model, samples, tmp_path / "feats", (1, 3), with_last_hidden=True, batch_size=2, pad_id=0,
                   dtype=torch.float32)
    cached = CachedFeatures(tmp_path / "feats", torch.device("cpu"))(batch)
    n = len(samples[1].input_ids)
    assert torch.allclose(cached.features[1, :n], got.features[1, :n], atol=1e-5)
    assert torch.allclose(cached.last_hidden[1, :n], got.last_hidden[1, :n], atol=1e-5)


def test_regenerate_is_resumable(tmp_path):
    model, tok = tiny_target(), tiny_tokenizer()
    write_data(tmp_path / "p.jsonl", 5)
    out = tmp_path / "regen.jsonl"
    regenerate(model, tok, tmp_path / "p.jsonl", out, max_new_tokens=6, batch_size=2)
    full = out.read_text().splitlines()
    assert len(full) == 5
    first = json.loads(full[0])
    assert len(first["response_ids"]) <= 6 and first["prompt_ids"]
    # a killed run: two complete lines and a torn third; resuming completes the rest identically (greedy)
    out.write_text(full[0] + "\n" + full[1] + "\n" + full[2][:10])
    regenerate(model, tok, tmp_path / "p.jsonl", out, max_new_tokens=6, batch_size=2)
    resumed = out.read_text().splitlines()
    def by_id(lines):
        return sorted((json.loads(line)["id"], json.loads(line)["response_ids"]) for line in lines)

    assert by_id(resumed) == by_id(full)


def test_cli_regenerate_writes_the_same_responses_and_extends_the_file(tmp_path, capsys):
    """`dflash regenerate` is the library stage as a command: same lines, and new prompts appended later
    are the only ones generated."""
    target_dir = tmp_path / "target"
    tiny_target().save_pretrained(target_dir)
    tiny_tokenizer().save_pretrained(target_dir)
    write_data(tmp_path / "p.jsonl", 5)
    lib = tmp_path / "lib.jsonl"
    cpu = torch.device("cpu")
    model, tok = load_target(target_dir, cpu, resolve_dtype("auto", cpu))
    regenerate(model, tok, tmp_path / "p.jsonl", lib, max_new_tokens=6, batch_size=2)
    lines = (tmp_path / "p.jsonl").read_text().splitlines()
    (tmp_path / "first3.jsonl").write_text("\n".join(lines[:3]) + "\n")
    out = tmp_path / "cli.jsonl"
    args = ["regenerate", "--target", str(target_dir), "--out", str(out), "--max-new-tokens", "6",
            "--batch-size", "2", "--device", "cpu"]
    assert cli_main(args + ["--data", str(tmp_path / "first3.jsonl")]) == 0
    assert len(out.read_text().splitlines()) == 3
    assert cli_main(args + ["--data", str(tmp_path / "p.jsonl")]) == 0

    def by_id(path):
        return sorted((r["id"], r["response_ids"]) for r in map(json.loads, path.read_text().splitlines()))

    assert by_id(out) == by_id(lib)
    assert cli_main(args + ["--data", str(tmp_path / "p.jsonl"), "--batch-size", "0"]) == 2
    assert "--batch-size must be a positive integer" in capsys.readouterr().err
    assert cli_main(args + ["--data", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


# -- the loop ---------------------------------------------------------------------------------------------


def fixed_loss(trainer: Trainer, batch) -> float:
    saved = trainer.anchor_generator.get_state()
    trainer.anchor_generator.manual_seed(123)
    with torch.no_grad():
        loss = float(trainer.forward_loss(batch).loss)
    trainer.anchor_generator.set_state(saved)
    return loss


@pytest.mark.parametrize("distill", [0.0, 0.5])
def test_training_steps_lower_the_loss(tmp_path, distill):
    trainer = make_trainer(tmp_path, tiny_target(), tiny_tokenizer(), distill_weight=distill, max_steps=50)
    batch = trainer.batch([0, 1])
    before = fixed_loss(trainer, batch)
    for _ in range(8):
        trainer.train_step([batch])
    after = fixed_loss(trainer, batch)
    assert after < before - 0.05, (before, after)
    assert not any(p.grad is not None for p in trainer.model.parameters())


def test_hard_anchor_training_lowers_the_loss_and_validates(tmp_path):
    trainer = make_trainer(tmp_path, tiny_target(), tiny_tokenizer(), hard_anchors=0.7, max_steps=50)
    batch = trainer.batch([0, 1])
    before = fixed_loss(trainer, batch)
    for _ in range(8):
        trainer.train_step([batch])
    assert fixed_loss(trainer, batch) < before - 0.05
    (tmp_path / "d.jsonl").write_text('{"text": "w1"}\n')
    with pytest.raises(TrainConfigError, match="--hard-anchors"):
        TrainConfig(target=".", data=str(tmp_path / "d.jsonl"), out_dir=str(tmp_path), hard_anchors=1.5)
    # A checkpoint from before the setting existed ran with its default: no mismatch.
    saved = TrainConfig(target=".", data=str(tmp_path / "d.jsonl"), out_dir=str(tmp_path)).to_dict()
    del saved["hard_anchors"]
    assert TrainConfig(target=".", data=str(tmp_path / "d.jsonl"), out_dir=str(tmp_path)).resume_mismatch(saved) is None


def test_miss_anchor_training_lowers_the_loss_and_validates(tmp_path):
    """--miss-anchors: steps still lower the loss measured at uniform anchors, and the probe pass leaves no
    gradient behind; the share is validated."""
    trainer = make_trainer(tmp_path, tiny_target(), tiny_tokenizer(), miss_anchors=1.0, max_steps=50)
    batch = trainer.batch([0, 1])
    uniform = dataclasses.replace(trainer.config, miss_anchors=0.0)

    def loss_at_uniform_anchors() -> float:
        trainer.config, probing = uniform, trainer.config
        try:
            return fixed_loss(trainer, batch)
        finally:
            trainer.config = probing

    before = loss_at_uniform_anchors()
    target = trainer.features(batch)
    assert not trainer.probe_misses(batch.input_ids, batch.loss_mask, target.features).requires_grad
    for _ in range(8):
        trainer.train_step([batch])
    assert loss_at_uniform_anchors() < before - 0.05
    (tmp_path / "d.jsonl").write_text('{"text": "w1"}\n')
    with pytest.raises(TrainConfigError, match="--miss-anchors"):
        TrainConfig(target=".", data=str(tmp_path / "d.jsonl"), out_dir=str(tmp_path), miss_anchors=-0.1)


@pytest.mark.parametrize("miss_anchors", [0.0, 0.5])
def test_resume_reproduces_the_uninterrupted_run(tmp_path, miss_anchors):
    tok = tiny_tokenizer()
    # 8 samples, 2 per batch, 2 batches per step: 2 steps an epoch; the crash comes mid epoch 2.
    run = dict(epochs=3, max_steps=5, grad_accum=2, save_every=1, miss_anchors=miss_anchors)
    straight = make_trainer(tmp_path, tiny_target(), tok, out_dir=str(tmp_path / "a"), **run)
    straight.fit()

    broken = make_trainer(tmp_path, tiny_target(), tok, out_dir=str(tmp_path / "b"), **run)
    step = broken.train_step
    calls = []

    def crash_on_fourth(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return step(*args, **kwargs)

    broken.train_step = crash_on_fourth
    with pytest.raises(KeyboardInterrupt):
        broken.fit()
    resumed = make_trainer(tmp_path, tiny_target(), tok, out_dir=str(tmp_path / "b"), resume=True, **run)
    resumed.resume()
    assert (resumed.progress.step, resumed.progress.epoch, resumed.progress.batch_in_epoch) == (3, 1, 2)
    resumed.fit()

    def losses(d):
        records = map(json.loads, (tmp_path / d / "train_log.jsonl").open())
        return {r["step"]: r["loss"] for r in records if r["event"] == "train"}

    a, b = losses("a"), losses("b")
    assert list(b) == [1, 2, 3, 4, 5]  # steps after the checkpoint were logged once, not twice
    assert a[4] == b[4] and a[5] == b[5]
    for (name, x), y in zip(straight.drafter.state_dict().items(), resumed.drafter.state_dict().values()):
        assert torch.equal(x, y), name


def test_resume_refuses_other_settings(tmp_path):
    tok = tiny_tokenizer()
    make_trainer(tmp_path, tiny_target(), tok, max_steps=2).fit()
    other = make_trainer(tmp_path, tiny_target(), tok, max_steps=2, lr=1e-3, resume=True)
    with pytest.raises(Exception, match="lr"):
        other.resume()


def test_schedule_is_linear_warmup_then_cosine_to_zero(tmp_path):
    """transformers' cosine schedule with warmup: from the end of warmup on, the learning rate is what the
    hand-written schedule it replaced gave at every step (peak, cosine decay to 0); warmup rises linearly
    from 0 (the hand-written one started one warmup step further up)."""
    # 8 samples, 2 per batch: 4 steps an epoch, 12 steps, warmup ceil(0.25 * 12) = 3.
    trainer = make_trainer(tmp_path, tiny_target(), tiny_tokenizer(), epochs=3, warmup_ratio=0.25, lr=3e-3)
    assert trainer.total_steps == 12
    lrs = []
    for _ in range(trainer.total_steps + 1):
        lrs.append(trainer.scheduler.get_last_lr()[0])
        trainer.optimizer.step()
        trainer.scheduler.step()
    warmup, total = 3, 12
    for step in range(warmup, total + 1):
        hand_written = 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup))))
        assert lrs[step] == pytest.approx(3e-3 * hand_written, rel=1e-12, abs=1e-15), step
    assert lrs[:warmup + 1] == pytest.approx([0.0, 1e-3, 2e-3, 3e-3])
    assert lrs[7] == pytest.approx(3e-3 * 0.5 * (1 + math.cos(math.pi * 4 / 9))) and lrs[total] == 0.0


def test_config_validation(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "w1"}\n')
    ok = dict(target=".", data=str(tmp_path / "d.jsonl"), out_dir=str(tmp_path))
    with pytest.raises(TrainConfigError, match="--block-size"):
        TrainConfig(**ok, block_size=1)
    with pytest.raises(TrainConfigError, match="--distill-weight"):
        TrainConfig(**ok, distill_weight=1.5)
    with pytest.raises(TrainConfigError, match="--data"):
        TrainConfig(**{**ok, "data": str(tmp_path / "missing.jsonl")})


# -- end to end: CLI, checkpoint format, engine equality --------------------------------------------------


def test_cli_train_end_to_end(tmp_path):
    """Regenerate with a target that counts, train, and the engine accepts most drafts, losslessly."""
    target_dir = tmp_path / "target"
    counting_target().save_pretrained(target_dir)
    tiny_tokenizer().save_pretrained(target_dir)
    g = torch.Generator().manual_seed(1)
    for name, num in (("data.jsonl", 256), ("eval.jsonl", 4)):
        with open(tmp_path / name, "w") as f:
            for row in progressions(num, 5, g).tolist():
                f.write(json.dumps({"prompt_ids": row}) + "\n")
    out = tmp_path / "drafter"
    rc = cli_main(["train", "--target", str(target_dir), "--data", str(tmp_path / "data.jsonl"), "--out", str(out),
                   "--regenerate", "--regen-max-new-tokens", "24", "--regen-batch-size", "64",
                   "--eval-prompts", str(tmp_path / "eval.jsonl"), "--eval-max-new-tokens", "24",
                   "--block-size", "4", "--target-layer-ids", "0,2", "--batch-size", "8", "--max-length", "32",
                   "--max-anchors", "8", "--epochs", "4", "--lr", "3e-3", "--device", "cpu"])
    assert rc == 0
    assert len((out / "regenerated.jsonl").read_text().splitlines()) == 256
    for d in (out, out / "epoch-1", out / "epoch-4"):
        assert load_drafter(d).config.block_size == 4
    log = [json.loads(line) for line in (out / "train_log.jsonl").open()]
    assert [r["step"] for r in log if r["event"] == "train"][-1] == 4 * 32
    taus = [r["tau"] for r in log if r["event"] == "eval"]
    assert len(taus) == 4 and taus[-1] > 2.5, taus  # block 4: at most 4 tokens per round

    # Every proposal verified: this checks the trained drafter, not the verify policy's choice on 2 cores.
    engine = build_engine(target_dir, out, device="cpu", dtype="float32",
                          scheduler=SchedulerConfig(verify_policy="full"))
    plain = build_engine(target_dir, None, device="cpu", dtype="float32")
    for prompt in ([10, 12, 14], [5, 9, 40, 41]):
        params = SamplingParams(max_new_tokens=20, ignore_eos=True)
        spec = engine.run(prompt, params)
        assert spec.token_ids == plain.run(prompt, params).token_ids
        single = engine.run(prompt, SamplingParams(max_new_tokens=20, ignore_eos=True, block_size=1))
        assert single.token_ids == spec.token_ids
    assert spec.stats.tau > 1.0


def test_cli_train_offline_features_with_distillation_and_resume_guard(tmp_path, capsys):
    target_dir = tmp_path / "target"
    tiny_target().save_pretrained(target_dir)
    tiny_tokenizer().save_pretrained(target_dir)
    write_data(tmp_path / "data.jsonl", 4)
    out = tmp_path / "drafter"
    args = ["train", "--target", str(target_dir), "--data", str(tmp_path / "data.jsonl"), "--out", str(out),
            "--offline-features", "--distill-weight", "0.5", "--block-size", "4", "--target-layer-ids", "0,2",
            "--batch-size", "2", "--max-length", "32", "--max-anchors", "4", "--steps", "2", "--device", "cpu"]
    assert cli_main(args) == 0
    assert sorted(p.name for p in (out / "features").iterdir()) == ["meta.json", "shard-00000.safetensors"]
    assert load_drafter(out).config.target_layer_ids == (0, 2)
    assert cli_main(args) == 2  # a second fresh run would overwrite the checkpoint
    assert "--resume" in capsys.readouterr().err
    assert cli_main(args + ["--resume"]) == 0  # already finished: resumes, saves, exits


@pytest.mark.parametrize("offline,flags", [(False, ["--hard-anchors", "0.5"]), (True, ["--hard-anchors", "0.5"]),
                                           (False, ["--miss-anchors", "0.5"]),
                                           (True, ["--miss-anchors", "0.5", "--hard-anchors", "0.5"])])
def test_cli_train_weighted_anchors(tmp_path, offline, flags):
    """--hard-anchors reads the target's predictions: online, and from a feature cache that then holds them;
    --miss-anchors probes the drafter, alone or together with --hard-anchors."""
    target_dir = tmp_path / "target"
    tiny_target().save_pretrained(target_dir)
    tiny_tokenizer().save_pretrained(target_dir)
    write_data(tmp_path / "data.jsonl", 4)
    args = ["train", "--target", str(target_dir), "--data", str(tmp_path / "data.jsonl"), "--out", str(tmp_path / "o"),
            "--block-size", "4", "--target-layer-ids", "0,2", "--batch-size", "2", "--max-length", "32",
            "--max-anchors", "4", "--device", "cpu", "--steps", "2"] + flags
    assert cli_main(args + (["--offline-features"] if offline else [])) == 0
    assert load_drafter(tmp_path / "o").config.target_layer_ids == (0, 2)
    if offline and "--hard-anchors" in flags:
        assert json.loads((tmp_path / "o" / "features" / "meta.json").read_text())["with_last_hidden"] is True


def test_cli_train_without_mask_token_fails_clearly(tmp_path, capsys):
    target_dir = tmp_path / "target"
    tiny_target().save_pretrained(target_dir)
    tok = tiny_tokenizer()
    tok.mask_token = None
    tok.save_pretrained(target_dir)
    write_data(tmp_path / "data.jsonl", 2)
    rc = cli_main(["train", "--target", str(target_dir), "--data", str(tmp_path / "data.jsonl"),
                   "--out", str(tmp_path / "o"), "--device", "cpu"])
    assert rc == 2
    assert "--mask-token-id" in capsys.readouterr().err


def init_drafter_args(tmp_path) -> list[str]:
    """`dflash train` arguments for one-step runs on a saved tiny target (add --out and the flags under test)."""
    target_dir = tmp_path / "target"
    tiny_target().save_pretrained(target_dir)
    tiny_tokenizer().save_pretrained(target_dir)
    write_data(tmp_path / "data.jsonl", 8)
    return ["train", "--target", str(target_dir), "--data", str(tmp_path / "data.jsonl"), "--block-size", "4",
            "--target-layer-ids", "0,2", "--batch-size", "2", "--max-length", "32", "--max-anchors", "4",
            "--device", "cpu", "--steps", "1"]


def test_cli_train_init_drafter_starts_from_its_weights(tmp_path, capsys):
    """--init-drafter: a run starts from the given drafter's weights; a shape mismatch is named."""
    common = init_drafter_args(tmp_path)
    first = tmp_path / "first"
    assert cli_main(common + ["--out", str(first), "--lr", "3e-3", "--seed", "5"]) == 0
    # A vanishing learning rate keeps the weights where they started.
    second = tmp_path / "second"
    assert cli_main(common + ["--out", str(second), "--lr", "1e-12", "--init-drafter", str(first)]) == 0
    fresh = tmp_path / "fresh"
    assert cli_main(common + ["--out", str(fresh), "--lr", "1e-12"]) == 0
    a, b, c = (load_drafter(d).state_dict() for d in (first, second, fresh))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)

    capsys.readouterr()
    rc = cli_main(common + ["--out", str(tmp_path / "bad"), "--init-drafter", str(first), "--block-size", "8"])
    assert rc == 2
    assert "block_size=4" in capsys.readouterr().err
    rc = cli_main(common + ["--out", str(tmp_path / "bad2"), "--init-drafter", str(tmp_path / "nowhere")])
    assert rc == 2
    assert "--init-drafter" in capsys.readouterr().err


def test_cli_train_init_drafter_grows_more_layers(tmp_path, capsys):
    """More --num-layers than the --init-drafter has: the new top layers start as no-ops, so the grown drafter
    drafts exactly what the smaller one did; fewer layers are refused by name."""
    common = init_drafter_args(tmp_path)
    small = tmp_path / "small"
    assert cli_main(common + ["--out", str(small), "--num-layers", "2", "--lr", "3e-3"]) == 0
    grown = tmp_path / "grown"
    assert cli_main(common + ["--out", str(grown), "--num-layers", "4", "--lr", "1e-12",
                              "--init-drafter", str(small)]) == 0
    assert "layers 2..3 start as copies" in capsys.readouterr().out
    a, b = load_drafter(small, dtype=torch.float32), load_drafter(grown, dtype=torch.float32)
    assert b.config.num_hidden_layers == 4
    torch.manual_seed(0)
    noise, context = torch.randn(1, 4, 32), torch.randn(1, 6, 64)
    positions = torch.arange(10)[None]
    with torch.no_grad():
        assert torch.allclose(a(noise, context, positions), b(noise, context, positions), atol=1e-5)
    rc = cli_main(common + ["--out", str(tmp_path / "bad"), "--num-layers", "1", "--init-drafter", str(small)])
    assert rc == 2
    assert "num_hidden_layers=2" in capsys.readouterr().err


def test_cli_train_init_drafter_may_read_other_target_layers(tmp_path, capsys):
    """Explicit --target-layer-ids may re-point a drafter at other target layers, as many as it read: the
    weights carry over and the saved drafter reads the new layers; a different count is named."""
    target_dir = tmp_path / "target"
    tiny_target().save_pretrained(target_dir)
    tiny_tokenizer().save_pretrained(target_dir)
    write_data(tmp_path / "data.jsonl", 8)
    common = ["train", "--target", str(target_dir), "--data", str(tmp_path / "data.jsonl"), "--block-size", "4",
              "--batch-size", "2", "--max-length", "32", "--max-anchors", "4", "--device", "cpu", "--steps", "1"]
    first = tmp_path / "first"
    assert cli_main(common + ["--out", str(first), "--target-layer-ids", "0,1", "--lr", "3e-3"]) == 0
    moved = tmp_path / "moved"
    assert cli_main(common + ["--out", str(moved), "--target-layer-ids", "0,2", "--lr", "1e-12",
                              "--init-drafter", str(first)]) == 0
    assert "reads [0, 2]" in capsys.readouterr().out
    a, b = load_drafter(first), load_drafter(moved)
    assert b.config.target_layer_ids == (0, 2)
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())

    rc = cli_main(common + ["--out", str(tmp_path / "bad"), "--target-layer-ids", "0,1,2",
                            "--init-drafter", str(first)])
    assert rc == 2
    assert "target_layer_ids=(0, 1)" in capsys.readouterr().err
    # Without explicit ids the flags' own layers (here [2]) must be the ones the drafter read.
    single = tmp_path / "single"
    assert cli_main(common + ["--out", str(single), "--target-layer-ids", "0"]) == 0
    capsys.readouterr()
    rc = cli_main(common + ["--out", str(tmp_path / "bad2"), "--num-features", "1", "--init-drafter", str(single)])
    assert rc == 2
    assert "target_layer_ids=(0,) but these flags build target_layer_ids=(2,)" in capsys.readouterr().err
