"""The Triton decode-attention kernel against the SDPA reference.

On a machine without CUDA the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``,
set by ``tests/conftest.py`` before anything imports Triton), on CPU tensors; on CUDA the
``gpu`` tests run it compiled, in fp32 and bf16.

* Random pools, page tables in any order, GQA groups of 1 to 4, a head size that is not a
  power of two, lengths that end mid-page and mid-block: the kernel equals SDPA over the
  gathered keys (fp32: 1e-5).
* Through the runner: a decode batch with ``attention_backend="triton"`` gives
  transformers' logits, like the ``sdpa`` runner, also for a single decoding sequence and
  for slots that do not lie over whole pages.
* Engine: greedy generations with the kernel equal those with SDPA.
* A backend that cannot run here is refused with a message naming the flag's value.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hicache.memory import DevicePool
from hicache.runner import ModelRunner, kv_spec_from_hf_config
from hicache.runner.kernels import AttentionBackend, resolve_backend
from hicache.runner.model_runner import ForwardBatch
from tests.helpers.engine_fixtures import engine_model, prompt_ids, random_pool

pytest.importorskip("triton")

from hicache.runner.kernels.decode_attention import paged_decode_attention

TOL = 1e-4
"""Logits of the kernel runner against the SDPA runner: test_engine_model's bound on fp32
logits (``order_bound(128, 8.3)`` = 1.3e-4). Measured at most 4.3e-6."""
ATTN_TOL = 1e-5
"""fp32 attention against SDPA: each output is ``sum_j p_j v_j`` over n <= 129 keys
(``p >= 0``, ``sum p = 1``, ``|v| <= 4.5`` from N(0, 1)), summed by blocks in the kernel:
about sqrt(n) eps |v| = 6e-6 typically, ``order_bound(129, 4.5)`` = 7e-5 at worst; measured
at most 4.8e-7 on every dispatch."""


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: list[torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """SDPA over each sequence's gathered keys: ``q (B, Hq, D)`` -> ``(B, Hq, D)``."""
    out = []
    for i, s in enumerate(slots):
        ki, vi = k[s].transpose(0, 1)[None], v[s].transpose(0, 1)[None]
        qi = q[i][:, None][None]
        o = F.scaled_dot_product_attention(
            qi.float(), ki.float(), vi.float(), scale=scale, enable_gqa=True
        )
        out.append(o[0, :, 0])
    return torch.stack(out)


def random_case(
    *,
    page_size: int,
    group: int,
    dim: int,
    lengths: list[int],
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    """q, k/v pool layer, page table and lengths over shuffled pages, plus the slots."""
    pool = random_pool(
        lengths,
        queries=len(lengths),
        page_size=page_size,
        group=group,
        dim=dim,
        dtype=dtype,
        device=device,
        seed=seed,
        spare_pages=8,
    )
    lens = torch.tensor(lengths).to(device)
    return pool.q, pool.k, pool.v, pool.table, lens, *pool.slots


@pytest.mark.parametrize(
    ("page_size", "group", "dim", "lengths"),
    [
        (1, 1, 64, [1, 7, 64, 65]),
        (4, 3, 80, [5, 17, 30]),  # head size not a power of two; ends mid-page
        (16, 4, 64, [16, 100, 129]),  # several blocks of keys; ends mid-block
    ],
)
def test_kernel_equals_sdpa_over_gathered_keys(
    page_size: int, group: int, dim: int, lengths: list[int]
) -> None:
    q, k, v, table, lens, *slots = random_case(
        page_size=page_size,
        group=group,
        dim=dim,
        lengths=lengths,
        dtype=torch.float32,
        device="cpu",
    )
    scale = dim**-0.5
    got = paged_decode_attention(q, k, v, table, lens, page_size=page_size, scale=scale)
    want = reference(q, k, v, slots, scale)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert (got - want).abs().max().item() < ATTN_TOL


def test_kernel_refuses_shapes_that_do_not_fit() -> None:
    q = torch.zeros(2, 6, 64)
    k = torch.zeros(16, 4, 64)  # 6 query heads over 4 KV heads
    with pytest.raises(ValueError, match="multiple of Hkv"):
        paged_decode_attention(q, k, k, torch.zeros(2, 1), torch.ones(2), page_size=16, scale=1)
    k = torch.zeros(16, 2, 64)
    with pytest.raises(ValueError, match="B=2"):
        paged_decode_attention(q, k, k, torch.zeros(3, 1), torch.ones(2), page_size=16, scale=1)


def runner(name: str, backend: str, page_size: int = 4) -> ModelRunner:
    lm = engine_model(name)
    pool = DevicePool(kv_spec_from_hf_config(lm.hf_config, "float32"), 32, page_size)
    return ModelRunner(lm.model, pool, attention_backend=backend)


@pytest.mark.parametrize("scattered", [False, True])
@pytest.mark.parametrize("batch_size", [1, 2])
def test_runner_decode_with_the_kernel_equals_sdpa(scattered: bool, batch_size: int) -> None:
    """Prefill each sequence, then one decode step for all: the kernel runner's logits equal
    the SDPA runner's (both within TOL of transformers, which test_engine_model checks)."""
    name = "tiny-random-qwen2"  # GQA
    lens = (9, 6)[:batch_size]
    full = [prompt_ids(name, n + 1) for n in lens]
    gen = torch.Generator().manual_seed(1)
    order = torch.randperm(128, generator=gen) if scattered else torch.arange(128)
    slots = [order[:10], order[64:71]][:batch_size]
    outs = []
    for backend in ("sdpa", "triton"):
        r = runner(name, backend)
        assert r.attention_backend is AttentionBackend(backend)
        for f, s, n in zip(full, slots, lens, strict=True):
            r.forward(
                ForwardBatch(
                    input_ids=f[:n],
                    positions=torch.arange(n),
                    extend_lens=[n],
                    seq_slots=[s[:n]],
                )
            )
        step = ForwardBatch(
            input_ids=torch.stack([f[n] for f, n in zip(full, lens, strict=True)]),
            positions=torch.tensor(lens),
            extend_lens=[1] * batch_size,
            seq_slots=[s[: n + 1] for s, n in zip(slots, lens, strict=True)],
        )
        outs.append(r.forward(step))
    assert (outs[0] - outs[1]).abs().max().item() <= TOL


def test_engine_greedy_with_the_kernel_equals_sdpa() -> None:
    from hicache.config import CacheConfig
    from hicache.engine.front.engine import Engine, EngineConfig
    from hicache.engine.sampling import SamplingParams

    name = "tiny-random-llama"
    prompts = [prompt_ids(name, n).tolist() for n in (11, 20, 7)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    results = {}
    for backend in ("sdpa", "triton"):
        config = EngineConfig(
            model_path=name,
            dtype="float32",
            device="cpu",
            cache=CacheConfig(page_size=4, device_tokens=256),
            attention_backend=backend,
        )
        with Engine(config, loaded=engine_model(name)).start() as engine:
            assert engine.core.scheduler.runner.attention_backend is AttentionBackend(backend)
            results[backend] = [engine.generate(p, params, timeout=120).output_ids for p in prompts]
    assert results["triton"] == results["sdpa"]


def test_a_backend_that_cannot_run_here_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu) is AttentionBackend.SDPA
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"attention_backend='triton' runs on CUDA"):
        resolve_backend("triton", cpu)
    with pytest.raises(ValueError, match="'flash'"):
        resolve_backend("flash", cpu)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_kernel_equals_sdpa_on_cuda(dtype: torch.dtype) -> None:
    q, k, v, table, lens, *slots = random_case(
        page_size=16, group=4, dim=128, lengths=[1, 100, 1000, 4096], dtype=dtype, device="cuda"
    )
    scale = 128**-0.5
    got = paged_decode_attention(q, k, v, table, lens, page_size=16, scale=scale)
    want = reference(q, k, v, slots, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.float() - want).abs().max().item() < tol


def test_the_probe_that_guards_auto_passes_under_the_interpreter() -> None:
    """``auto`` on CUDA uses the kernels only when this probe (both kernels against SDPA)
    passes on the device; here it runs in the interpreter on CPU."""
    from hicache.runner.kernels.probe import kernels_agree

    assert kernels_agree(torch.device("cpu"))
