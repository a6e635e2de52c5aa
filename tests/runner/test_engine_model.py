"""Engine models vs transformers on the same weights; runner, loader and sampling."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from hicache.engine import SamplingParams, make_generator, sample
from hicache.memory import DevicePool
from hicache.runner import (
    DEFAULT_MODEL,
    ForwardBatch,
    ModelRunner,
    kv_spec_from_hf_config,
    load_model,
    resolve_checkpoint,
    weights_fingerprint,
)
from hicache.runner import loader as loader_mod
from hicache.runner.models import (
    DecoderConfig,
    RopeConfig,
    UnsupportedModelError,
    inverse_frequencies,
)
from hicache.runner.models.attention import AttentionContext
from hicache.spec import KVSpec
from tests.helpers.engine_fixtures import (
    TINY,
    engine_model,
    hf_logits,
    hf_model,
    make_runner,
    prompt_ids,
    slots_for,
)

TOL = 1e-4
"""fp32 logits against transformers'. Both sides add the same terms in another order
(paged attention against dense, and per x86 dispatch): the longest reduction of the tiny
models is the MLP's 128 terms and their logits are at most 8.3 in magnitude, so two correct
orders differ by up to ``order_bound(128, 8.3)`` = 1.3e-4 (tests/helpers/numerics.py); TOL
stays under it. Measured at most 1e-5 under default, AVX2 and AVX-512."""


def batch(ids: torch.Tensor, start: int, slots: torch.Tensor, **kw: object) -> ForwardBatch:
    """One sequence whose new tokens ``ids`` start at position ``start``."""
    n = len(ids)
    return ForwardBatch(
        input_ids=ids,
        positions=torch.arange(start, start + n),
        extend_lens=[n],
        seq_slots=[slots],
        **kw,  # type: ignore[arg-type]
    )


# ---------------------------------------------------------------- the tiny models themselves


def test_tiny_models_cover_the_family_features() -> None:
    cfgs = {name: DecoderConfig.from_hf(engine_model(name).hf_config) for name in TINY}
    llama, qwen2, qwen3 = (cfgs[n] for n in TINY)
    assert llama.rope.rope_type == "llama3" and not llama.tie_word_embeddings
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.tie_word_embeddings
    assert engine_model("tiny-random-qwen2").model.lm_head is None
    assert qwen3.qk_norm and not qwen3.qkv_bias
    assert qwen3.head_dim * qwen3.num_heads != qwen3.hidden_size
    for cfg in cfgs.values():
        assert cfg.num_kv_heads < cfg.num_heads  # GQA
        assert cfg.vocab_size == len(engine_model(None).tokenizer)


# ------------------------------------------------------------------- logits vs transformers


@pytest.mark.parametrize("name", TINY)
def test_cold_prefill_matches_transformers(name: str) -> None:
    runner = make_runner(name)
    ids = prompt_ids(name, 20)
    slots = slots_for([3, 0, 4, 1, 2], 4, 20)
    out = runner.forward(batch(ids, 0, slots), all_logits=True)
    ref = hf_logits(name, ids)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert (out - ref).abs().max().item() <= TOL
    last = runner.forward(batch(ids, 0, slots))
    assert torch.allclose(last[0], ref[-1], atol=TOL)


@pytest.mark.parametrize("name", TINY)
def test_extend_on_cached_prefix_in_shuffled_pages(name: str) -> None:
    runner = make_runner(name, num_pages=16, page_size=4)
    pages = runner.pool.allocator.alloc(5)
    assert pages is not None
    pages = [pages[i] for i in (3, 0, 4, 1, 2)]  # non-contiguous, out of order
    ids = prompt_ids(name, 20)
    slots = slots_for(pages, 4, 20)
    runner.forward(batch(ids[:13], 0, slots[:13]))  # writes the 13-token prefix
    out = runner.forward(batch(ids[13:], 13, slots), all_logits=True)
    ref = hf_logits(name, ids)[13:]
    assert (out - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("name", TINY)
def test_batched_decode_of_two_sequences(name: str) -> None:
    runner = make_runner(name, num_pages=16, page_size=4)
    lens, steps = (9, 15), 3
    full = [prompt_ids(name, n + steps) for n in lens]
    slots = [slots_for([0, 2, 4, 6, 8], 4, 20), slots_for([9, 7, 5, 3, 1], 4, 20)]
    prefill = ForwardBatch(
        input_ids=torch.cat([f[:n] for f, n in zip(full, lens, strict=True)]),
        positions=torch.cat([torch.arange(n) for n in lens]),
        extend_lens=list(lens),
        seq_slots=[s[:n] for s, n in zip(slots, lens, strict=True)],
    )
    out = runner.forward(prefill)
    refs = [hf_logits(name, f) for f in full]
    assert out.shape == (2, refs[0].shape[-1])
    for i, n in enumerate(lens):
        assert (out[i] - refs[i][n - 1]).abs().max().item() <= TOL
    for step in range(steps):
        pos = [n + step for n in lens]
        decode = ForwardBatch(
            input_ids=torch.stack([f[p] for f, p in zip(full, pos, strict=True)]),
            positions=torch.tensor(pos),
            extend_lens=[1, 1],
            seq_slots=[s[: p + 1] for s, p in zip(slots, pos, strict=True)],
        )
        out = runner.forward(decode)
        for i, p in enumerate(pos):
            assert (out[i] - refs[i][p]).abs().max().item() <= TOL


def test_mixed_batch_of_extend_and_decode() -> None:
    name = "tiny-random-qwen3"
    runner = make_runner(name, num_pages=16, page_size=4)
    a, b = prompt_ids(name, 12), prompt_ids(name, 6)
    sa, sb = slots_for([5, 1, 7], 4, 12), slots_for([2, 8], 4, 6)
    runner.forward(batch(a[:11], 0, sa[:11]))
    mixed = ForwardBatch(
        input_ids=torch.cat([a[11:], b]),
        positions=torch.cat([torch.tensor([11]), torch.arange(6)]),
        extend_lens=[1, 6],
        seq_slots=[sa, sb],
    )
    out = runner.forward(mixed, all_logits=True)
    assert (out[0] - hf_logits(name, a)[11]).abs().max().item() <= TOL
    assert (out[1:] - hf_logits(name, b)).abs().max().item() <= TOL


def test_layer_wait_runs_once_per_layer_after_the_write() -> None:
    name = "tiny-random-llama"
    runner = make_runner(name)
    ids = prompt_ids(name, 6)
    slots = slots_for([1, 3], 4, 6)
    calls: list[int] = []

    def wait(layer: int) -> None:
        # the new tokens' K/V of this layer are already in the pool, the next layer's not
        assert runner.pool.k_buffer(layer)[slots].abs().sum() > 0
        if layer + 1 < runner.pool.spec.num_layers:
            assert runner.pool.k_buffer(layer + 1)[slots].abs().sum() == 0
        calls.append(layer)

    runner.forward(batch(ids, 0, slots, layer_wait=wait))
    assert calls == list(range(runner.model.config.num_layers))


def test_bfloat16_model_and_pool_track_fp32() -> None:
    """The CUDA default dtype, exercised on CPU: close to fp32, same greedy tokens."""
    name = "tiny-random-llama"
    lm = load_model(name, dtype="bfloat16")
    assert lm.model.dtype == torch.bfloat16
    pool = DevicePool(kv_spec_from_hf_config(lm.hf_config, "bfloat16"), 8, 4)
    ids = prompt_ids(name, 20)
    out = ModelRunner(lm.model, pool).forward(batch(ids, 0, torch.arange(20)), all_logits=True)
    ref = hf_logits(name, ids)
    assert out.dtype == torch.float32
    # bf16 rounds every activation to 8 significant bits (u = 2**-8): logits move by a
    # few u times their scale (measured 0.27 = 3.4% of it); the bound is 10% of it
    assert (out - ref).abs().max().item() < 0.1 * ref.abs().max().item()
    # the greedy tokens mostly agree: a statistical check, not implied by the bound (5 of
    # the 20 positions have top-two gaps under 0.1), so a few flips are allowed
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9


# --------------------------------------------------------------------- the runner's contract


def test_forward_batch_and_runner_validate() -> None:
    ids = torch.arange(4)
    with pytest.raises(ValueError, match="sum"):
        ForwardBatch(input_ids=ids, positions=ids, extend_lens=[3], seq_slots=[torch.arange(4)])
    with pytest.raises(ValueError, match="extend_len"):
        ForwardBatch(input_ids=ids, positions=ids, extend_lens=[4], seq_slots=[torch.arange(3)])
    lm = engine_model("tiny-random-llama")
    wrong = DevicePool(KVSpec(num_layers=2, num_kv_heads=2, head_dim=16), 4, 4)
    with pytest.raises(ValueError, match="does not fit"):
        ModelRunner(lm.model, wrong)


# ------------------------------------------------------------------- configs and RoPE


def test_llama3_rope_matches_transformers() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = engine_model("tiny-random-llama").hf_config
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    ours = inverse_frequencies(RopeConfig.from_hf(hf_config), 16)
    # one power and a few products per frequency, in fp32 against transformers' float
    # result: a few ulps (eps = 1.2e-7), equal here on every dispatch
    assert torch.allclose(ours, ref.float(), rtol=1e-6)
    plain = inverse_frequencies(RopeConfig(theta=10000.0), 16)
    assert not torch.allclose(ours, plain)  # the scaling does act on this model


def test_unsupported_features_raise_clearly() -> None:
    with pytest.raises(UnsupportedModelError, match="rope_type='yarn'"):
        RopeConfig(rope_type="yarn")
    from transformers import GPT2Config, Qwen2Config

    with pytest.raises(UnsupportedModelError, match="model_type='gpt2'"):
        DecoderConfig.from_hf(GPT2Config())
    with pytest.raises(UnsupportedModelError, match="sliding"):
        DecoderConfig.from_hf(Qwen2Config(use_sliding_window=True, max_window_layers=0))
    with pytest.raises(FileNotFoundError, match="not a Hugging Face directory"):
        resolve_checkpoint("/nonexistent/model")


# ------------------------------------------------------------------ loading and the default


def test_default_model_greedy_matches_transformers_generate() -> None:
    lm = engine_model(None)
    assert lm.name == DEFAULT_MODEL and lm.fingerprint.startswith("sha256-full:")
    assert (lm.path / "model.safetensors").is_file()
    tok = lm.tokenizer
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor(tok(text)["input_ids"])
    new_tokens = 16

    with torch.no_grad():
        ref = (
            hf_model(None)
            .generate(
                ids[None],
                attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
                max_new_tokens=new_tokens,
                do_sample=False,
            )[0, len(ids) :]
            .tolist()
        )

    runner = make_runner(None, num_pages=64, page_size=4)
    pages = runner.pool.allocator.alloc(16)
    assert pages is not None
    slots = slots_for(pages[::-1], 4, len(ids) + new_tokens)
    params = [SamplingParams(temperature=0)]
    logits = runner.forward(batch(ids, 0, slots[: len(ids)]))
    got: list[int] = []
    eos = hf_model(None).generation_config.eos_token_id
    while len(got) < new_tokens:
        token = int(sample(logits, params, [None])[0])
        got.append(token)
        if token == eos:
            break
        n = len(ids) + len(got)
        logits = runner.forward(batch(torch.tensor([token]), n - 1, slots[:n]))
    assert got == ref, (tok.decode(got), tok.decode(ref))


def test_weights_fingerprint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = engine_model("tiny-random-qwen2").path
    copy = tmp_path / "copy"
    shutil.copytree(src, copy)
    full = weights_fingerprint(copy)
    assert full == weights_fingerprint(src) and full.startswith("sha256-full:")
    with (copy / "model.safetensors").open("r+b") as fh:
        fh.seek(-3, os.SEEK_END)
        byte = fh.read(1)
        fh.seek(-3, os.SEEK_END)
        fh.write(bytes([byte[0] ^ 1]))
    assert weights_fingerprint(copy) != full
    monkeypatch.setattr(loader_mod, "FULL_HASH_LIMIT_BYTES", 0)
    sampled = weights_fingerprint(copy)
    assert sampled.startswith("sha256-sampled:") and sampled == weights_fingerprint(copy)
    assert sampled != weights_fingerprint(src)  # the last window covers the flipped byte


# ------------------------------------------------------------------------------ sampling


def test_sampling_params_validate() -> None:
    for bad in (
        {"temperature": -0.1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"max_tokens": 0},
        {"stop": [""]},
        {"seed": 1.5},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)  # type: ignore[arg-type]
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


def test_greedy_and_top_k_1_are_argmax() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    greedy = [SamplingParams(temperature=0)] * 4
    assert torch.equal(sample(logits, greedy, [None] * 4), logits.argmax(-1))
    top1 = [SamplingParams(temperature=1.5, top_k=1)] * 4
    assert torch.equal(sample(logits, top1, [None] * 4), logits.argmax(-1))
    nucleus = [SamplingParams(temperature=1.0, top_p=1e-6)] * 4  # keeps only the top token
    gens = [make_generator(p, "cpu") for p in nucleus]
    assert torch.equal(sample(logits, nucleus, gens), logits.argmax(-1))


def test_seeded_sampling_is_reproducible_and_filtered() -> None:
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(1))

    def draw(params: SamplingParams, rounds: int = 30) -> torch.Tensor:
        batch_params = [params] * 3
        gens = [make_generator(p, "cpu") for p in batch_params]
        return torch.stack([sample(logits, batch_params, gens) for _ in range(rounds)])

    a, b = (
        draw(SamplingParams(temperature=2.0, seed=7)),
        draw(SamplingParams(temperature=2.0, seed=7)),
    )
    assert torch.equal(a, b)
    assert not torch.equal(a, draw(SamplingParams(temperature=2.0, seed=8)))
    top2 = draw(SamplingParams(temperature=5.0, top_k=2, seed=3))
    allowed = logits.topk(2, dim=-1).indices
    assert all(int(t) in allowed[i].tolist() for row in top2 for i, t in enumerate(row))
    assert len(top2.unique()) > 3  # it does sample, not just take the argmax


def test_mixed_batch_with_a_decode_group_matches_transformers() -> None:
    """Two single-token sequences (one padded decode call) around an extend of a third,
    in one forward: each row equals transformers' logits at its position."""
    name = "tiny-random-llama"
    runner = make_runner(name, num_pages=24, page_size=4)
    a, b, c = prompt_ids(name, 10), prompt_ids(name, 7), prompt_ids(name, 9)
    sa, sb, sc = slots_for([0, 3, 6], 4, 10), slots_for([9, 12], 4, 7), slots_for([1, 4, 7], 4, 9)
    runner.forward(batch(a[:9], 0, sa[:9]))
    runner.forward(batch(b[:6], 0, sb[:6]))
    mixed = ForwardBatch(
        input_ids=torch.cat([a[9:], c, b[6:]]),
        positions=torch.cat([torch.tensor([9]), torch.arange(9), torch.tensor([6])]),
        extend_lens=[1, 9, 1],
        seq_slots=[sa, sc, sb],
    )
    out = runner.forward(mixed)
    for row, (ids, pos) in enumerate(((a, 9), (c, 8), (b, 6))):
        ref = hf_logits(name, ids)
        assert (out[row] - ref[pos]).abs().max().item() <= TOL


@pytest.mark.parametrize("scattered", [False, True])
def test_decode_gathers_by_page_or_by_slot_alike(scattered: bool) -> None:
    """Decode K/V are gathered a page at a time when the slots lie over whole pages, and
    token by token otherwise (slots in any order): both give transformers' logits."""
    name = "tiny-random-qwen2"
    runner = make_runner(name, num_pages=16, page_size=4)
    lens = (9, 6)
    full = [prompt_ids(name, n + 1) for n in lens]
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(64, generator=gen) if scattered else torch.arange(64)
    slots = [order[:10], order[32:39]]
    for f, s, n in zip(full, slots, lens, strict=True):
        runner.forward(batch(f[:n], 0, s[:n]))
    decode = ForwardBatch(
        input_ids=torch.stack([f[n] for f, n in zip(full, lens, strict=True)]),
        positions=torch.tensor(lens),
        extend_lens=[1, 1],
        seq_slots=[s[: n + 1] for s, n in zip(slots, lens, strict=True)],
    )
    ctx = AttentionContext.build(runner.pool, decode.seq_slots, decode.extend_lens)
    assert ctx.decode is not None and ctx.decode.by_page is not scattered
    out = runner.forward(decode)
    for i, (f, n) in enumerate(zip(full, lens, strict=True)):
        assert (out[i] - hf_logits(name, f)[n]).abs().max().item() <= TOL
