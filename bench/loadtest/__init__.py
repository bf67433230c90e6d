"""The small load-testing library under bench/'s scripts and tests/e2e; one home per idea:

- arrivals: open-loop schedules (Poisson) and the loop that sends at them
- workload: the request mix (mostly short inputs, some near the maximum)
- client: one HTTP request, recorded as a Shot (status, latency, headers, body)
- load: many requests: open-loop windows, bursts, background closed-loop clients
- stats: the one percentile, and the summaries built on it
- sweep: offered-rate sweeps and the capacity / saturation rules that read them
- proc: CPU time and resident memory from /proc, and a memory sampler
- torchserve: the server under test: its workers' pids, warmup lines, scaling back
- report: writing JSON / markdown reports into bench/results

Importing it loads neither torch nor TorchServe.
"""
