"""DeepSeek-V2/V3 over two real gloo ranks (``tests.helpers.ranks.run_ranks``), at the
model-runner level: each rank builds its shard (heads, expert and MLP columns,
vocabulary rows), loads the full checkpoint tensors cut to its slice and runs the same
paged batches as ``test_deepseek.py`` (two prefills, an extend next to a decode token, a
decode batch) over its own MLA pool.

* Both ranks return the same logits, equal to one rank's within 1e-5 (only the order of
  the sums differs) and to transformers' within 1e-4.
* Both ranks' pools hold the SAME latent bytes (SHA-256 of the whole pool): the latent
  projections are replicated, which is what lets one rank alone write MLA pages to L3.
  The latent does not depend on the TP size either, up to fp32 rounding (1e-5): what a
  server of one TP size wrote to L3 serves one of another.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from hicache.memory import DevicePool
from hicache.runner.model_runner import ModelRunner, cache_spec_of
from hicache.runner.models.hybrid import HybridConfig, HybridLM
from hicache.runner.models.registry import build_hybrid_model
from hicache.runner.parallel import TPGroup
from tests.helpers.ranks import run_ranks
from tests.helpers.tp_batches import checkpoint_tensors, paged_batch
from tests.runner.models.deepseek_fixtures import checkpoint, deepseek_model, hf_logits, prompt
from tests.runner.models.test_deepseek import TOL

PAGE = 4
TP_VARIANTS = ("v2-qlora-grouped", "v3-yarn")
"""Between them: q LoRA and plain ``q_proj``, tied and untied heads, the V2 and V3 routers."""
_CONFIGS: dict[str, HybridConfig] = {}
"""On a rank: the variants' configs, as the parent read them."""
A_PAGES, B_PAGES = [5, 2, 7, 0, 9], [1, 3, 4, 6, 8, 10]


def _model(variant: str, tp: TPGroup) -> HybridLM:
    """``variant``'s model on ``tp`` (its config is read in the parent: no transformers
    import on the ranks)."""
    cfg = deepseek_model(variant).model.config if tp.size == 1 else _CONFIGS[variant]
    model = build_hybrid_model(cfg, dtype=torch.float32, device="cpu", tp=tp)
    model.load_weights(checkpoint_tensors(checkpoint(variant)))
    return model


def _run(
    variant: str, a: list[int], b: list[int], tp: TPGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every logit of the three batches ``(15 + 19, vocab)`` in A-then-B position order,
    and the pool's latents afterwards."""
    model = _model(variant, tp)
    runner = ModelRunner(model, DevicePool(cache_spec_of(model, "float32").kv, 16, PAGE))
    first = runner.forward(
        paged_batch([a[:13], b[:12]], [0, 0], [A_PAGES, B_PAGES]), all_logits=True
    )
    second = runner.forward(
        paged_batch([b[12:18], a[13:14]], [12, 13], [B_PAGES, A_PAGES]), all_logits=True
    )
    third = runner.forward(paged_batch([a[14:15], b[18:19]], [14, 18], [A_PAGES, B_PAGES]))
    logits = torch.cat((first[:13], second[6:], third[:1], first[13:], second[:6], third[1:]))
    return logits, runner.pool.buffer.clone()


def _rank(
    rank: int, n: int, out: str, cases: dict[str, list[list[int]]], configs: dict[str, HybridConfig]
) -> dict[str, str]:
    tp = TPGroup.of()
    _CONFIGS.update(configs)
    assert (tp.rank, tp.size) == (rank, n)
    digests = {}
    for variant, (a, b) in cases.items():
        logits, latents = _run(variant, a, b, tp)
        digests[variant] = hashlib.sha256(latents.numpy().tobytes()).hexdigest()
        torch.save(logits, Path(out, f"{variant}-rank{rank}.pt"))
        if rank == 0:
            torch.save(latents, Path(out, f"{variant}-latents.pt"))
    return digests


def test_two_ranks_equal_one_and_store_the_same_latent(tmp_path: Path) -> None:
    cases = {v: [prompt(v, 15), prompt(v, 19, offset=3)] for v in TP_VARIANTS}
    configs = {v: deepseek_model(v).model.config for v in TP_VARIANTS}
    digests = run_ranks(_rank, 2, tmp_path, cases, configs)
    for variant, (a, b) in cases.items():
        assert digests[0][variant] == digests[1][variant], f"{variant}: the ranks' latents differ"
        one, latents = _run(variant, a, b, TPGroup.single())
        two = torch.load(tmp_path / f"{variant}-latents.pt")
        # two ranks sum each sharded reduction in two halves and all-reduce them: another
        # order of the same fp32 sums, at |x| <= 3.7 order_bound(64, 3.7) = 2.8e-5; the
        # bounds here (1e-5 + 1e-5 |x|) stay under it (measured 1.7e-6)
        torch.testing.assert_close(two, latents, rtol=1e-5, atol=1e-5)
        ref = torch.cat((hf_logits(variant, a), hf_logits(variant, b)))
        r0 = torch.load(tmp_path / f"{variant}-rank0.pt")
        r1 = torch.load(tmp_path / f"{variant}-rank1.pt")
        assert torch.equal(r0, r1), variant
        torch.testing.assert_close(r0, one, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r0, ref, **TOL)  # test_deepseek's bound on the logits
