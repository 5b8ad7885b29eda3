"""Fuzzing the real server (toy card) from its own OpenAPI schema with schemathesis.

Schemathesis reads ``/openapi.json`` and generates bodies for ``POST /v1/audio/speech``,
``POST /v1/chat/completions`` and ``GET /v1/models`` (valid ones, and ones that break the
schema). Most cases get a served model id, so that they reach the engine rather than stop at
the 404 for an unknown model. No case may get a 5xx or hang (each call has a timeout), and the
server must be healthy and idle afterwards. The default suite runs about 100 cases; the
``slow`` test runs 500.
"""

from __future__ import annotations

import time
from collections import Counter

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.serving import running_server

OPERATIONS = [("/v1/audio/speech", "POST"), ("/v1/chat/completions", "POST")]
CALL_TIMEOUT = 30.0  # seconds; a case that takes longer counts as a hang
MODEL_IDS = st.sampled_from(["toy", "toy-tts", "toy", None])  # None: keep the generated id


@pytest.fixture(scope="module")
def base():
    with running_server("--model", "toy") as url:
        yield url


def fuzz(base: str, cases_per_operation: int) -> Counter:
    """Run ``cases_per_operation`` generated cases on each POST operation (and ``/v1/models``);
    returns the count of cases per (path, status). Fails on a 5xx or a timeout."""
    schema = schemathesis.openapi.from_url(base + "/openapi.json")
    seen: Counter = Counter()
    with requests.Session() as session:
        operations = [*OPERATIONS, ("/v1/models", "GET")]
        for path, method in operations:
            examples = cases_per_operation if method == "POST" else 5

            @settings(
                max_examples=examples,
                deadline=None,
                database=None,
                derandomize=True,  # the same cases on every run
                phases=[Phase.explicit, Phase.generate, Phase.shrink],
                suppress_health_check=list(HealthCheck),
            )
            @given(case=schema[path][method].as_strategy(), model=MODEL_IDS)
            def run(case, model) -> None:  # noqa: ANN001
                if model is not None and isinstance(case.body, dict):
                    case.body["model"] = model
                response = case.call(base_url=base, session=session, timeout=CALL_TIMEOUT)
                seen[(case.path, response.status_code)] += 1
                assert response.status_code < 500, (
                    f"{response.status_code} for {case.body!r}: {response.text[:500]}"
                )

            run()
    health = httpx.get(base + "/health", timeout=10)
    for _ in range(100):  # aborted or finished requests leave nothing behind
        if health.json()["live_requests"] == 0 and health.json()["running_batches"] == 0:
            break
        time.sleep(0.05)
        health = httpx.get(base + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert health.json()["live_requests"] == health.json()["queued_units"] == 0
    return seen


def _check_coverage(seen: Counter, cases_per_operation: int) -> None:
    for path, _ in OPERATIONS:
        statuses = {status for (p, status) in seen if p == path}
        total = sum(n for (p, _), n in seen.items() if p == path)
        assert total >= cases_per_operation * 0.9, (path, total)
        assert 200 in statuses and statuses & {400, 404}, (path, statuses)  # both kinds ran


def test_fuzz_the_openapi_schema(base):
    """About 100 generated cases (50 per POST operation): no 5xx, no hang, healthy after."""
    seen = fuzz(base, 50)
    _check_coverage(seen, 50)


@pytest.mark.slow
def test_fuzz_the_openapi_schema_500_cases(base):
    """500 generated cases (250 per POST operation), for the long run."""
    seen = fuzz(base, 250)
    _check_coverage(seen, 250)
    assert sum(seen.values()) >= 500
