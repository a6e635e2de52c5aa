"""``--kv-events-config``: vLLM's and SGLang's JSON keys, validated."""

from __future__ import annotations

import pytest

from hicache.kv_events.config import KvEventsConfig


def test_their_keys_parse_and_disabled_is_none() -> None:
    cfg = KvEventsConfig.parse(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",'
        ' "replay_endpoint": "tcp://*:5558", "topic": "kv", "buffer_steps": 8, "hwm": 9,'
        ' "max_queue_size": 10}'
    )
    assert cfg == KvEventsConfig(
        publisher="zmq",
        endpoint="tcp://*:5557",
        replay_endpoint="tcp://*:5558",
        topic="kv",
        buffer_steps=8,
        hwm=9,
        max_queue_size=10,
    )
    assert KvEventsConfig.parse('{"publisher": null}') == KvEventsConfig()
    sglang = KvEventsConfig.parse('{"publisher": "zmq", "bind": true, "format": "default"}')
    assert sglang == KvEventsConfig(publisher="zmq", bind=True)
    assert KvEventsConfig.parse('{"enable_kv_cache_events": false, "publisher": "zmq"}') is None


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('{"publisher": "kafka"}', r"publisher='kafka' is invalid; one of \('null', 'zmq'\)"),
        ('{"endpoint": "localhost:1"}', r"endpoint='localhost:1' is invalid"),
        ('{"hwm": 0}', r"hwm=0 is invalid"),
        ('{"nope": 1}', r"\['nope'\] is invalid; unknown keys"),
        ('{"format": "dynamo"}', r"format='dynamo' is invalid"),
        ('{"bind": 1}', r"bind=1 is invalid"),
        ("[1]", r"must be a JSON object"),
        ("{", r"must be a JSON object"),
    ],
)
def test_bad_values_are_refused_naming_them(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KvEventsConfig.parse(text)


def test_the_serve_flag_reaches_the_engine_config() -> None:
    from hicache.cli import build_parser
    from hicache.server.args import FlagError, engine_config_from_args

    parse = build_parser().parse_args
    assert engine_config_from_args(parse(["serve"])).kv_events is None
    args = parse(["serve", "--kv-events-config", '{"publisher": "zmq", "topic": "kv"}'])
    assert engine_config_from_args(args).kv_events == KvEventsConfig(publisher="zmq", topic="kv")
    bad = parse(["serve", "--kv-events-config", '{"publisher": "kafka"}'])
    with pytest.raises(FlagError, match="--kv-events-config"):
        engine_config_from_args(bad)
