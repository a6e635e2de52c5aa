"""The Triton extend-attention kernel against the SDPA reference.

On a machine without CUDA the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``,
set by ``tests/conftest.py`` before anything imports Triton), on CPU tensors; on CUDA the
``gpu`` tests run it compiled, in fp32, bf16 and fp16. The interpreter cannot run a bf16
``tl.dot`` (it multiplies the bit patterns, triton-lang/triton#11584), so on CPU the
16-bit path is checked in fp16 and the bf16 cases skip.

* Random pools, page tables in any order, several sequences in one launch with different
  prefixes (0 and > 0) and extends (1 to 70), page sizes 1 (slot tables) / 4 / 16, GQA
  groups 1/2/3/4/8 (one program serves a KV head's whole group), head sizes 48/64/80,
  with and without a sliding window, lengths that end mid-page and mid-block: the kernel
  equals SDPA over the gathered keys with the causal-after-prefix mask (fp32: 1e-5;
  fp16/bf16 inputs: 1e-2 / 2e-2); also when writing into given rows of a larger output.
* The launch: one program per (sequence, block of tokens, KV head), with a query tile of
  16 to 128 rows (tokens x padded group) whatever the group and ``block_m``.
* Through the runner: a mixed batch (an extend over a cached prefix, a prefill and a
  decode) with ``attention_backend="triton"`` gives the SDPA runner's logits.
* Engine: greedy generations with chunked prefill over a cached prefix are the same with
  the kernels as with SDPA.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from hicache.memory import DevicePool
from hicache.runner import ModelRunner, kv_spec_from_hf_config
from hicache.runner.kernels import AttentionBackend
from hicache.runner.model_runner import ForwardBatch
from tests.helpers.engine_fixtures import engine_model, prompt_ids, random_pool

pytest.importorskip("triton")

from hicache.runner.kernels import extend_attention
from hicache.runner.kernels.extend_attention import paged_extend_attention

TOL = 1e-4
"""Logits of the kernel runner against the SDPA runner: test_engine_model's bound on fp32
logits (``order_bound(128, 8.3)`` = 1.3e-4). Measured at most 6.1e-6."""
ATTN_TOL = 1e-5
"""fp32 attention against SDPA: each output is ``sum_j p_j v_j`` over n <= 110 keys
(``p >= 0``, ``sum p = 1``, ``|v| <= 4.5`` from N(0, 1)), summed by blocks in the kernel:
about sqrt(n) eps |v| = 6e-6 typically, ``order_bound(110, 4.5)`` = 6e-5 at worst; measured
at most 1.2e-6 on every dispatch."""


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: list[torch.Tensor],
    prefixes: list[int],
    extends: list[int],
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """SDPA over each sequence's gathered keys: ``q (T, Hq, D)`` -> ``(T, Hq, D)`` fp32."""
    out, row = [], 0
    for s, p, n in zip(slots, prefixes, extends, strict=True):
        ki, vi = k[s].float().transpose(0, 1)[None], v[s].float().transpose(0, 1)[None]
        qi = q[row : row + n].float().transpose(0, 1)[None]
        q_pos = torch.arange(p, p + n)[:, None]
        k_pos = torch.arange(p + n)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        o = F.scaled_dot_product_attention(qi, ki, vi, mask, scale=scale, enable_gqa=True)
        out.append(o[0].transpose(0, 1))
        row += n
    return torch.cat(out)


def random_case(
    *,
    page_size: int,
    group: int,
    dim: int,
    prefixes: list[int],
    extends: list[int],
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
    hkv: int = 2,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """q, k/v pool layer and page table over shuffled pages, plus each sequence's slots."""
    pool = random_pool(
        [p + n for p, n in zip(prefixes, extends, strict=True)],
        queries=sum(extends),
        page_size=page_size,
        group=group,
        dim=dim,
        dtype=dtype,
        device=device,
        seed=seed,
        hkv=hkv,
        spare_pages=3,
    )
    return pool.q, pool.k, pool.v, pool.table, pool.slots


@pytest.mark.parametrize(
    ("page_size", "group", "dim", "prefixes", "extends", "window"),
    [
        (1, 1, 64, [0, 5], [7, 33], None),  # slot table; a block of queries ends mid-block
        (4, 3, 80, [0, 9, 16], [5, 17, 3], None),  # group padded to 4; D not a power of 2
        (16, 4, 64, [40, 0], [70, 16], None),  # several key blocks; extend past one block
        (1, 2, 48, [3, 0, 20], [19, 6, 11], 5),  # slot table, window, D = 48
        (4, 8, 80, [0, 12, 33], [9, 40, 2], None),  # group 8: 8 tokens x 8 heads (fp32)
        (4, 8, 64, [7, 0], [25, 18], 6),  # group 8 with a window
        (16, 2, 64, [50, 0, 17], [14, 37, 1], 20),  # window over pages; a 1-token extend
    ],
)
def test_kernel_equals_sdpa_over_gathered_keys(
    page_size: int,
    group: int,
    dim: int,
    prefixes: list[int],
    extends: list[int],
    window: int | None,
) -> None:
    q, k, v, table, slots = random_case(
        page_size=page_size,
        group=group,
        dim=dim,
        prefixes=prefixes,
        extends=extends,
        dtype=torch.float32,
        device="cpu",
        seed=group,
    )
    scale = dim**-0.5
    got = paged_extend_attention(
        q,
        k,
        v,
        table,
        torch.tensor(prefixes),
        torch.tensor(extends),
        page_size=page_size,
        scale=scale,
        window=window,
    )
    want = reference(q, k, v, slots, prefixes, extends, scale, window)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert (got - want).abs().max().item() < ATTN_TOL


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

BF16_IN_INTERPRETER = pytest.mark.skipif(
    INTERPRETED,
    reason="Triton's interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584)",
)


@pytest.mark.parametrize(
    "dtype", [torch.float16, pytest.param(torch.bfloat16, marks=BF16_IN_INTERPRETER)]
)
@pytest.mark.parametrize(("page_size", "group", "window"), [(1, 1, None), (4, 4, 9), (4, 8, None)])
def test_16_bit_kernel_equals_sdpa(
    dtype: torch.dtype, page_size: int, group: int, window: int | None
) -> None:
    """16-bit inputs: ``q·k`` in the input dtype, ``p`` cast to it for ``p·v``, stored in
    it; within rounding of the fp32 SDPA over the same (rounded) inputs. Runs on CUDA when
    there is one, else in the interpreter (fp16 only)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    prefixes, extends = [0, 11, 30], [13, 35, 4]
    q, k, v, table, slots = random_case(
        page_size=page_size,
        group=group,
        dim=80,
        prefixes=prefixes,
        extends=extends,
        dtype=dtype,
        device=device,
        seed=7,
    )
    scale = 80**-0.5
    got = paged_extend_attention(
        q,
        k,
        v,
        table,
        torch.tensor(prefixes, device=device),
        torch.tensor(extends, device=device),
        page_size=page_size,
        scale=scale,
        window=window,
    )
    want = reference(
        q.cpu(), k.cpu(), v.cpu(), [s.cpu() for s in slots], prefixes, extends, scale, window
    )
    assert got.dtype == dtype
    # q.k and p.v in the input dtype, p rounded to it: a few units of its roundoff (fp16
    # u = 2**-11, bf16 2**-8) at |v| <= 4.5; measured 9.6e-4 in fp16
    tol = 1e-2 if dtype == torch.float16 else 2e-2
    assert (got.float().cpu() - want).abs().max().item() < tol


@pytest.mark.parametrize(
    ("block_m", "group", "dtype", "tile"),
    [
        (32, 1, torch.bfloat16, (32, 1, 32, 4)),
        (32, 2, torch.bfloat16, (32, 2, 64, 4)),
        (32, 3, torch.bfloat16, (32, 4, 128, 8)),  # the group padded to a power of two
        (32, 4, torch.bfloat16, (32, 4, 128, 8)),
        (32, 8, torch.bfloat16, (16, 8, 128, 8)),  # tokens halved: at most 128 rows
        (32, 4, torch.float32, (16, 4, 64, 4)),  # fp32: at most 64 rows
        (32, 8, torch.float32, (8, 8, 64, 4)),
        (128, 1, torch.float16, (128, 1, 128, 8)),
        (4, 1, torch.float16, (16, 1, 16, 4)),  # raised to tl.dot's 16 rows
        (4, 2, torch.float32, (8, 2, 16, 4)),
    ],
)
def test_tile_rows_stay_between_16_and_128(
    block_m: int, group: int, dtype: torch.dtype, tile: tuple[int, int, int, int]
) -> None:
    assert tuple(extend_attention._tile(block_m, group, dtype)) == tile


def test_one_program_per_kv_head_for_the_whole_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """The grid is (sequences, token blocks, KV heads): each K/V block is read once per
    GQA group. With ``block_m=4`` and a group of 4 the 16-row tile holds 4 tokens, so a
    22-token extend spans 6 blocks, each still equal to SDPA."""
    grids: list[tuple[int, ...]] = []
    kernel = extend_attention._extend_kernel

    class Spy:
        def __getitem__(self, grid: tuple[int, ...]) -> Any:
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(extend_attention, "_extend_kernel", Spy())
    prefixes, extends = [5, 0], [22, 3]
    q, k, v, table, slots = random_case(
        page_size=4,
        group=4,
        dim=64,
        prefixes=prefixes,
        extends=extends,
        dtype=torch.float32,
        device="cpu",
        hkv=3,
    )
    got = paged_extend_attention(
        q,
        k,
        v,
        table,
        torch.tensor(prefixes),
        torch.tensor(extends),
        page_size=4,
        scale=0.125,
        block_m=4,
        block_n=16,
    )
    assert grids == [(2, 6, 3)]
    want = reference(q, k, v, slots, prefixes, extends, 0.125)
    assert (got - want).abs().max().item() < ATTN_TOL


def test_kernel_with_a_window_and_into_given_rows() -> None:
    """A sliding window (blocks of keys wholly before it are skipped) and an ``out`` whose
    other rows (e.g. decode rows of a mixed batch) are left untouched."""
    prefixes, extends, window = [30, 0], [20, 9], 8
    q, k, v, table, slots = random_case(
        page_size=4,
        group=2,
        dim=64,
        prefixes=prefixes,
        extends=extends,
        dtype=torch.float32,
        device="cpu",
        seed=3,
    )
    scale = 0.125
    out = torch.full((q.shape[0] + 2, *q.shape[1:]), 7.0)
    q_big = torch.zeros_like(out)
    q_big[1:21], q_big[22:31] = q[:20], q[20:]  # rows 0 and 21: another sequence's
    got = paged_extend_attention(
        q_big,
        k,
        v,
        table,
        torch.tensor(prefixes),
        torch.tensor(extends),
        page_size=4,
        scale=scale,
        q_starts=torch.tensor([1, 22]),
        max_extend=20,
        window=window,
        out=out,
        block_m=16,
        block_n=16,
    )
    assert got is out
    assert bool((out[0] == 7).all()) and bool((out[21] == 7).all())
    want = reference(q, k, v, slots, prefixes, extends, scale, window)
    assert (torch.cat((out[1:21], out[22:31])) - want).abs().max().item() < ATTN_TOL


def test_kernel_refuses_shapes_that_do_not_fit() -> None:
    q = torch.zeros(4, 6, 64)
    k = torch.zeros(16, 4, 64)  # 6 query heads over 4 KV heads
    one = torch.ones(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        paged_extend_attention(q, k, k, torch.zeros(2, 1), one, one, page_size=16, scale=1)
    k = torch.zeros(16, 2, 64)
    with pytest.raises(ValueError, match="B=3"):
        paged_extend_attention(q, k, k, torch.zeros(3, 1), one, one, page_size=16, scale=1)
    with pytest.raises(ValueError, match="window=0"):
        paged_extend_attention(
            q, k, k, torch.zeros(2, 1), one, one, page_size=16, scale=1, window=0
        )
    for bad in ({"block_m": 24}, {"block_n": 8}, {"block_m": 0}):
        with pytest.raises(ValueError, match="power of two"):
            paged_extend_attention(
                q, k, k, torch.zeros(2, 1), one, one, page_size=16, scale=1, **bad
            )


def spy_on_the_kernel(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[int], list[int]]]:
    """Record each launch's ``(prefix_lens, extend_lens)``; the kernel still runs."""
    calls: list[tuple[list[int], list[int]]] = []

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append((args[4].tolist(), args[5].tolist()))
        return paged_extend_attention(*args, **kwargs)

    monkeypatch.setattr(extend_attention, "paged_extend_attention", spy)
    return calls


def runner(name: str, backend: str, page_size: int = 4) -> ModelRunner:
    lm = engine_model(name)
    pool = DevicePool(kv_spec_from_hf_config(lm.hf_config, "float32"), 32, page_size)
    return ModelRunner(lm.model, pool, attention_backend=backend)


@pytest.mark.parametrize("scattered", [False, True])
def test_runner_mixed_batch_with_the_kernels_equals_sdpa(
    scattered: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill two sequences; then one batch: an extend of 7 over the first's cached 9
    tokens, a fresh prefill of 5 and a decode step of the second. Every new token's
    logits from the kernel runner equal the SDPA runner's."""
    name = "tiny-random-qwen2"  # GQA
    ids = prompt_ids(name, 21)
    gen = torch.Generator().manual_seed(2)
    order = torch.randperm(128, generator=gen) if scattered else torch.arange(128)
    # page-aligned slots (page_size 4) unless scattered: then slot by slot, any order
    slots = [order[:16], order[32:40], order[64:72]]
    calls = spy_on_the_kernel(monkeypatch)
    outs = []
    for backend in ("sdpa", "triton"):
        r = runner(name, backend)
        assert r.attention_backend is AttentionBackend(backend)
        r.forward(
            ForwardBatch(
                input_ids=torch.cat((ids[:9], ids[3:9])),
                positions=torch.cat((torch.arange(9), torch.arange(6))),
                extend_lens=[9, 6],
                seq_slots=[slots[0][:9], slots[1][:6]],
            )
        )
        mixed = ForwardBatch(
            input_ids=torch.cat((ids[9:16], ids[:5], ids[9:10])),
            positions=torch.cat((torch.arange(9, 16), torch.arange(5), torch.tensor([6]))),
            extend_lens=[7, 5, 1],
            seq_slots=[slots[0][:16], slots[2][:5], slots[1][:7]],
        )
        outs.append(r.forward(mixed, all_logits=True))
    layers = engine_model(name).hf_config.num_hidden_layers
    assert calls == [([0, 0], [9, 6])] * layers + [([9, 0], [7, 5])] * layers
    assert outs[0].shape == (13, outs[0].shape[1])
    assert (outs[0] - outs[1]).abs().max().item() <= TOL


def test_engine_chunked_prefill_over_a_cached_prefix_with_the_kernels_equals_sdpa(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A second prompt that shares the first's prefix extends over its cached pages, in
    chunks smaller than the prompt; greedy outputs equal SDPA's."""
    from hicache.config import CacheConfig
    from hicache.engine.front.engine import Engine, EngineConfig
    from hicache.engine.sampling import SamplingParams
    from hicache.engine.step.scheduler import SchedulerConfig

    name = "tiny-random-llama"
    base = prompt_ids(name, 30).tolist()
    prompts = [base[:18], base[:30]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    calls = spy_on_the_kernel(monkeypatch)
    results = {}
    for backend in ("sdpa", "triton"):
        config = EngineConfig(
            model_path=name,
            dtype="float32",
            device="cpu",
            cache=CacheConfig(page_size=4, device_tokens=256),
            scheduler=SchedulerConfig(chunked_prefill_size=8),
            attention_backend=backend,
        )
        with Engine(config, loaded=engine_model(name)).start() as engine:
            runner_ = engine.core.scheduler.runner
            assert runner_.attention_backend is AttentionBackend(backend)
            results[backend] = [engine.generate(p, params, timeout=120).output_ids for p in prompts]
    assert results["triton"] == results["sdpa"]
    # chunks of 8: the first prompt 0+8, 8+8, 16+2; the second hits its 16 cached tokens
    # (whole pages, the last generated ones not kept) and extends 16+8, 24+6
    launches = sorted({(tuple(p), tuple(n)) for p, n in calls})
    assert {((16,), (8,)), ((24,), (6,))} <= set(launches)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("group", "window"), [(1, None), (4, None), (8, None), (8, 700)])
def test_compiled_kernel_equals_sdpa_on_cuda(
    dtype: torch.dtype, group: int, window: int | None
) -> None:
    """Compiled, at serving sizes: head_dim 128, groups up to 8 (tiles of 128 rows for
    16-bit inputs, 64 for fp32), long prefixes, a window shorter than them."""
    prefixes, extends = [0, 100, 1000, 4000], [1, 300, 77, 2048]
    q, k, v, table, slots = random_case(
        page_size=16,
        group=group,
        dim=128,
        prefixes=prefixes,
        extends=extends,
        dtype=dtype,
        device="cuda",
    )
    scale = 128**-0.5
    got = paged_extend_attention(
        q,
        k,
        v,
        table,
        torch.tensor(prefixes, device="cuda"),
        torch.tensor(extends, device="cuda"),
        page_size=16,
        scale=scale,
        window=window,
    )
    want = reference(q, k, v, slots, prefixes, extends, scale, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.float() - want).abs().max().item() < tol
