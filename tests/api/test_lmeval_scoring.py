"""lm-eval's ``local-completions`` scores a small multiple-choice task through the server.

lm-eval (``requirements/lmeval.txt``, installed by ``make venv`` into ``.venv/lmeval``,
put on ``sys.path`` here only) asks every choice's loglikelihood with ``echo`` and
``logprobs=1`` and no start position. Three servers over the tiny model: ``entries``
(today's defaults: the cache and its scoring entries), ``today`` (the cache without
scoring entries: what a scoring request got before them, no cached prefix) and ``off``
(``disable_radix_cache``). The per-choice loglikelihoods agree within the bound argued in
``tests/api/test_api_scoring.py`` (summed over a continuation's tokens: 1e-4 per token),
the accuracies are equal, and the prompt tokens computed per question (from ``/metrics``:
prompt tokens less every tier's hits) drop with the entries.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from hicache.engine.front.engine import Engine
from tests.helpers.api_fixtures import make_engine, serve
from tests.helpers.engine_fixtures import engine_model

LMEVAL = Path(__file__).resolve().parents[2] / ".venv" / "lmeval"
TASK = "hicache_mc"
QUESTIONS = [
    ("The capital of France is a city on the Seine, known for its museums; it is", 2),
    ("Water boils at sea level at a temperature of one hundred degrees on the scale of", 0),
    ("The largest planet of the solar system, a gas giant with a great red spot, is", 3),
    ("A triangle whose three sides all have the same length is called a triangle that is", 1),
    ("The chemical symbol of the element gold, from its Latin name aurum, is written as", 0),
    ("The author of the play about a prince of Denmark who meets his father's ghost is", 2),
]
CHOICES = [" Paris", " Celsius", " equilateral", " Jupiter"]
TOL_PER_TOKEN = 1e-4


def _write_task(root: Path) -> Path:
    """The task YAML and its local jsonl data under ``root``; returns the YAML's folder."""
    data = root / "data.jsonl"
    with data.open("w") as f:
        for q, answer in QUESTIONS:
            f.write(json.dumps({"question": q, "choices": CHOICES, "answer": answer}) + "\n")
    (root / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        f"  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n"
    )
    return root


def _computed(url: str) -> int:
    """Prompt tokens the server computed so far: prompt tokens less every tier's hits."""
    text = httpx.get(f"{url}/metrics", timeout=10).text

    def total(name: str) -> float:
        m = re.search(rf"^{name}_total(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
        assert m is not None, name
        return float(m.group(1))

    hits = sum(total(f"hicache_{t}_hit_tokens") for t in ("device", "host", "storage"))
    return int(total("hicache_prompt_tokens") - hits)


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, Engine]]:
    if not (LMEVAL / "lm_eval").is_dir():
        pytest.skip("lm-eval is not installed (make venv puts it in .venv/lmeval)")
    built = {
        "entries": make_engine(),
        "today": make_engine(prompt_logprobs_top=None),
        "off": make_engine(disable_radix_cache=True),
    }
    try:
        yield built
    finally:
        for e in built.values():
            e.close()


def _evaluate(url: str, tasks: Path, cache_dir: Path) -> dict[str, Any]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(
        model="local-completions",
        model_args={
            "base_url": f"{url}/v1/completions",
            "model": "tiny",
            "tokenizer_backend": "huggingface",
            "tokenizer": str(engine_model("tiny-random-llama").path),
            "num_concurrent": 1,
            "max_retries": 1,
        },
        tasks=[TASK],
        # only the test's own task: indexing lm-eval's thousands of built-in task YAMLs
        # took most of this test's time
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        log_samples=True,
        cache_requests=False,
    )
    assert out is not None
    return out


def test_lmeval_scores_alike_and_computes_less_with_the_entries(
    engines: dict[str, Engine], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setenv("OPENAI_API_KEY", "none")
    monkeypatch.syspath_prepend(str(LMEVAL))  # lm-eval and its dependencies, for this test
    tasks = _write_task(tmp_path)
    got: dict[str, tuple[list[list[float]], float, int]] = {}
    for name, engine in engines.items():
        with serve(engine) as url:
            before = _computed(url)
            out = _evaluate(url, tasks, tmp_path)
            computed = _computed(url) - before
        samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
        lls = [[float(r[0]) for r in s["filtered_resps"]] for s in samples]
        got[name] = (lls, float(out["results"][TASK]["acc,none"]), computed)
    entries, today, off = got["entries"], got["today"], got["off"]
    worst = 0.0
    for other in (today, off):
        assert entries[1] == other[1]  # the same accuracy
        for a_q, b_q in zip(entries[0], other[0], strict=True):
            for a, b in zip(a_q, b_q, strict=True):
                worst = max(worst, abs(a - b))
                assert abs(a - b) <= 8 * TOL_PER_TOKEN  # a choice is a few tokens
    per_question = {k: v[2] / len(QUESTIONS) for k, v in got.items()}
    print(f"\nprompt tokens computed per question: {per_question}; accuracy {entries[1]};")
    print(f"largest loglikelihood difference against the others: {worst:.3g}")
    assert today[2] == off[2]  # before the entries the cache served scoring requests nothing
    assert entries[2] < today[2]
