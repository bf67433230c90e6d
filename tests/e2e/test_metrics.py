"""tsbatch's batching metrics on TorchServe's own Prometheus endpoint, after known traffic."""
from __future__ import annotations

import re
import time

import requests

from tests.e2e.client import post, post_together

LONG = " ".join(["word"] * 400)  # truncated to the model's 256 tokens: the 256 bucket


def scrape(served) -> str:
    return requests.get(f"{served.metrics}/metrics", timeout=30).text


def value(text: str, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0 if none)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()) and 'ModelName="minilm"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_batching_metrics_agree_with_the_traffic_sent(torchserve):
    url = f"{torchserve.inference}/predictions/minilm"
    before = scrape(torchserve)
    payloads = ["short one", "short two", "short three", "short four", "short five", "short six",
                "short seven", "POISON inside"]
    answers = post_together(url, payloads)  # one frontend batch of 8, one pass of bucket 16
    assert sorted(a.status for a in answers) == [200] * 7 + [500]
    assert post(url, LONG).status == 200
    deadline = time.monotonic() + 20
    while True:  # the frontend reads worker metrics from its log: allow it a moment
        after = scrape(torchserve)
        if value(after, "tsbatch_isolated_failures_total") > value(before, "tsbatch_isolated_failures_total") \
                or time.monotonic() > deadline:
            break
        time.sleep(0.5)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    # 8 short requests in bucket 16 (one of them poisoned), then 1 long in bucket 256
    assert delta("tsbatch_batch_size_count", bucket="256") == 1
    assert delta("tsbatch_batch_size_sum", bucket="256") == 1
    assert delta("tsbatch_padded_tokens_total", bucket="256") == 256
    assert delta("tsbatch_real_tokens_total", bucket="256") == 256
    assert delta("tsbatch_batch_size_sum", bucket="16") == 8  # one planned batch of 8
    assert delta("tsbatch_isolated_failures_total", bucket="16") == 1
    assert 1 <= delta("tsbatch_isolation_passes_total", bucket="16") <= 2 * 3  # O(log2 8) per failure
    real, padded = delta("tsbatch_real_tokens_total", bucket="16"), delta("tsbatch_padded_tokens_total", bucket="16")
    assert 0 < real <= padded and padded % 16 == 0
    assert delta("tsbatch_forward_seconds_count", bucket="256") >= 1
    # TorchServe's own metrics are still there, counting these requests
    assert re.search(r"^ts_inference_requests_total\{.*model_name=\"minilm\"", after, re.M)
    assert value(after.replace('model_name="minilm"', 'ModelName="minilm"'), "ts_inference_requests_total") >= 8
    # warmup ran before READY and reported its time
    assert value(after, "tsbatch_warmup_total_seconds") > 0
