"""`make bench`'s report: the markdown table and the plot, from the report dict bench/run.py builds."""
from __future__ import annotations

from bench import light
from bench.loadtest.proc import cores_note
from bench.loadtest.workload import SHORT_TOKENS


def plot(report: dict, path: str, labels: dict[str, str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for arm, data in report["arms"].items():
        label = f"{arm}: {labels[arm]}"
        pts = data["sweep"]
        rates = [p["offered_rate"] for p in pts]
        axes[1].plot(rates, [p["all"]["p99"] for p in pts], marker="o", label=label)
        axes[2].plot(rates, [p["throughput"] for p in pts], marker="o", label=label)
        cdf = data.get("at_70pct_b", {}).get("short_latencies_ms", [])
        if cdf:
            xs = sorted(cdf)
            axes[0].plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
    axes[0].set(title="short-request latency CDF at 70% of (b)'s capacity", xlabel="ms", xscale="log")
    axes[1].set(title="p99 latency vs offered rate", xlabel="offered req/s", ylabel="ms", yscale="log")
    axes[1].axhline(report["latency_target_ms"], color="grey", linestyle="--")
    axes[2].set(title="throughput vs offered rate", xlabel="offered req/s", ylabel="answered req/s")
    for ax in axes:
        ax.grid(True, alpha=0.3)
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(report: dict, labels: dict[str, str]) -> str:
    lines = [f"# tsbatch benchmark ({report['when']})", "",
             f"Machine: {report['machine']}. Command: `{report['command']}`.",
             f"Workload `{report.get('workload', 'two-cluster')}`: open-loop Poisson, {report['mix']}. "
             f"Latency target p99 ≤ {report['latency_target_ms']} ms.",
             f"Windows: {report['duration']} s per arm and rate, arms interleaved at each rate, latency timed "
             "from each request's scheduled arrival; capacity is the rate before the first one that misses the "
             "target (a first miss with a pass above it is measured again: a rate misses when both windows do), "
             "each arm's knee then bisected twice (one more window per arm each time); at 70% of (b)'s "
             f"capacity {report['rounds']} interleaved windows per arm, pooled."
             + (f" Cores: {cores_note(report['cores'])}." if report.get("cores") else "")] + workload_lines(report) + ["",
             "| arm | capacity at target (req/s) | max throughput (req/s) | padding waste | short p99 @70% of b (ms) | long p99 @70% of b (ms) | lost @70% | short p50 / p99, one in flight (ms) |",
             "|---|---|---|---|---|---|---|---|"]
    for arm, data in report["arms"].items():
        at = data.get("at_70pct_b", {})
        cap = ("≥ " if data.get("capacity_at_least") else "") + str(data["capacity"])
        alone = at.get("one_in_flight", {}).get("short", {})
        lines.append(f"| {arm}: {labels[arm]} | {cap} | {data['max_throughput']} | "
                     f"{at.get('padding_waste')} | {at.get('short', {}).get('p99')} | {at.get('long', {}).get('p99')} | "
                     f"{at.get('lost')} | {alone.get('p50')} / {alone.get('p99')} |")
    if report.get("light"):
        lines += ["", f"Light load ({report['rounds']} interleaved windows per arm and rate, pooled; "
                  f"{light.LIGHT_RATE:g} req/s and {light.LIGHT_SHARE:.0%} of the shipped arm's capacity, t's where it runs, else d's):", ""] + \
            light.light_markdown(report["light"], labels)
    lines += ["", "Ratios (same run):"]
    for key, value in report["ratios"].items():
        lines.append(f"- {key}: {value}")
    if report.get("machine_limit"):
        lines += ["", "Most served real tokens/s of each arm over the in-process ceiling sorted by length "
                  f"({limit_of(report, 'sorted')} tokens/s) / at the served shapes ({limit_of(report)} tokens/s) "
                  "(tokens, not requests: an arm that refuses long requests under overload answers more of them): "
                  + "; ".join(f"{arm} {efficiency(data, report['machine_limit'])}" for arm, data in report["arms"].items())]
        limit = report["machine_limit"]
        lines += ["", f"Machine limit in process (bench/ceilings.py), measured right after the sweep, "
                  f"at {limit['shapes']}: {limit['real_tokens_per_s']} real tokens/s; serving efficiency (best "
                  f"served tokens/s ÷ that): {report['efficiency']}. The same limit measured at the end of the run: "
                  f"{report.get('machine_limit_at_end', {}).get('real_tokens_per_s')} real tokens/s. "
                  f"Sorted by length: {limit.get('sorted', {}).get('real_tokens_per_s')} real tokens/s."]
    return "\n".join(lines) + "\n"


def workload_lines(report: dict) -> list[str]:
    """Where the text came from and its token lengths (the model's tokenizer, before truncation)."""
    lines = []
    if report.get("source"):
        src = report["source"]
        lines.append(f"Text: {src['corpus']} (Python {src['python']}; {src['paragraphs']} paragraphs, "
                     f"{src['passages']} passages, {src['sentences']} sentences; digest {src['sha256_12']}).")
    hist = report.get("histogram")
    if hist:
        lines += ["", f"Token lengths of {hist['texts']} of the workload's requests (p50 {hist['p50']}, p90 "
                  f"{hist['p90']}, p99 {hist['p99']}, max {hist['max']}; short = at most {SHORT_TOKENS} tokens: "
                  f"{hist['short_share']:.0%}):", "",
                  "| tokens | " + " | ".join(hist["bins"]) + " |", "|---|" + "---|" * len(hist["bins"]),
                  "| requests | " + " | ".join(str(n) for n in hist["bins"].values()) + " |"]
    return lines


def limit_of(report: dict, shapes: str | None = None) -> float:
    limit = report["machine_limit"]
    return (limit[shapes] if shapes else limit)["real_tokens_per_s"]


def efficiency(data: dict, limit: dict) -> str:
    best = data["max_served_tokens_per_s"]
    return f"{best / limit['sorted']['real_tokens_per_s']:.2f} / {best / limit['real_tokens_per_s']:.2f}"
