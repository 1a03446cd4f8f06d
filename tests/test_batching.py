"""The paged KV cache and continuous batching (infer/paged.py, infer/batching.py): greedy outputs equal the
contiguous-cache generator's token for token, whatever joins or leaves the batch, under preemption and in a pool
that fits one sequence at a time; quantized caches agree closely; the pool returns to empty."""

import pytest
import torch

from lit_model import GPT, Config
from lit_model.core.errors import UsageError
from lit_model.infer.batching import Engine, Event, Request
from lit_model.infer.engine import Generator, Sampling
from lit_model.infer.load import Precision
from lit_model.infer.paged import BlockPool, PoolSpec, block_bytes, blocks_for, read_bytes, set_paged_cache

TINY = dict(name="tiny", block_size=128, vocab_size=300, n_layer=2, n_embd=32, n_head=4, n_query_groups=2)
# Gemma-2-like: local attention on every other layer, soft-capped scores
LOCAL = dict(TINY, name="tiny-local", sliding_window_size=8, sliding_window_layer_stride=2,
             attention_logit_softcapping=20.0)
FP32 = Precision("32-true", torch.float32, autocast=None)
GREEDY = Sampling(temperature=0)


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(seed: int = 0, **fields) -> GPT:
    torch.manual_seed(seed)
    model = GPT(Config(**{**TINY, **fields}))
    model.init_weights()
    with torch.no_grad():  # larger weights than the init's: logits far apart, so rounding never flips a greedy token
        for p in model.parameters():
            p.mul_(4 if p.ndim == 2 else 1)
    return model.eval()


def prompts(count: int, seed: int = 1) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(1, 300, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist())
            for _ in range(count)]


def reference(model: GPT, prompt: tuple[int, ...], max_new_tokens: int, **kw) -> list[int]:
    """The contiguous-cache generator's greedy tokens (infer/engine.Generator)."""
    model.clear_kv_cache()
    generator = Generator(model, FP32, GREEDY)
    return generator.generate(torch.tensor(prompt), max_new_tokens, **kw).tokens[0]


def run(engine: Engine, requests: list[Request], join_every: int = 0) -> dict[str, list[int]]:
    """Every request to its end: all at once, or one more joining every ``join_every`` steps."""
    out: dict[str, list[int]] = {r.id: [] for r in requests}
    ends: dict[str, str] = {}
    pending = list(requests)
    steps = 0
    while pending or engine.has_work():
        if pending and (join_every == 0 or steps % join_every == 0):
            for request in pending if join_every == 0 else pending[:1]:
                engine.add(request)
            pending = [] if join_every == 0 else pending[1:]
        for event in engine.step():
            out[event.id] += event.tokens
            if event.finish_reason:
                ends[event.id] = event.finish_reason
        steps += 1
        assert steps < 10_000
    assert set(ends) == set(out) and all(r in ("stop", "length") for r in ends.values()), ends
    return out


@pytest.mark.parametrize("fields", [{}, LOCAL], ids=["plain", "local-softcap"])
@pytest.mark.parametrize("join_every", [0, 3])
def test_greedy_equals_generator_while_requests_join_and_leave(fields, join_every):
    model = tiny_model(**fields)
    texts = prompts(6)
    lengths = [5, 17, 1, 30, 9, 22]
    expected = [reference(model, p, n) for p, n in zip(texts, lengths)]
    engine = Engine(model, FP32, PoolSpec(num_blocks=64, block_size=4), max_batch=4)
    out = run(engine, [Request(str(i), p, n, GREEDY) for i, (p, n) in enumerate(zip(texts, lengths))], join_every)
    assert [out[str(i)] for i in range(6)] == expected
    assert engine.stats().free_blocks == 64 and engine.stats().running == engine.stats().waiting == 0


def test_preemption_recomputes_to_the_same_tokens():
    """A pool of 12 blocks of 4 positions holds one 40-token sequence: the others wait or are preempted and
    recomputed, and every output is the generator's."""
    model = tiny_model()
    texts = prompts(5, seed=2)
    expected = [reference(model, p, 20) for p in texts]
    engine = Engine(model, FP32, PoolSpec(num_blocks=16, block_size=4))
    out = run(engine, [Request(str(i), p, 20, GREEDY) for i, p in enumerate(texts)])
    assert [out[str(i)] for i in range(5)] == expected
    assert engine.stats().preemptions > 0 and engine.stats().free_blocks == 16


def test_a_step_reads_at_most_its_budget(monkeypatch):
    """A decoding step whose batch would read more positions than ``max_read`` runs in several forwards (rows of
    similar lengths together, a row alone where it is longer than the budget), with the same tokens."""
    model = tiny_model()
    texts = prompts(6, seed=8)
    expected = [reference(model, p, 16) for p in texts]
    engine = Engine(model, FP32, PoolSpec(num_blocks=64, block_size=4))
    engine.max_read = 40
    forward, reads = engine._forward, []

    def counting(batch, new_tokens):
        if len(new_tokens[0]) == 1:  # decoding: every row read as long as the longest
            reads.append((len(batch), len(batch) * max(len(s.blocks) for s in batch) * 4))
        return forward(batch, new_tokens)

    monkeypatch.setattr(engine, "_forward", counting)
    out = run(engine, [Request(str(i), p, 16, GREEDY) for i, p in enumerate(texts)])
    assert [out[str(i)] for i in range(6)] == expected
    assert all(rows == 1 or read <= 40 for rows, read in reads) and any(rows == 1 and read > 40 for rows, read in reads)
    assert any(rows > 1 for rows, _ in reads)


def test_out_of_memory_inside_a_step_preempts_the_newest(monkeypatch):
    model = tiny_model()
    texts = prompts(4, seed=3)
    expected = [reference(model, p, 12) for p in texts]
    engine = Engine(model, FP32, PoolSpec(num_blocks=64, block_size=4))
    forward = engine._forward
    failures = iter([True, True, False] + [False] * 1000)

    def flaky(batch, new_tokens):  # the first batched decoding steps run out of memory
        if len(batch) > 1 and next(failures):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return forward(batch, new_tokens)

    monkeypatch.setattr(engine, "_forward", flaky)
    out = run(engine, [Request(str(i), p, 12, GREEDY) for i, p in enumerate(texts)])
    assert [out[str(i)] for i in range(4)] == expected
    assert engine.stats().preemptions == 2


def test_stop_tokens_sequences_and_held_back_tokens():
    model = tiny_model()
    prompt = prompts(1, seed=4)[0]
    free = reference(model, prompt, 30)
    stop = tuple(free[10:12])
    engine = Engine(model, FP32, PoolSpec(num_blocks=32, block_size=8))
    engine.add(Request("s", prompt, 30, GREEDY, eos_ids=(free[20],), stop_sequences=(stop,)))
    events: list[Event] = []
    while engine.has_work():
        events += engine.step()
    kept = [t for e in events for t in e.tokens]
    end = next(i for i in range(len(free)) if free[i] == free[20] or tuple(free[i:i + 2]) == stop)
    assert kept == free[:end] and end <= 10
    assert events[-1].finish_reason == "stop"
    # a token is held back while it could begin the stop sequence: no event shows stop[0] before the end
    assert all(stop[0] not in e.tokens for e in events if e.finish_reason is None)


def test_cancel_frees_blocks_and_reports():
    model = tiny_model()
    engine = Engine(model, FP32, PoolSpec(num_blocks=32, block_size=4))
    engine.add(Request("a", prompts(1)[0], 50, GREEDY))
    engine.add(Request("b", prompts(1, seed=9)[0], 5, GREEDY))
    engine.step()
    assert engine.stats().free_blocks < 32
    engine.cancel("a")
    events = []
    while engine.has_work():
        events += engine.step()
    assert Event("a", finish_reason="cancelled") in events
    assert [e.finish_reason for e in events if e.id == "b"][-1] == "length"
    assert engine.stats().free_blocks == 32


def test_rejection_names_the_limit():
    engine = Engine(tiny_model(), FP32, PoolSpec(num_blocks=4, block_size=4))
    assert "16 tokens" in engine.rejection(Request("x", (1,) * 10, 10))  # the pool: 4 x 4
    assert "context of 128" in engine.rejection(Request("x", (1,) * 100, 40))
    assert "empty" in engine.rejection(Request("x", (), 4))
    assert engine.rejection(Request("x", (1,) * 10, 6)) is None
    with pytest.raises(ValueError, match="pool"):
        engine.add(Request("x", (1,) * 10, 10))


def test_seeded_sampling_is_per_request():
    """A request's samples depend on its seed alone, not on what else is in the batch."""
    model = tiny_model()
    prompt = prompts(1)[0]
    alone = Engine(model, FP32, PoolSpec(num_blocks=64, block_size=4))
    sampled = Sampling(temperature=1.0, top_k=None, seed=7)
    a = run(alone, [Request("a", prompt, 15, sampled)])["a"]
    crowd = Engine(model, FP32, PoolSpec(num_blocks=64, block_size=4))
    others = [Request(str(i), p, 15, Sampling(temperature=1.0, seed=i)) for i, p in enumerate(prompts(3, seed=5))]
    b = run(crowd, [*others, Request("a", prompt, 15, sampled)])["a"]
    assert a == b


@pytest.mark.parametrize("kv_dtype,agreement", [("bf16", 0.9), ("int8", 0.9), ("fp8", 0.6)])
def test_quantized_cache_agrees(kv_dtype, agreement):
    """Greedy tokens with a bf16 / int8 / fp8 cache (int8, fp8: a scale per block and head) against the fp32
    cache's: the share of equal tokens up to each request's first difference, over 6 requests of 24 tokens. On this
    tiny model (prompt seeds 6 and 7): bf16 1.0 and 0.94, int8 1.0 and 0.92, fp8 (3 mantissa bits) 0.67 and 0.81."""
    model = tiny_model()
    texts = prompts(6, seed=6)
    exact = run(Engine(model, FP32, PoolSpec(64, 4)), [Request(str(i), p, 24, GREEDY) for i, p in enumerate(texts)])
    engine = Engine(model, FP32, PoolSpec(64, 4, kv_dtype))
    quantized = run(engine, [Request(str(i), p, 24, GREEDY) for i, p in enumerate(texts)])
    same = 0
    for i in map(str, range(6)):
        same += next((j for j, (a, b) in enumerate(zip(exact[i], quantized[i])) if a != b), len(exact[i]))
    assert same / (6 * 24) >= agreement
    stored = {"bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv_dtype]
    assert engine.model.blocks[0].attn.kv_cache.k.dtype == stored


def test_quantized_block_rescales_when_a_larger_value_arrives():
    """Writing a token larger than a block holds rescales the block: earlier values stay within the new scale's
    rounding, none clips."""
    config = Config(**TINY)
    pool = BlockPool(PoolSpec(num_blocks=2, block_size=4, kv_dtype="int8"))
    model = GPT(config)
    set_paged_cache(model, pool, torch.int8)
    cache = model.blocks[0].attn.kv_cache
    pool.bind([[1]])
    g = torch.Generator().manual_seed(0)
    small = torch.randn(1, 2, 2, 8, generator=g)
    big = 10 * torch.randn(1, 2, 1, 8, generator=g)
    cache.update(torch.tensor([[0, 1]]), small, small, None, None)
    k, _, mask = cache.update(torch.tensor([[2]]), big, big, None, None)
    step = big.abs().amax(dim=(0, 2, 3)) / 127  # the block's scale per head after the big token
    assert torch.all((k[0, :, :2] - small[0]).abs() <= step[:, None, None] * 1.01)
    assert torch.allclose(k[0, :, 2], big[0, :, 0], atol=float(step.max()) / 2 * 1.01)
    assert mask.shape == (1, 1, 1, 4) and mask[0, 0, 0].tolist() == [True, True, True, False]


def test_block_bytes_and_paged_holds_more_than_reserved():
    config = Config(**TINY)
    assert block_bytes(config, 16, "auto", torch.bfloat16) == 2 * 2 * 16 * 2 * 8 * 2
    assert block_bytes(config, 16, "int8", torch.bfloat16) == 2 * (2 * 16 * 2 * 8 + 2 * 2 * 4)
    assert blocks_for(17, 16) == 2
    with pytest.raises(UsageError, match="kv_cache_dtype"):
        block_bytes(config, 16, "int4", torch.bfloat16)


def test_read_bytes_is_what_a_layer_read_makes():
    """The plan's transient of a layer's read equals the keys, values and mask a read returns (16/32-bit cache)."""
    config = Config(**TINY)
    model = GPT(config)
    pool = BlockPool(PoolSpec(num_blocks=8, block_size=4))
    set_paged_cache(model, pool, torch.float32)
    pool.bind([[0, 1, 2], [3]])
    x = torch.randn(2, 2, 1, 8)
    k, v, mask = model.blocks[0].attn.kv_cache.update(torch.tensor([[9], [2]]), x, x, None, None)
    assert read_bytes(config, 2, 12, "auto", torch.float32) == k.nbytes + v.nbytes + mask.nbytes
    # int8: the stored values gathered before they are dequantized, and a scale per position and head
    assert read_bytes(config, 2, 12, "int8", torch.float32) == k.nbytes + v.nbytes + mask.nbytes + k.numel() * 2 + (
        2 * 2 * 12 * 2 * 4)


# ---- prefix caching ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
@pytest.mark.parametrize("fields", [{}, LOCAL], ids=["plain", "local-softcap"])
def test_prefix_caching_shares_full_blocks_and_changes_no_token(fields, kv_dtype):
    """A request that begins like an earlier one (a chat's next turn, a shared system prompt, several at once) takes
    the earlier one's full blocks and computes only the rest; every output is what the engine computes without."""
    model = tiny_model(**fields)
    system = prompts(1, seed=5)[0] * 3  # 3 x up to 39 tokens: several blocks of 4
    turns = [system + p for p in prompts(4, seed=6)]
    requests = [Request(str(i), p, 7, GREEDY) for i, p in enumerate(turns)]
    requests.append(Request("4", turns[0] + (11, 12, 13), 7, GREEDY))  # begins with request 0's tokens
    expected = run(Engine(model, FP32, PoolSpec(64, 4, kv_dtype), max_batch=4), requests)
    engine = Engine(model, FP32, PoolSpec(64, 4, kv_dtype), max_batch=4, prefix_caching=True)
    assert run(engine, requests[:1]) == {"0": expected["0"]}
    assert engine.stats().shared_positions == 0 and engine.stats().free_blocks == 64
    assert run(engine, requests[1:]) == {k: v for k, v in expected.items() if k != "0"}
    # requests 1-3 share the system prompt's full blocks, 4 request 0's blocks up to its last full one
    shared = [len(system) // 4 * 4] * 3 + [(len(turns[0]) + 2) // 4 * 4]
    assert engine.stats().shared_positions == sum(shared)
    assert engine.stats().free_blocks == 64  # remembered blocks no sequence holds count as free


def test_prefix_caching_reuses_remembered_blocks_last_and_forgets_on_a_weight_change():
    model = tiny_model()
    first, other = prompts(2, seed=7)
    first = first * 2
    engine = Engine(model, FP32, PoolSpec(blocks_for(len(first) + 3, 4) + 1, 4), max_batch=1, prefix_caching=True)
    run(engine, [Request("a", first, 3, GREEDY)])
    remembered = dict(engine.pool.block_of_prefix)
    assert len(remembered) == (len(first) + 2) // 4  # every full block it wrote, generated positions included
    run(engine, [Request("b", first, 3, GREEDY)])
    assert engine.stats().shared_positions == (len(first) - 1) // 4 * 4
    # a request that needs the whole pool takes the remembered blocks (oldest first) once the free ones run out
    long = tuple(range(1, engine.pool.spec.num_blocks * 4 - 2))  # with its 3 new tokens: every position
    expected = run(Engine(model, FP32, PoolSpec(64, 4), max_batch=1), [Request("c", long, 3, GREEDY)])
    assert run(engine, [Request("c", long, 3, GREEDY)]) == expected
    assert not set(remembered) & set(engine.pool.block_of_prefix)  # their prefixes forgotten
    engine.forget_prefixes()
    assert not engine.pool.block_of_prefix and engine.stats().free_blocks == engine.stats().total_blocks
    before = engine.stats().shared_positions
    run(engine, [Request("d", long, 3, GREEDY)])
    assert engine.stats().shared_positions == before
