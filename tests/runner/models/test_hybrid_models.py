"""Hybrid families (Gemma 3, GPT-OSS, Qwen3-Next, Nemotron-H) vs transformers, fp32.

(a) a full-sequence forward; (b) prefill of a prefix, then chunks and single-token decodes
carrying the recurrent state explicitly and the sliding-window KV through slots, equal to
the full forward; batched decode of two sequences; snapshot/restore of the state.
"""

from __future__ import annotations

import pytest
import torch

from hicache.runner.models.recurrent import RecurrentState
from tests.helpers.numerics import order_bound
from tests.runner.models.hybrid_fixtures import (
    HYBRID,
    hf_logits,
    hybrid_model,
    new_pool,
    prompt,
    slots_for,
    step,
)

N = 26
PAGES = [5, 0, 6, 2, 4, 1, 3]  # shuffled, non-contiguous


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max().item())


def tol(ref: torch.Tensor) -> float:
    """The bound on fp32 logits against transformers' ``ref`` (one sequence's, ``(n, V)``).

    Both sides add the same terms in another order (paged and chunked kernels against
    dense ones, and per x86 dispatch); the longest reduction of any tiny hybrid is the MLP's
    128 terms (intermediate size), so a logit may move by ``order_bound(128, |z|)`` with
    ``|z|`` the logits' scale: 2.1e-4 for Gemma 3 (``|z| <= 14.1``), 1.3e-4 for the
    others (``|z| <= 8.3``). Measured at most 6.4e-5 (Gemma 3) and 2.5e-5 (the others)
    under default, AVX2 and AVX-512; a fixed 1e-4 left Gemma 3 a margin of 1.6. A lost
    recurrent state or keys read from shifted slots move them by 0.08 to 10.
    """
    return order_bound(128, ref.abs().max().item())


@pytest.mark.parametrize("name", HYBRID)
def test_full_forward_matches_transformers(name: str) -> None:
    ids = prompt(name, N)
    logits, out = step(name, new_pool(name), [ids], [0], [slots_for(PAGES, N)], None)
    assert logits.shape == (N, hybrid_model(name).model.config.vocab_size)
    assert max_diff(logits, hf_logits(name, ids)) <= tol(hf_logits(name, ids))
    specs = hybrid_model(name).model.state_specs()
    assert set(out.states) == set(specs)
    for layer, state in out.states.items():
        assert state.batch == 1
        assert tuple(state.conv.shape[1:]) == specs[layer].conv
        assert tuple(state.ssm.shape[1:]) == specs[layer].ssm


def _poison_outside_window(
    name: str, pool_layers: list[int], pool: object, slots: torch.Tensor, upto: int
) -> None:
    """NaN the K/V of positions < ``upto`` in the sliding layers: nothing may read them."""
    for j in pool_layers:
        pool.k_buffer(j)[slots[:upto]] = float("nan")  # type: ignore[attr-defined]
        pool.v_buffer(j)[slots[:upto]] = float("nan")  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", HYBRID)
def test_prefix_then_chunks_and_decode_match_full_forward(name: str) -> None:
    model = hybrid_model(name).model
    cfg = model.config
    ids = prompt(name, N)
    ref = hf_logits(name, ids)
    pool = new_pool(name)
    slots = slots_for(PAGES, N)
    sliding = [cfg.kv_index(i) for i, k in enumerate(cfg.layer_kinds) if k == "sliding_attention"]
    window = getattr(cfg, "sliding_window", None)
    states = None
    cuts = [8, 14, 15, 16, 17, 22, N]  # page-aligned prefix, a chunk, decodes, chunks
    start = 0
    for end in cuts:
        if window is not None and start > 0:
            _poison_outside_window(name, sliding, pool, slots, max(0, start + 1 - window))
        logits, out = step(name, pool, [ids[start:end]], [start], [slots], states)
        assert max_diff(logits, ref[start:end]) <= tol(ref), (start, end)
        assert torch.isfinite(logits).all()
        states = out.states
        start = end


@pytest.mark.parametrize("name", HYBRID)
def test_batched_decode_of_two_sequences(name: str) -> None:
    a, b = prompt(name, 14), prompt(name, 11, offset=3)
    ref_a, ref_b = hf_logits(name, a), hf_logits(name, b)
    pool = new_pool(name)
    sa, sb = slots_for([0, 2, 4, 6], 14), slots_for([7, 5, 3], 11)
    logits, out = step(name, pool, [a[:11], b[:8]], [0, 0], [sa, sb], None)
    assert max_diff(logits[:11], ref_a[:11]) <= tol(ref_a)
    assert max_diff(logits[11:], ref_b[:8]) <= tol(ref_b)
    states = out.states
    for i in range(3):
        pa, pb = 11 + i, 8 + i
        logits, out = step(name, pool, [a[pa : pa + 1], b[pb : pb + 1]], [pa, pb], [sa, sb], states)
        assert max_diff(logits[0], ref_a[pa]) <= tol(ref_a)
        assert max_diff(logits[1], ref_b[pb]) <= tol(ref_b)
        states = out.states


@pytest.mark.parametrize("name", ["tiny-random-qwen3-next", "tiny-random-nemotron-h"])
def test_state_snapshot_restores_a_page_aligned_boundary(name: str) -> None:
    """Snapshot after 8 tokens, run one continuation, restore, run another: both exact,
    and the forward never modifies the states it was given."""
    model = hybrid_model(name).model
    base = prompt(name, 8)
    tails = [prompt(name, 6, offset=8), prompt(name, 6, offset=20)]
    pool = new_pool(name)
    slots = slots_for([3, 1, 5, 7], 14)
    _, out = step(name, pool, [base], [0], [slots], None)
    snapshot = {
        k: RecurrentState(conv=s.conv.clone(), ssm=s.ssm.clone()) for k, s in out.states.items()
    }
    assert set(snapshot) == set(model.state_specs())
    for tail in tails:
        given = {
            k: RecurrentState(conv=s.conv.clone(), ssm=s.ssm.clone()) for k, s in snapshot.items()
        }
        logits, _ = step(name, pool, [tail], [8], [slots], given)
        full = torch.cat((base, tail))
        assert max_diff(logits, hf_logits(name, full)[8:]) <= tol(hf_logits(name, full))
        for k, s in given.items():
            assert torch.equal(s.conv, snapshot[k].conv) and torch.equal(s.ssm, snapshot[k].ssm)


def test_zero_states_equal_no_states() -> None:
    name = "tiny-random-nemotron-h"
    model = hybrid_model(name).model
    ids = prompt(name, 7)
    slots = slots_for([0, 1], 7)
    a, _ = step(name, new_pool(name), [ids], [0], [slots], None)
    b, _ = step(name, new_pool(name), [ids], [0], [slots], model.zero_states(1))
    assert torch.equal(a, b)
