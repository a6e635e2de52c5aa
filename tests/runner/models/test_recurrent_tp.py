"""Qwen3-Next and Nemotron-H over two real gloo ranks (``tests.helpers.ranks.run_ranks``),
at the model level: each rank builds its shard (attention heads, DeltaNet value heads with
their key heads / Mamba2 heads with their groups, conv channels and state, MLP, expert and
shared-expert columns, vocabulary rows), loads the full checkpoint tensors cut to its slice
and runs the same paged batches as one rank: two prefills, an extend next to a decode
token, a decode batch, the recurrent state carried from forward to forward (so a wrong
state shard shows in every later logit). Also the one-group twins
(:data:`~hicache.runner.checkpoints.TINY_REPLICATED_MODELS`): one Mamba2 group / DeltaNet
key head, held by both ranks, each with half its heads (the Mamba2 gated norm's sums
all-reduced over the group's ranks).

* Both ranks return the same logits, equal to one rank's and to transformers' within the
  bound of ``test_hybrid_models`` (argued there: two orders of the same fp32 sums); so do
  four ranks of the 2-group models, each group held by two.
* Each rank's state is its heads' rows of one rank's: the ranks' ``ssm`` states
  concatenated over the heads give one rank's, and their conv states are one rank's
  channels of every part (``[q | k | v]`` / ``[x | B | C]``): half of each split part,
  the whole of a replicated group's (``q``/``k`` / ``B``/``C``).
* Each rank's cache spec is its shard: its K/V heads, its conv channels (as above) and
  half the state heads.
* Which rank holds which heads and groups (``head_split``) and the rows each gathers
  (``tp_pieces``), exactly.
* A size that splits the heads or groups neither way is refused naming them.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path

import pytest
import torch

from hicache.memory import DevicePool
from hicache.runner.checkpoints import TINY_REPLICATED_MODELS
from hicache.runner.model_runner import kv_spec_from_hf_config
from hicache.runner.models import AttentionContext
from hicache.runner.models.hybrid import HybridConfig, HybridLM
from hicache.runner.models.nemotron_h import NemotronHConfig
from hicache.runner.models.qwen3_next import Qwen3NextConfig
from hicache.runner.models.recurrent import RecurrentState
from hicache.runner.models.registry import build_hybrid_model, check_tensor_parallel
from hicache.runner.parallel import TPGroup
from hicache.spec import SnapshotSpec
from tests.helpers.ranks import run_ranks
from tests.helpers.tp_batches import checkpoint_tensors
from tests.runner.models.hybrid_fixtures import PAGE, hf_logits, hybrid_model, prompt, slots_for
from tests.runner.models.test_hybrid_models import max_diff, tol

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="TP 2 needs 2 CPU cores")

RECURRENT = ("tiny-random-qwen3-next", "tiny-random-nemotron-h", *TINY_REPLICATED_MODELS)
A_PAGES, B_PAGES = [5, 2, 7, 0, 9], [1, 3, 4, 6, 8, 10]
A_LEN, B_LEN = 15, 19


def _forward(
    model: HybridLM,
    pool: DevicePool,
    ids: list[torch.Tensor],
    starts: list[int],
    pages: list[list[int]],
    states: dict[int, RecurrentState] | None,
) -> tuple[torch.Tensor, dict[int, RecurrentState]]:
    lens = [len(t) for t in ids]
    slots = [slots_for(p, a + n) for p, a, n in zip(pages, starts, lens, strict=True)]
    ctx = AttentionContext.build(pool, slots, lens)
    positions = torch.cat([torch.arange(a, a + n) for a, n in zip(starts, lens, strict=True)])
    with torch.no_grad():
        out = model(torch.cat(ids), positions, ctx, states)
        return model.compute_logits(out.hidden), out.states


def _swap(states: dict[int, RecurrentState]) -> dict[int, RecurrentState]:
    return {k: s.select([1, 0]) for k, s in states.items()}


def run(
    cfg: HybridConfig, path: Path, a: torch.Tensor, b: torch.Tensor, tp: TPGroup
) -> tuple[torch.Tensor, dict[int, RecurrentState]]:
    """Every logit of the three batches ``(A_LEN + B_LEN, vocab)`` in A-then-B position
    order, and the recurrent states after them (rows A, B)."""
    model = build_hybrid_model(cfg, dtype=torch.float32, device="cpu", tp=tp)
    model.load_weights(checkpoint_tensors(path))
    pool = DevicePool(model.cache_spec("float32").kv, 16, PAGE)
    first, s1 = _forward(model, pool, [a[:13], b[:12]], [0, 0], [A_PAGES, B_PAGES], None)
    second, s2 = _forward(
        model, pool, [b[12:18], a[13:14]], [12, 13], [B_PAGES, A_PAGES], _swap(s1)
    )
    third, s3 = _forward(model, pool, [a[14:15], b[18:19]], [14, 18], [A_PAGES, B_PAGES], _swap(s2))
    logits = torch.cat((first[:13], second[6:], third[:1], first[13:], second[:6], third[1:]))
    return logits, s3


def _rank(
    rank: int, n: int, out: str, cases: dict[str, tuple[HybridConfig, str, list[int], list[int]]]
) -> int:
    tp = TPGroup.of()
    assert (tp.rank, tp.size) == (rank, n)
    for name, (cfg, path, a, b) in cases.items():
        logits, states = run(cfg, Path(path), torch.tensor(a), torch.tensor(b), tp)
        plain = {layer: (s.conv, s.ssm) for layer, s in states.items()}
        torch.save((logits, plain), Path(out, f"{name}-rank{rank}.pt"))
    return rank


def _load(path: Path) -> tuple[torch.Tensor, dict[int, RecurrentState]]:
    logits, plain = torch.load(path)
    return logits, {layer: RecurrentState(conv=c, ssm=s) for layer, (c, s) in plain.items()}


def _conv_parts(cfg: HybridConfig) -> list[tuple[int, bool]]:
    """The conv channels' parts, in order, each with whether 2 ranks both hold it whole
    (one group's B/C or one key head's q/k: replicated) rather than half each."""
    if isinstance(cfg, Qwen3NextConfig):
        lin = cfg.linear
        keys = lin.num_k_heads * lin.k_dim
        return [(keys, lin.num_k_heads == 1)] * 2 + [(lin.num_v_heads * lin.v_dim, False)]
    assert isinstance(cfg, NemotronHConfig)
    m = cfg.mamba
    return [(m.inner, False)] + [(m.n_groups * m.state_size, m.n_groups == 1)] * 2


def _rank_conv(parts: list[tuple[int, bool]], conv: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank ``rank``'s channels (of 2) of one rank's conv state ``(B, C, K-1)``."""
    out = []
    for part, (n, replicated) in zip(conv.split([n for n, _ in parts], dim=1), parts, strict=True):
        out.append(part if replicated else part[:, rank * n // 2 : (rank + 1) * n // 2])
    return torch.cat(out, dim=1)


def _cases(names: tuple[str, ...]) -> dict[str, tuple[HybridConfig, str, list[int], list[int]]]:
    cases = {}
    for name in names:
        loaded = hybrid_model(name)
        a, b = prompt(name, A_LEN), prompt(name, B_LEN, offset=3)
        cases[name] = (loaded.model.config, str(loaded.path), a.tolist(), b.tolist())
    return cases


def test_two_ranks_equal_one_and_transformers(tmp_path: Path) -> None:
    cases = _cases(RECURRENT)
    run_ranks(_rank, 2, tmp_path, cases)
    for name, (cfg, path, a_ids, b_ids) in cases.items():
        a, b = torch.tensor(a_ids), torch.tensor(b_ids)
        one, one_states = run(cfg, Path(path), a, b, TPGroup.single())
        r0, s0 = _load(tmp_path / f"{name}-rank0.pt")
        r1, s1 = _load(tmp_path / f"{name}-rank1.pt")
        assert torch.equal(r0, r1), f"{name}: the ranks' logits differ"
        ref = torch.cat((hf_logits(name, a), hf_logits(name, b)))
        # two ranks add each row-parallel reduction (<= 128 terms) in two halves and
        # all-reduce them: another order of the same fp32 sums, the bound of
        # test_hybrid_models (order_bound(128, |z|))
        assert max_diff(r0, one) <= tol(one), name
        assert max_diff(r0, ref) <= tol(ref), name
        assert set(s0) == set(one_states), name
        for layer, state in one_states.items():
            ssm = torch.cat((s0[layer].ssm, s1[layer].ssm), dim=1)
            assert ssm.shape == state.ssm.shape
            # the states come out of the same sums as the logits (measured 5.7e-7 of a
            # bound 4.4e-6 for ssm, 5.9e-6 of 7.8e-5 for conv)
            assert max_diff(ssm, state.ssm) <= tol(state.ssm), (name, layer)
            for rank, got in enumerate((s0[layer].conv, s1[layer].conv)):
                want = _rank_conv(_conv_parts(cfg), state.conv, rank)
                assert got.shape == want.shape
                assert max_diff(got, want) <= tol(want), (name, layer, rank)


def test_four_ranks_share_each_group_by_two(tmp_path: Path) -> None:
    """The 2-group models over 4 ranks: ranks 0 and 1 hold group (key head) 0, ranks 2
    and 3 group 1, each half its heads (the gated norm's sums all-reduced in the group's
    own column); the same logits on every rank, equal to one rank's and to transformers'
    within the bound above."""
    cases = _cases(("tiny-random-qwen3-next", "tiny-random-nemotron-h"))
    run_ranks(_rank, 4, tmp_path, cases)
    for name, (cfg, path, a_ids, b_ids) in cases.items():
        a, b = torch.tensor(a_ids), torch.tensor(b_ids)
        one, _ = run(cfg, Path(path), a, b, TPGroup.single())
        ranks = [_load(tmp_path / f"{name}-rank{r}.pt")[0] for r in range(4)]
        assert all(torch.equal(ranks[0], r) for r in ranks[1:]), name
        ref = torch.cat((hf_logits(name, a), hf_logits(name, b)))
        assert max_diff(ranks[0], one) <= tol(one), name
        assert max_diff(ranks[0], ref) <= tol(ref), name


@pytest.mark.parametrize("name", RECURRENT)
def test_a_ranks_cache_spec_holds_its_heads_state(name: str) -> None:
    """On the meta device, without a group: each rank's cache spec has its K/V heads (the
    pool's shape :func:`kv_spec_from_hf_config` gives too) and a snapshot of its conv
    channels (half of each split part, the whole of a replicated one) and half the state
    heads of one rank's, the layers and dtypes unchanged."""
    loaded = hybrid_model(name)
    one = loaded.model.cache_spec("float32")
    (whole,) = one.components
    assert isinstance(whole, SnapshotSpec)
    for rank in range(2):
        with torch.device("meta"):
            model = type(loaded.model).build(loaded.model.config, TPGroup(rank, 2))
        spec = model.cache_spec("float32")
        assert spec.kv == dataclasses.replace(one.kv, num_kv_heads=one.kv.num_kv_heads // 2)
        assert spec.kv == kv_spec_from_hf_config(loaded.hf_config, "float32", tp_size=2)
        (snap,) = spec.components
        assert isinstance(snap, SnapshotSpec)
        conv, ssm = (t.shape for t in whole.tensors)
        parts = _conv_parts(loaded.model.config)
        assert conv[0] == sum(n for n, _ in parts)
        channels = sum(n if replicated else n // 2 for n, replicated in parts)
        assert [t.shape for t in snap.tensors] == [(channels, conv[1]), (ssm[0] // 2, *ssm[1:])]
        assert snap.num_layers == whole.num_layers and snap.name == whole.name == "mamba"
        assert [t.dtype for t in snap.tensors] == [t.dtype for t in whole.tensors]


@pytest.mark.parametrize(
    ("name", "size", "fields", "named"),
    [
        ("tiny-random-nemotron-h", 2, {"mamba_num_heads": 6, "n_groups": 3}, "n_groups=3"),
        ("tiny-random-nemotron-h", 4, {"mamba_num_heads": 6, "n_groups": 1}, "mamba_num_heads=6"),
        (
            "tiny-random-qwen3-next",
            2,
            {"linear_num_key_heads": 3, "linear_num_value_heads": 6},
            "linear_num_key_heads=3",
        ),
        (
            "tiny-random-qwen3-next",
            4,
            {"linear_num_key_heads": 1, "linear_num_value_heads": 6},
            "linear_num_value_heads=6",
        ),
        ("tiny-random-qwen3-next", 3, {}, "num_attention_heads=4"),
    ],
)
def test_a_size_that_splits_neither_way_is_refused_naming_it(
    name: str, size: int, fields: dict[str, int], named: str
) -> None:
    """Heads the size does not divide, or groups (key heads) it neither divides nor is a
    multiple of: refused with the numbers (the size, the two counts)."""
    hf = copy.deepcopy(hybrid_model(name).hf_config)
    for field, value in fields.items():
        setattr(hf, field, value)
    with pytest.raises(ValueError, match=rf"size {size} cannot split .*{named}"):
        check_tensor_parallel(hf, size)


@pytest.mark.parametrize("name", ["tiny-random-qwen3-next", "tiny-random-nemotron-h"])
def test_more_ranks_than_groups_replicate_them(name: str) -> None:
    """2 Mamba2 groups / DeltaNet key heads (and 2 K/V heads) over 4 ranks: accepted, each
    group held by 2 ranks; the one-group twin splits over 2 and 4."""
    check_tensor_parallel(hybrid_model(name).hf_config, 4)
    (twin,) = (t for t in TINY_REPLICATED_MODELS if t.startswith(name))
    for size in (2, 4):
        check_tensor_parallel(hybrid_model(twin).hf_config, size)
