"""Every model family declares what it caches and binds the pools it is given
(:class:`~hicache.runner.models.cached.CachedModel`), so the runner names none.

* Each family's cache spec lists exactly its components (sliding window, recurrent-state
  snapshots, indexer keys), in the cache's order, with the full KV of its pool.
* A runner over the pools built from that spec binds every component pool the model
  reads and writes itself (the sliding layers' and the indexer's; the snapshots are the
  cache's, not the model's).
* A pool the model does not use is refused, naming it; a pool of the wrong shape is
  refused, naming the shapes.
"""

from __future__ import annotations

import dataclasses

import pytest

from hicache.memory import DevicePool
from hicache.runner import ModelRunner
from hicache.runner.models.cached import CachedModel
from hicache.spec import IndexerSpec, SlidingWindowSpec
from tests.helpers.engine_fixtures import engine_model

PAGE = 4
PAGES = 8
COMPONENTS: dict[str, tuple[str, ...]] = {
    "tiny-random-llama": (),
    "tiny-random-gemma3": ("swa",),
    "tiny-random-gpt-oss": ("swa",),
    "tiny-random-qwen3-next": ("mamba",),
    "tiny-random-nemotron-h": ("mamba",),
    "tiny-random-deepseek-v3": (),
    "tiny-random-deepseek-v32": ("indexer",),
}
"""The components each family caches besides the full KV."""


def model_pools(model: CachedModel) -> tuple[DevicePool, dict[str, DevicePool]]:
    """The full KV pool and the pools of the components the model reads itself, as the
    cache would build them from the model's spec."""
    spec = model.cache_spec("float32")
    pools: dict[str, DevicePool] = {}
    for c in spec.components:
        if isinstance(c, SlidingWindowSpec | IndexerSpec):
            pools[c.name] = DevicePool(c.kv, PAGES, PAGE)
    return DevicePool(spec.kv, PAGES, PAGE), pools


@pytest.mark.parametrize("name", list(COMPONENTS))
def test_a_family_declares_its_components_and_binds_their_pools(name: str) -> None:
    model = engine_model(name).model
    spec = model.cache_spec("float32")
    assert tuple(c.name for c in spec.components) == COMPONENTS[name]
    kv, pools = model_pools(model)
    runner = ModelRunner(model, kv, pools)
    assert set(runner.pools) == set(pools) == set(COMPONENTS[name]) - {"mamba"}
    assert runner.recurrent == ("mamba" in COMPONENTS[name])
    assert (runner.swa_pool is not None) == ("swa" in COMPONENTS[name])


@pytest.mark.parametrize("name", list(COMPONENTS))
def test_a_pool_the_model_does_not_use_is_refused_by_name(name: str) -> None:
    model = engine_model(name).model
    kv, pools = model_pools(model)
    with pytest.raises(ValueError, match=r"uses no pool of component\(s\) \['bogus'\]"):
        ModelRunner(model, kv, {**pools, "bogus": kv})


def test_a_model_without_sliding_layers_refuses_an_swa_pool() -> None:
    model = engine_model("tiny-random-llama").model
    kv, _ = model_pools(model)
    with pytest.raises(ValueError, match=r"\['swa'\]: DecoderLM reads and writes no component"):
        ModelRunner(model, kv, {"swa": kv})


def test_a_sliding_pool_of_the_wrong_shape_is_refused() -> None:
    model = engine_model("tiny-random-gemma3").model
    kv, pools = model_pools(model)
    swa = pools["swa"].spec
    wrong = DevicePool(dataclasses.replace(swa, num_layers=swa.num_layers + 1), PAGES, PAGE)
    with pytest.raises(ValueError, match=r"SWA pool .* does not fit the model's sliding layers"):
        ModelRunner(model, kv, {"swa": wrong})
    with pytest.raises(ValueError, match=r"device pool \(layers, heads, dim\)=.* does not fit"):
        ModelRunner(model, pools["swa"], pools)  # the full pool must hold the global layers
