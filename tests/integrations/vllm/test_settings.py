"""A vLLM tier config -> hicache's backend choice, and vLLM's factory finding the tier."""

from __future__ import annotations

import pytest
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from hicache.integrations.vllm import HiCacheTier
from hicache.integrations.vllm.settings import VllmTierSettings
from hicache.storage.backends.file import FileConfig
from tests.integrations.vllm.drive import TIER, Engine


def test_keys_split_into_own_vllm_and_backend_ones(tmp_path: object) -> None:
    s = VllmTierSettings.from_params(
        {
            "hicache_backend": "file",
            "file_path": str(tmp_path),
            "timeout_s": 1.5,
            "hicache_weights_fingerprint": "rev7",
            "hicache_model": "org/model",
            "locality": "REMOTE",
        }
    )
    assert s.storage.backend == "file" and s.storage.options.timeout_s == 1.5
    assert isinstance(s.storage.settings, FileConfig)
    assert s.storage.settings.path == str(tmp_path)
    assert (s.model, s.weights_fingerprint, s.locality) == ("org/model", "rev7", "REMOTE")
    d = VllmTierSettings.from_params({})
    assert (d.storage.backend, d.model, d.weights_fingerprint, d.locality) == (
        "file",
        None,
        "unset",
        None,
    )


def test_unknown_backend_key_or_value_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"'nosuch' is unknown; choose one of \[.*'file'"):
        VllmTierSettings.from_params({"hicache_backend": "nosuch"})
    with pytest.raises(ValueError, match=r"key 'fil_path'.*unknown.*file_path.*hicache_backend"):
        VllmTierSettings.from_params({"fil_path": "/x"})
    with pytest.raises(ValueError, match=r"locality='NEAR'.*LOCAL"):
        VllmTierSettings.from_params({"locality": "NEAR"})
    with pytest.raises(ValueError, match="hicache_weights_fingerprint=''"):
        VllmTierSettings.from_params({"hicache_weights_fingerprint": ""})


def test_vllm_factory_resolves_the_tier_by_module_path() -> None:
    assert SecondaryTierFactory.get_tier_class(dict(TIER)) is HiCacheTier


def test_vllm_builds_the_tier_and_refuses_a_bad_key_when_it_does(tmp_path: object) -> None:
    with Engine({"file_path": str(tmp_path), "locality": "LOCAL"}) as eng:
        assert eng.tier.tier_type == "HiCacheTier"
        assert eng.tier.locality is not None and eng.tier.locality.value == "LOCAL"
        assert eng.tier.config_info() == {"hicache_backend": "file"}
        assert eng.tier.block_size_bytes == 4096
    with pytest.raises(ValueError, match="'bogus'"):
        Engine({"bogus": 1})
    with pytest.raises(ValueError, match="dtype 'fp8_e4m3'"):
        Engine({"file_path": str(tmp_path)}, dtype="fp8_e4m3")
