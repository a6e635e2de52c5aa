"""DeepSeek-V3.2 on two real gloo ranks (TP 2): the MLA heads, the dense MLP's and the
experts' columns split over the ranks, the DSA indexer replicated on both.

The paged batch of ``test_deepseek_v32`` (two cold prefills over scattered pages, an
extend on a cached prefix next to a decode token, a decode batch) gives, on each rank,
the logits transformers gives within 1e-4; each rank holds 2 of the 4 heads, and both
ranks' indexer pools hold the same bytes (every rank selects the same tokens).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from hicache.memory import DevicePool
from hicache.runner.loader import load_model
from hicache.runner.model_runner import ModelRunner, cache_spec_of
from hicache.runner.models.deepseek_v32 import DeepseekV32LM
from hicache.runner.parallel import TPGroup
from hicache.spec import IndexerSpec
from tests.helpers.ranks import run_ranks
from tests.runner.models.deepseek_v32_fixtures import checkpoint, hf_logits, prompt
from tests.runner.models.test_deepseek_v32 import A_PAGES, B_PAGES, PAGE, TOL, batch


def _rank(rank: int, n: int, out: str, path: str, a: list[int], b: list[int]) -> dict[str, Any]:
    tp = TPGroup.of()
    loaded = load_model(path, dtype="float32", device="cpu", tp=tp)
    model = loaded.model
    assert isinstance(model, DeepseekV32LM)
    spec = cache_spec_of(model, "float32")
    indexer = spec.component("indexer")
    assert isinstance(indexer, IndexerSpec)
    pool = DevicePool(indexer.kv, 16, PAGE)
    runner = ModelRunner(model, DevicePool(spec.kv, 16, PAGE), {"indexer": pool})
    rows = [
        runner.forward(batch([a[:17], b[:12]], [0, 0], [A_PAGES, B_PAGES]), all_logits=True),
        runner.forward(batch([b[12:25], a[17:18]], [12, 17], [B_PAGES, A_PAGES]), all_logits=True),
        runner.forward(batch([a[18:19], b[25:26]], [18, 25], [A_PAGES, B_PAGES])),
    ]
    torch.save(rows, Path(out, f"rank{rank}.pt"))
    keys = hashlib.sha256(pool.buffer.numpy().tobytes()).hexdigest()
    return {"heads": model.model.layers[0].self_attn.num_heads, "indexer": keys}


def test_two_ranks_equal_transformers(tmp_path: Path) -> None:
    a, b = prompt(20), prompt(27, offset=3)
    ref_a, ref_b = hf_logits(a), hf_logits(b)
    seen = run_ranks(_rank, 2, tmp_path, str(checkpoint()), a, b)
    assert [s["heads"] for s in seen] == [2, 2]
    assert seen[0]["indexer"] == seen[1]["indexer"]
    for r in range(2):
        prefill, mixed, decode = torch.load(tmp_path / f"rank{r}.pt")
        torch.testing.assert_close(prefill[:17], ref_a[:17], **TOL)
        torch.testing.assert_close(prefill[17:], ref_b[:12], **TOL)
        torch.testing.assert_close(mixed[:13], ref_b[12:25], **TOL)
        torch.testing.assert_close(mixed[13:], ref_a[17:18], **TOL)
        torch.testing.assert_close(decode[0], ref_a[18], **TOL)
        torch.testing.assert_close(decode[1], ref_b[25], **TOL)
