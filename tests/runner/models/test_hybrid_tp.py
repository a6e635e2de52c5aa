"""Gemma 3 and GPT-OSS over two real gloo ranks (``tests.helpers.ranks.run_ranks``), at the
model-runner level: each rank builds its shard (query and K/V heads, GPT-OSS's sinks, MLP
and expert columns, vocabulary rows), loads the full checkpoint tensors cut to its slice and
runs the same paged batches over one pool of its attention layers: two prefills longer
than the sliding window, an extend next to a decode token, a decode batch.

* Both ranks return the same logits, equal to one rank's and to transformers' within the
  bound argued in :func:`tol`.
* Each rank's pool holds its own K/V heads (``HeadSplit.kv_heads``): rank ``r``'s bytes
  equal heads ``r`` of the one-rank pool within the same bound (K/V are one projection
  deep past the all-reduced residual stream).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hicache.heads import HeadSplit
from hicache.memory import DevicePool
from hicache.runner.model_runner import ModelRunner
from hicache.runner.models.decoder import WeightLoadError
from hicache.runner.models.hybrid import HybridConfig, HybridLM
from hicache.runner.models.registry import build_hybrid_model
from hicache.runner.parallel import TPGroup
from hicache.spec import SlidingWindowSpec
from tests.helpers.numerics import order_bound
from tests.helpers.ranks import run_ranks
from tests.helpers.tp_batches import checkpoint_tensors, paged_batch, paged_slots
from tests.runner.models.hybrid_fixtures import hf_logits, hybrid_model, prompt

PAGE = 4
NAMES = ("tiny-random-gemma3", "tiny-random-gpt-oss")
A_PAGES, B_PAGES = [5, 2, 7, 0, 9], [1, 3, 4, 6, 8, 10]
LEN_A, LEN_B = 15, 19


def _run(
    cfg: HybridConfig, path: str, a: list[int], b: list[int], tp: TPGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every logit of the three batches ``(LEN_A + LEN_B, vocab)`` in A-then-B position
    order, and the K/V of both sequences' slots ``(2, layers, tokens, local heads, dim)``."""
    model: HybridLM = build_hybrid_model(cfg, dtype=torch.float32, device="cpu", tp=tp)
    model.load_weights(checkpoint_tensors(path))
    spec = replace(cfg.kv_spec("float32"), num_kv_heads=model.num_kv_heads)
    runner = ModelRunner(model, DevicePool(spec, 16, PAGE))
    with torch.no_grad():
        first = runner.forward(
            paged_batch([a[:13], b[:12]], [0, 0], [A_PAGES, B_PAGES]), all_logits=True
        )
        second = runner.forward(
            paged_batch([b[12:18], a[13:14]], [12, 13], [B_PAGES, A_PAGES]), all_logits=True
        )
        third = runner.forward(paged_batch([a[14:15], b[18:19]], [14, 18], [A_PAGES, B_PAGES]))
    logits = torch.cat((first[:13], second[6:], third[:1], first[13:], second[:6], third[1:]))
    slots = torch.cat((paged_slots(A_PAGES, LEN_A), paged_slots(B_PAGES, LEN_B)))
    pool = runner.pool
    kv = torch.stack(
        [
            torch.stack([pool.k_buffer(j)[slots] for j in range(spec.num_layers)]),
            torch.stack([pool.v_buffer(j)[slots] for j in range(spec.num_layers)]),
        ]
    )
    return logits, kv


def _rank(
    rank: int, n: int, out: str, cases: dict[str, tuple[HybridConfig, str, list[list[int]]]]
) -> list[int]:
    tp = TPGroup.of()
    assert (tp.rank, tp.size) == (rank, n)
    for name, (cfg, path, (a, b)) in cases.items():
        logits, kv = _run(cfg, path, a, b, tp)
        torch.save({"logits": logits, "kv": kv}, Path(out, f"{name}-rank{rank}.pt"))
    return [rank]


def tol(ref: torch.Tensor) -> float:
    """The bound between two correct fp32 computations of ``ref``'s values: both add the
    same terms in another order (two ranks sum each split reduction in halves and
    all-reduce them; transformers' dense kernels against the paged ones), the longest of
    them the MLP's 128 terms (Gemma 3's intermediate size; GPT-OSS's experts are 32 wide,
    its hidden 64), so ``order_bound(128, |x|)`` with ``|x|`` the values' scale, as in
    ``test_hybrid_models.tol``: 2.2e-4 (Gemma 3, ``|z| <= 14.1``) and 1.3e-4 (GPT-OSS) on
    the logits. Measured: logits 3.5e-5 / 1.4e-5 from transformers, 3.1e-5 / 8.8e-6 from
    one rank; K/V 1.5e-5 / 4.8e-6 (a margin of 6 or more everywhere). A head read from
    the other rank's slice, a sink of the wrong head or a bias added twice moves them by
    1e-2 or more."""
    return order_bound(128, ref.abs().max().item())


@pytest.mark.parametrize("ranks", [2, 4])
def test_ranks_equal_one_and_transformers(tmp_path: Path, ranks: int) -> None:
    """At 4 ranks the 2 K/V heads are replicated: ranks 0 and 1 hold head 0, 2 and 3
    head 1, byte-equal between replicas."""
    cases = {
        name: (
            hybrid_model(name).model.config,
            str(hybrid_model(name).path),
            [prompt(name, LEN_A).tolist(), prompt(name, LEN_B, offset=3).tolist()],
        )
        for name in NAMES
    }
    run_ranks(_rank, ranks, tmp_path, cases)
    for name, (cfg, path, (a, b)) in cases.items():
        one, kv = _run(cfg, path, a, b, TPGroup.single())
        ref = torch.cat((hf_logits(name, torch.tensor(a)), hf_logits(name, torch.tensor(b))))
        got = [torch.load(tmp_path / f"{name}-rank{r}.pt") for r in range(ranks)]
        for r in got[1:]:
            assert torch.equal(got[0]["logits"], r["logits"]), name  # the gathered logits
        torch.testing.assert_close(got[0]["logits"], one, rtol=0, atol=tol(one))
        torch.testing.assert_close(got[0]["logits"], ref, rtol=0, atol=tol(ref))
        for rank, out in enumerate(got):
            split = HeadSplit(cfg.num_heads, cfg.num_kv_heads, ranks, rank)
            heads = split.kv_heads
            want = kv[:, :, :, heads.start : heads.stop]
            assert out["kv"].shape == want.shape, name
            torch.testing.assert_close(out["kv"], want, rtol=0, atol=tol(want))
            if not split.writes_any:  # a replica: the same bytes as the head's first rank
                assert torch.equal(out["kv"], got[split.writer(heads.start)]["kv"]), name


@pytest.mark.parametrize("name", NAMES)
def test_sizes_that_split_neither_way_are_refused_naming_the_heads(name: str) -> None:
    """4 query and 2 K/V heads: 4 ranks replicate the K/V heads; 3 or 8 cannot split."""
    cfg = hybrid_model(name).model.config
    cfg.check_tensor_parallel(4)
    for size in (3, 8):
        with pytest.raises(ValueError, match="num_attention_heads=4, num_key_value_heads=2"):
            cfg.check_tensor_parallel(size)


def test_rank_shapes_and_cache_spec_without_a_group() -> None:
    """Rank 1 of 2 on the meta device: its heads, sinks and expert columns, its vocabulary
    rows, and a cache spec of its one K/V head in the full and the SWA pool."""
    cfg = hybrid_model("tiny-random-gpt-oss").model.config
    with torch.device("meta"):
        model = build_hybrid_model(cfg, dtype=torch.float32, device="meta", tp=TPGroup(1, 2))
    params = dict(model.named_parameters())
    d, h = cfg.head_dim, cfg.hidden_size
    assert params["model.layers.0.self_attn.q_proj.weight"].shape == (2 * d, h)
    assert params["model.layers.0.self_attn.k_proj.weight"].shape == (d, h)
    assert params["model.layers.0.self_attn.o_proj.weight"].shape == (h, 2 * d)
    assert params["model.layers.0.self_attn.o_proj.bias"].shape == (h,)  # added once
    assert params["model.layers.0.self_attn.sinks"].shape == (2,)
    half = cfg.intermediate_size // 2
    experts = "model.layers.0.mlp.experts."
    assert params[experts + "gate_up_proj"].shape == (cfg.num_experts, h, 2 * half)
    assert params[experts + "down_proj"].shape == (cfg.num_experts, half, h)
    assert params[experts + "down_proj_bias"].shape == (cfg.num_experts, h)
    assert params["model.layers.0.mlp.router.weight"].shape == (cfg.num_experts, h)
    assert params["lm_head.weight"].shape == (cfg.vocab_size // 2, h)
    spec = model.cache_spec("float32")
    assert model.num_kv_heads == 1 and spec.kv.num_kv_heads == 1
    (swa,) = spec.components
    assert isinstance(swa, SlidingWindowSpec) and swa.kv.num_kv_heads == 1


def test_a_checkpoint_of_another_size_is_refused_before_the_slice() -> None:
    cfg = hybrid_model("tiny-random-gpt-oss").model.config
    model = build_hybrid_model(cfg, dtype=torch.float32, device="cpu", tp=TPGroup(0, 2))
    wider = torch.zeros(cfg.num_experts, cfg.intermediate_size + 2, cfg.hidden_size)
    with pytest.raises(WeightLoadError, match=r"experts.down_proj: checkpoint shape \(4, 34, 64\)"):
        model.load_weights([("model.layers.0.mlp.experts.down_proj", wider)])
