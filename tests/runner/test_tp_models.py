"""Llama / Qwen2 / Qwen3 split over two real gloo ranks (and Llama / Qwen3 over four, their
two K/V heads each replicated on two ranks) equal one rank and transformers.

Each rank loads its shard (``load_model(..., tp=)``), builds a :class:`HiCache` from the
model's own cache spec (its K/V heads only) and runs, through the model runner over the
cache's L1 pool, a batch of two prefills, three decode steps and a mixed step (an extend
on a cached prefix beside a decode), then the first decode step again through the
decode graphs' static buffers (eager on CPU, the Triton kernel interpreted). The same script runs in this process on one rank; the
logits of every step must equal transformers' (and the two ranks' must be identical).
At four ranks each rank's pool holds one K/V head: the pools of two replicas are
byte-equal and hold the one-rank pool's head ``rank // 2``.
The refusals (a size that does not split the model, a hybrid family) are checked without
a process group: they happen before any weight is read.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache.cache import HiCache
from hicache.config import CacheConfig
from hicache.runner import (
    ForwardBatch,
    ModelRunner,
    kv_spec_from_hf_config,
    load_model,
    resolve_checkpoint,
)
from hicache.runner import loader as loader_mod
from hicache.runner.decode_graphs import DecodeGraphs
from hicache.runner.model_runner import cache_spec_of
from hicache.runner.models import (
    DecoderConfig,
    DecoderLM,
    WeightLoadError,
)
from hicache.runner.models.registry import check_tensor_parallel
from hicache.runner.parallel import Split, TPGroup, shard_dims
from tests.helpers.engine_fixtures import TINY, engine_model, hf_logits, prompt_ids, slots_for
from tests.helpers.ranks import run_ranks

TOL = 1e-4
"""fp32 logits of one rank, two ranks and transformers, pairwise: test_engine_model's bound
(``order_bound(128, 8.3)`` = 1.3e-4 over the tiny models' longest reduction and logits'
scale; two or four ranks add each sharded sum in two or four parts, a reordering of the
same terms). Measured at most 1.4e-5 at two ranks, 1.3e-5 at four. The cached K/V of the
last layer are held to it too: a projection of that layer's input, which carries the
same reorderings, over the same ``hidden``-term sums at a smaller scale (|K|, |V| <= 6,
asserted); measured 3.9e-6."""
TP4_MODELS = ("tiny-random-llama", "tiny-random-qwen3")
"""The models also run at four ranks (4 query heads, 2 K/V heads: each replicated twice)."""
PAGE = 4
A_LEN, B_LEN, DECODES, A_EXTEND = 13, 7, 3, 3
"""Sequence A: 13-token prefill, 3 decodes, then a 3-token extend on its cached prefix;
sequence B: 7-token prefill, 3 decodes, then one more decode beside A's extend."""
A_TOTAL, B_TOTAL = A_LEN + DECODES + A_EXTEND, B_LEN + DECODES + 1
B_OFFSET = 20
GRAPH_MODEL = "tiny-random-qwen2"
"""The model whose decode also runs through the decode graphs' buffers."""
"""B's tokens are the prompt's tokens from here on (another text than A's)."""


@dataclass(frozen=True)
class Steps:
    """Per sequence, its logits at each of its positions the script computed: A's rows
    are positions ``0 .. A_TOTAL - 1`` and B's ``0 .. B_TOTAL - 1``, except the prefill's
    rows, which are every prompt token's."""

    a: torch.Tensor
    b: torch.Tensor
    graph: torch.Tensor | None
    """``(2, vocab)``: A's and B's first decode step through :class:`DecodeGraphs`
    (:data:`GRAPH_MODEL` only; None for the others)."""
    kv: torch.Tensor
    """``(2, A_TOTAL, local K/V heads, head_dim)``: the K and V A left in the last
    layer's pool (this rank's heads)."""


def _sequences(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    ids = prompt_ids(name, B_OFFSET + B_TOTAL)
    return ids[:A_TOTAL], ids[B_OFFSET:]


def _script(name: str, tp: TPGroup) -> tuple[Steps, dict[str, Any]]:
    """Load ``name`` on this rank of ``tp`` and run the steps; the logits and what the
    rank saw (the K/V heads of its cache spec, its query heads, the fingerprint)."""
    lm = load_model(name, dtype="float32", device="cpu", tp=tp)
    assert isinstance(lm.model, DecoderLM)
    spec = cache_spec_of(lm.model, "float32")
    cfg = CacheConfig(page_size=PAGE, device_tokens=16 * PAGE, hicache_ratio=2.0)
    cache = HiCache(cfg, spec).start()
    try:
        runner = ModelRunner(lm.model, cache.full.pages.device_pool)
        a, b = _sequences(name)
        pages = cache.full.pages.device_pool.allocator.alloc(
            9
        )  # the last: the graphs' scratch page
        assert pages is not None
        sa = slots_for([pages[i] for i in (4, 0, 2, 6, 7)], PAGE, A_TOTAL)
        sb = slots_for([pages[i] for i in (5, 1, 3)], PAGE, B_TOTAL)
        run = runner.forward
        prefill = run(
            ForwardBatch(
                input_ids=torch.cat([a[:A_LEN], b[:B_LEN]]),
                positions=torch.cat([torch.arange(A_LEN), torch.arange(B_LEN)]),
                extend_lens=[A_LEN, B_LEN],
                seq_slots=[sa[:A_LEN], sb[:B_LEN]],
            ),
            all_logits=True,
        )
        rows_a, rows_b = [prefill[:A_LEN]], [prefill[A_LEN:]]
        for step in range(DECODES):
            pa, pb = A_LEN + step, B_LEN + step
            out = run(
                ForwardBatch(
                    input_ids=torch.stack([a[pa], b[pb]]),
                    positions=torch.tensor([pa, pb]),
                    extend_lens=[1, 1],
                    seq_slots=[sa[: pa + 1], sb[: pb + 1]],
                )
            )
            rows_a.append(out[:1])
            rows_b.append(out[1:])
        pa, pb = A_LEN + DECODES, B_LEN + DECODES
        mixed = run(
            ForwardBatch(
                input_ids=torch.cat([a[pa:], b[pb:]]),
                positions=torch.cat([torch.arange(pa, A_TOTAL), torch.tensor([pb])]),
                extend_lens=[A_EXTEND, 1],
                seq_slots=[sa, sb],
            ),
            all_logits=True,
        )
        rows_a.append(mixed[:A_EXTEND])
        rows_b.append(mixed[A_EXTEND:])
        # the first decode step again, through the decode graphs' static buffers (what a
        # CUDA graph replays; eager here) sized for this rank's heads: same K/V rewritten.
        # One model only (the tied one): the interpreted kernel costs seconds per layer
        graph = None
        if name == GRAPH_MODEL:
            graphs = DecodeGraphs(
                lm.model,
                cache.full.pages.device_pool,
                scratch_page=pages[8],
                max_bs=2,
                table_width=8,
            )
            graph = graphs.run(
                torch.stack([a[A_LEN], b[B_LEN]]),
                torch.tensor([A_LEN, B_LEN]),
                [sa[: A_LEN + 1], sb[: B_LEN + 1]],
            )
            assert graph is not None
        pool, last = cache.full.pages.device_pool, lm.model.config.num_layers - 1
        kv = torch.stack([pool.k_buffer(last)[sa], pool.v_buffer(last)[sa]]).clone()
        pool.allocator.free(pages)
    finally:
        cache.close()
    seen = {
        "kv_heads": spec.kv.num_kv_heads,
        "heads": lm.model.model.layers[0].self_attn.num_heads,
        "fingerprint": lm.fingerprint,
    }
    return Steps(torch.cat(rows_a), torch.cat(rows_b), graph, kv), seen


def _rank(rank: int, n: int, out: str, names: tuple[str, ...]) -> dict[str, Any]:
    tp = TPGroup.of()
    assert (tp.rank, tp.size) == (rank, n)
    seen: dict[str, Any] = {}
    for name in names:
        steps, seen[name] = _script(name, tp)
        torch.save(
            {"a": steps.a, "b": steps.b, "graph": steps.graph, "kv": steps.kv},
            Path(out, f"rank{rank}-{name}.pt"),
        )
    return seen


@dataclass(frozen=True)
class TPRun:
    """The two ranks' logits per model and what each rank reported."""

    logits: dict[str, list[Steps]]
    seen: list[dict[str, Any]]


def _run(tmp_path_factory: pytest.TempPathFactory, n: int, names: tuple[str, ...]) -> TPRun:
    for name in names:
        engine_model(name)  # materialize the checkpoints once, before the ranks race to
    out = tmp_path_factory.mktemp(f"tp{n}")
    seen = run_ranks(_rank, n, out, names)
    logits = {}
    for name in names:
        parts = [torch.load(out / f"rank{r}-{name}.pt") for r in range(n)]
        logits[name] = [Steps(p["a"], p["b"], p["graph"], p["kv"]) for p in parts]
    return TPRun(logits, seen)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory: pytest.TempPathFactory) -> TPRun:
    return _run(tmp_path_factory, 2, TINY)


@pytest.fixture(scope="module")
def tp4(tmp_path_factory: pytest.TempPathFactory) -> TPRun:
    return _run(tmp_path_factory, 4, TP4_MODELS)


def _reference(name: str) -> Steps:
    a, b = _sequences(name)
    ra, rb = hf_logits(name, a), hf_logits(name, b)
    return Steps(ra, rb, torch.stack([ra[A_LEN], rb[B_LEN]]), torch.empty(0))


@pytest.mark.parametrize("name", TINY)
def test_two_ranks_equal_one_rank_and_transformers(name: str, tp2: TPRun) -> None:
    one, seen_one = _script(name, TPGroup.single())
    ref = _reference(name)
    assert seen_one["kv_heads"] == 2 and seen_one["heads"] == 4
    assert (one.a - ref.a).abs().max().item() <= TOL
    assert (one.b - ref.b).abs().max().item() <= TOL
    r0, r1 = tp2.logits[name]
    # all-reduce and all-gather hand every rank the same sums: identical logits
    assert torch.equal(r0.a, r1.a) and torch.equal(r0.b, r1.b)
    assert r0.a.shape == ref.a.shape and r0.b.shape == ref.b.shape
    assert (r0.a - one.a).abs().max().item() <= TOL
    assert (r0.b - one.b).abs().max().item() <= TOL
    assert (r0.a - ref.a).abs().max().item() <= TOL
    assert (r0.b - ref.b).abs().max().item() <= TOL
    if name == GRAPH_MODEL:
        assert one.graph is not None and r0.graph is not None and r1.graph is not None
        assert ref.graph is not None and torch.equal(r0.graph, r1.graph)
        assert (one.graph - ref.graph).abs().max().item() <= TOL
        assert (r0.graph - one.graph).abs().max().item() <= TOL
        assert (r0.graph - ref.graph).abs().max().item() <= TOL
    else:
        assert one.graph is None and r0.graph is None
    for seen in tp2.seen:  # each rank caches its own K/V head of the two, and 2 of 4 q heads
        assert seen[name]["kv_heads"] == 1 and seen[name]["heads"] == 2
        assert seen[name]["fingerprint"] == seen_one["fingerprint"]
    for r, rank in enumerate((r0, r1)):  # the pools split the K/V heads
        assert rank.kv.shape == (2, A_TOTAL, 1, one.kv.shape[-1])
        assert (rank.kv - one.kv[:, :, r : r + 1]).abs().max().item() <= TOL


@pytest.mark.parametrize("name", TP4_MODELS)
def test_four_ranks_replicate_the_kv_heads_and_equal_one_rank(name: str, tp4: TPRun) -> None:
    """4 query heads and 2 K/V heads over 4 ranks: rank ``r`` holds query head ``r`` and
    K/V head ``r // 2``, the one its query head reads, as rank ``r ^ 1`` does."""
    one, seen_one = _script(name, TPGroup.single())
    ref = _reference(name)
    ranks = tp4.logits[name]
    for rank in ranks[1:]:  # every rank ends with the same sums: identical logits
        assert torch.equal(rank.a, ranks[0].a) and torch.equal(rank.b, ranks[0].b)
    got = ranks[0]
    assert got.a.shape == ref.a.shape and got.b.shape == ref.b.shape
    assert (got.a - one.a).abs().max().item() <= TOL
    assert (got.b - one.b).abs().max().item() <= TOL
    assert (got.a - ref.a).abs().max().item() <= TOL
    assert (got.b - ref.b).abs().max().item() <= TOL
    assert one.kv.shape == (2, A_TOTAL, 2, one.kv.shape[-1]) and one.kv.abs().max() <= 6
    # replicas computed the same head from the same inputs: byte-equal pools
    assert torch.equal(ranks[0].kv, ranks[1].kv) and torch.equal(ranks[2].kv, ranks[3].kv)
    assert not torch.equal(ranks[0].kv, ranks[2].kv)
    for r, rank in enumerate(ranks):
        assert rank.kv.shape == (2, A_TOTAL, 1, one.kv.shape[-1])
        assert (rank.kv - one.kv[:, :, r // 2 : r // 2 + 1]).abs().max().item() <= TOL
    for seen in tp4.seen:  # one K/V head cached and one query head per rank
        assert seen[name]["kv_heads"] == 1 and seen[name]["heads"] == 1
        assert seen[name]["fingerprint"] == seen_one["fingerprint"]


# ----------------------------------------------------------------------------- refusals


@pytest.fixture
def no_weight_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading any checkpoint tensor fails the test: a refusal must come before."""

    def read(*args: object, **kwargs: object) -> Iterator[tuple[str, torch.Tensor]]:
        raise AssertionError("a weight was read before the refusal")

    monkeypatch.setattr(loader_mod, "_iter_tensors", read)
    monkeypatch.setattr(loader_mod, "_iter_unread", read)


@pytest.mark.usefixtures("no_weight_read")
@pytest.mark.parametrize("size", [3, 8])
def test_size_that_cannot_split_the_heads_is_refused(size: int) -> None:
    """4 query heads: 3 and 8 ranks cannot each hold whole ones (4 ranks can: each K/V
    head is replicated on two)."""
    message = (
        f"tensor-parallel size {size} cannot split num_attention_heads=4,"
        " num_key_value_heads=2: .* \\(the llama model\\)$"
    )
    with pytest.raises(ValueError, match=message):
        load_model("tiny-random-llama", dtype="float32", tp=TPGroup(rank=0, size=size))


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size", "local_kv"),
    [(12, 4, 2, 2), (12, 4, 4, 1), (12, 4, 12, 1), (12, 4, 6, None), (8, 2, 8, 1),
     (8, 2, 4, 1), (8, 8, 8, 1), (8, 4, 16, None), (6, 3, 2, None)],
)  # fmt: skip
def test_head_splits_accepted_and_refused(
    heads: int, kv_heads: int, size: int, local_kv: int | None
) -> None:
    """A size must divide the query heads, and divide the K/V heads or be a multiple of
    them; the rank's pool then holds ``local_kv`` K/V heads."""
    base = DecoderConfig.from_hf(engine_model("tiny-random-llama").hf_config)
    cfg = dataclasses.replace(
        base, num_heads=heads, num_kv_heads=kv_heads, intermediate_size=48 * size
    )
    if local_kv is None:
        with pytest.raises(ValueError, match=f"size {size} cannot split num_attention_heads"):
            cfg.check_tensor_parallel(size)
        return
    cfg.check_tensor_parallel(size)
    with torch.device("meta"):
        model = DecoderLM(cfg, TPGroup(rank=size - 1, size=size))
    assert model.num_kv_heads == local_kv
    attn = model.model.layers[0].self_attn
    assert attn.num_heads == heads // size
    assert tuple(attn.k_proj.weight.shape) == (local_kv * cfg.head_dim, cfg.hidden_size)
    # the last rank's K/V heads are the model's last ones
    assert attn.heads.first_kv_head + local_kv == kv_heads


@pytest.mark.usefixtures("no_weight_read")
def test_size_not_dividing_the_intermediate_size_is_refused(tmp_path: Path) -> None:
    src = resolve_checkpoint("tiny-random-qwen3").path
    for f in src.iterdir():
        (tmp_path / f.name).symlink_to(f)
    (tmp_path / "config.json").unlink()
    config = json.loads((src / "config.json").read_text())
    config["intermediate_size"] = 129
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"does not divide intermediate_size=129 of the qwen3"):
        load_model(tmp_path, dtype="float32", tp=TPGroup(rank=1, size=2))
    with pytest.raises(ValueError, match="intermediate_size=129"):
        kv_spec_from_hf_config(_hf_config(tmp_path), "float32", tp_size=2)


def _hf_config(path: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, local_files_only=True)


def test_module_refuses_a_size_not_dividing_the_heads() -> None:
    cfg = DecoderConfig.from_hf(engine_model("tiny-random-llama").hf_config)
    with torch.device("meta"), pytest.raises(ValueError, match="size 3 cannot split"):
        DecoderLM(cfg, TPGroup(rank=2, size=3))


def test_rank_spec_and_shapes_without_a_group() -> None:
    """A rank's shard on the meta device: its K/V heads, projections and vocabulary rows
    (the vocabulary padded to a multiple of the size), without running anything."""
    hf = engine_model("tiny-random-qwen2").hf_config
    cfg = DecoderConfig.from_hf(hf)
    assert kv_spec_from_hf_config(hf, "float32", tp_size=2).num_kv_heads == 1
    with torch.device("meta"):
        model = DecoderLM(cfg, TPGroup(rank=1, size=2))
    assert model.num_kv_heads == 1 and model.lm_head is None  # tied: the embedding's rows
    attn = model.model.layers[0].self_attn
    assert tuple(attn.q_proj.weight.shape) == (2 * cfg.head_dim, cfg.hidden_size)
    assert tuple(attn.k_proj.weight.shape) == (cfg.head_dim, cfg.hidden_size)
    assert tuple(attn.o_proj.weight.shape) == (cfg.hidden_size, 2 * cfg.head_dim)
    mlp = model.model.layers[0].mlp
    assert tuple(mlp.down_proj.weight.shape) == (cfg.hidden_size, cfg.intermediate_size // 2)
    rows = -(-cfg.vocab_size // 2)
    assert tuple(model.model.embed_tokens.weight.shape) == (rows, cfg.hidden_size)
    assert cache_spec_of(model, "float32").kv.num_kv_heads == 1
    # four ranks: one K/V head each, head 1 on ranks 2 and 3 (weight and bias rows)
    assert kv_spec_from_hf_config(hf, "float32", tp_size=4).num_kv_heads == 1
    dims = {}
    for rank in range(4):
        with torch.device("meta"):
            model = DecoderLM(cfg, TPGroup(rank=rank, size=4))
        attn = model.model.layers[0].self_attn
        assert model.num_kv_heads == 1 and attn.num_heads == 1
        assert attn.v_proj.bias is not None and tuple(attn.v_proj.bias.shape) == (cfg.head_dim,)
        dims[rank] = shard_dims(model)
    d, width = cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for name in ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"):
        key = f"model.layers.0.self_attn.{name}"
        assert [dims[r][key] for r in range(4)] == [
            Split(0, rows=((r // 2) * d, d), full=width) for r in range(4)
        ]
    q = "model.layers.0.self_attn.q_proj.weight"
    assert [dims[r][q].rows for r in range(4)] == [(r * d, d) for r in range(4)]


def test_checkpoint_of_another_shape_is_refused_on_a_rank() -> None:
    """The full tensor's shape is checked before this rank's slice is cut: a checkpoint
    with extra vocabulary rows does not load silently on a rank."""
    cfg = DecoderConfig.from_hf(engine_model("tiny-random-llama").hf_config)
    with torch.device("meta"):
        model = DecoderLM(cfg, TPGroup(rank=0, size=2))
    model = model.to_empty(device="cpu")
    wrong = torch.zeros(cfg.vocab_size + 2, cfg.hidden_size)
    with pytest.raises(WeightLoadError, match=r"model.embed_tokens.weight: checkpoint shape"):
        model.load_weights([("model.embed_tokens.weight", wrong)])


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("name", TINY)
def test_each_rank_loads_its_slices_of_the_checkpoint(name: str, size: int) -> None:
    """Loading needs no collective: every rank of two (four) loads here, in one process,
    and each parameter is the rank's slice of the one-rank model's (read lazily, slice by
    slice); at four ranks a rank's K/V projections are the rows of K/V head ``rank // 2``."""
    whole = dict(engine_model(name).model.named_parameters())
    head_dim = DecoderConfig.from_hf(engine_model(name).hf_config).head_dim
    for rank in range(size):
        tp = TPGroup(rank=rank, size=size)
        lm = load_model(name, dtype="float32", tp=tp)
        assert isinstance(lm.model, DecoderLM)
        dims = shard_dims(lm.model)
        assert "model.layers.0.self_attn.q_proj.weight" in dims
        params = dict(lm.model.named_parameters())
        assert params.keys() == whole.keys()
        for key, p in params.items():
            want = whole[key] if key not in dims else tp.shard(whole[key], *dims[key])
            assert torch.equal(p, want), key
        kv = rank * 2 // size  # the K/V head this rank's query heads read
        for key in ("k_proj.weight", "v_proj.weight"):
            full = whole[f"model.layers.1.self_attn.{key}"]
            got = params[f"model.layers.1.self_attn.{key}"]
            assert torch.equal(got, full[kv * head_dim : (kv + 1) * head_dim]), key


def test_unread_checkpoint_tensor_pads_the_last_rank(tmp_path: Path) -> None:
    """A vocabulary of 5 rows over 2 ranks is padded to 6: rank 1 reads rows 3 and 4 of
    the file and gets one zero row, as from the tensor in memory; a column split reads
    the rank's columns."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    full = torch.arange(20, dtype=torch.float32).reshape(5, 4) + 1
    save_file({"w": full}, str(tmp_path / "w.safetensors"))
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt", device="cpu") as st:
        unread = loader_mod._UnreadTensor(st.get_slice("w"))
        assert unread.shape == full.shape
        for rank in range(2):
            tp = TPGroup(rank=rank, size=2)
            assert torch.equal(tp.shard(unread, 0, 6), tp.shard(full, 0, 6))
            assert torch.equal(tp.shard(unread, 1), full[:, 2 * rank : 2 * rank + 2])
        last = TPGroup(rank=1, size=2).shard(unread, 0, 6)
        assert torch.equal(last, torch.cat([full[3:], torch.zeros(1, 4)]))


@pytest.mark.parametrize("size", [0, -2, True, 2.0])
def test_invalid_size_is_refused_by_name(size: Any) -> None:
    hf = engine_model("tiny-random-llama").hf_config
    with pytest.raises(ValueError, match=f"tensor-parallel size={size!r} is invalid"):
        check_tensor_parallel(hf, size)


@pytest.mark.parametrize("name", ["tiny-random-deepseek-v2", "tiny-random-deepseek-v3",
                                  "tiny-random-deepseek-v32"])  # fmt: skip
def test_named_deepseek_checkpoints_split_over_1_2_and_4_ranks(name: str) -> None:
    """The tiny DeepSeek checkpoints the CLI and the benches name: their model type, the
    features they carry (q LoRA and the sigmoid router from V3 on, V3.2's indexer), and
    every split the stress bench uses (1, 2, 4 ranks) passes the start-up check, while 3
    is refused naming the heads."""
    from transformers import AutoConfig

    from hicache.runner.checkpoints import ALL_TINY_MODELS, resolve_checkpoint
    from hicache.server.args import _model_path_ok

    assert name in ALL_TINY_MODELS and _model_path_ok(name)
    hf = AutoConfig.from_pretrained(resolve_checkpoint(name).path, local_files_only=True)
    want = {"tiny-random-deepseek-v2": "deepseek_v2", "tiny-random-deepseek-v3": "deepseek_v3",
            "tiny-random-deepseek-v32": "deepseek_v32"}[name]  # fmt: skip
    assert hf.model_type == want
    assert (hf.q_lora_rank is None) == (name == "tiny-random-deepseek-v2")
    assert (getattr(hf, "index_topk", None) is not None) == (name == "tiny-random-deepseek-v32")
    for size in (1, 2, 4):
        check_tensor_parallel(hf, size)
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        check_tensor_parallel(hf, 3)
