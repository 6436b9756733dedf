"""Reports of bench runs: a table with every figure as a ratio to pow2, the JSON document, the PNG plot.

Table cells read `ratio (value)`: the policy's figure divided by pow2's, then
the figure itself. Lower is better for times, prefill tokens and imbalance;
higher for turns per second, hit rate and prediction accuracy. A ratio is "-"
when either figure is missing (no successful request, no prediction) and the
baseline row reads 1.00. Without a pow2 run the first policy is the baseline.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Sequence

# (summary key, column title, unit format)
METRICS: tuple[tuple[str, str, str], ...] = (
    ("ttft_p50_s", "TTFT p50", "{:.3g}s"),
    ("ttft_p99_s", "TTFT p99", "{:.3g}s"),
    ("latency_p50_s", "turn p50", "{:.3g}s"),
    ("latency_p99_s", "turn p99", "{:.3g}s"),
    ("turns_per_s", "turns/s", "{:.3g}"),
    ("prefill_tokens", "prefill tok", "{:.3g}"),
    ("hit_rate", "hit rate", "{:.3f}"),
    ("load_imbalance", "imbalance", "{:.2f}"),
    ("prediction_accuracy", "pred. acc.", "{:.2f}"),
)
BASELINE_POLICY = "pow2"


def _cell(value: float | None, base: float | None, fmt: str) -> str:
    shown = "-" if value is None else fmt.format(value)
    if value is None or base is None or base == 0:
        return f"- ({shown})"
    return f"{value / base:.2f} ({shown})"


def ratio_table(summaries: Mapping[str, Mapping], title: str = "") -> str:
    """Fixed-width table, one row per policy, each figure as `ratio to pow2 (value)`.

    Args:
        summaries: policy -> `TraceSummary.to_json()`.
        title: printed above the table.

    Returns:
        The table as text.
    """
    if not summaries:
        return f"{title}\n(no runs)"
    baseline = BASELINE_POLICY if BASELINE_POLICY in summaries else next(iter(summaries))
    base = summaries[baseline]
    rows = [["policy"] + [name for _, name, _ in METRICS]]
    for policy, summary in summaries.items():
        rows.append([policy] + [_cell(summary.get(key), base.get(key), fmt) for key, _, fmt in METRICS])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [title] if title else []
    lines.append(f"(ratio to {baseline}, value in parentheses)")
    for i, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * width for width in widths))
    return "\n".join(lines)


def oracle_section(result: Mapping) -> str:
    """The report's oracle block (a leading newline), or "" when no run has bounds."""
    lines = oracle_lines(result)
    return "\nhit rate vs oracle bounds (same trace):\n  " + "\n  ".join(lines) if lines else ""


def oracle_lines(result: Mapping) -> list[str]:
    """warmpath's hit rate as a fraction of each oracle bound of its own trace."""
    lines = []
    for policy, bounds in result.get("oracle", {}).items():
        hit = result["policies"][policy]["summary"].get("hit_rate")
        parts = []
        for key, name in (("infinite_hit_rate", "infinite shared cache"), ("placed_hit_rate", "greedy placement")):
            bound = bounds.get(key)
            if hit is not None and bound:
                parts.append(f"{hit:.3f} / {bound:.3f} = {hit / bound:.2f} of the {name}")
        if parts:
            lines.append(f"{policy}: " + "; ".join(parts))
    return lines


def live_report(result: Mapping) -> str:
    """The text `warmpath bench` prints: the ratio table and the oracle fractions."""
    title = (f"workload {result['workload']}: {result['num_sessions']} sessions, {result['num_requests']} requests, "
             f"{result['num_replicas']} replicas, time scale {result['time_scale']}")
    summaries = {p: run["summary"] for p, run in result["policies"].items()}
    text = ratio_table(summaries, title) + oracle_section(result)
    checks = result.get("simulator_check") or {}
    if checks:
        text += "\nsimulator replay of each trace (CPU cost model):\n  " + "\n  ".join(
            f"{policy}: measured {c['measured_hit_rate']:.3f}, simulated {c['simulated_hit_rate']:.3f} "
            f"({'within' if c['is_within_tolerance'] else 'OUTSIDE'} +-{c['tolerance']:.2f})"
            for policy, c in checks.items()
        )
    return text


def simulation_report(runs: Sequence[Mapping]) -> str:
    """One ratio table per (workload, replica count) of a simulation grid."""
    groups: dict[tuple[str, int], dict[str, Mapping]] = {}
    for run in runs:
        groups.setdefault((run["workload"], run["num_replicas"]), {})[run["policy"]] = run
    tables = []
    for (workload, num_replicas), by_policy in groups.items():
        any_run = next(iter(by_policy.values()))
        title = (f"simulated {workload} on {num_replicas} replicas: {any_run['num_sessions']} sessions, "
                 f"{any_run['num_requests']} requests")
        bounds = {p: r["bounds"] for p, r in by_policy.items() if r.get("bounds")}
        tables.append(ratio_table({p: r["summary"] for p, r in by_policy.items()}, title)
                      + oracle_section({"policies": by_policy, "oracle": bounds}))
    return "\n\n".join(tables)


def write_json(path: Path, document: Mapping) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n")


def plot_live(result: Mapping, path: Path) -> None:
    """PNG: TTFT distribution (CDF) per policy, and hit rate per policy with the oracle bounds.

    Raises:
        ImportError: matplotlib is missing (`pip install -e '.[bench]'`).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ttft, ax_hit) = plt.subplots(1, 2, figsize=(12, 4.5))
    policies = list(result["policies"])
    for policy in policies:
        ttfts = sorted(r["ttft_s"] for r in result["policies"][policy]["records"]
                       if r.get("error") is None and r.get("ttft_s") is not None)
        if ttfts:
            ax_ttft.step(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], where="post", label=policy)
    ax_ttft.set_xscale("log")
    ax_ttft.set_xlabel("TTFT (s, log scale)")
    ax_ttft.set_ylabel("fraction of requests")
    ax_ttft.set_title("TTFT distribution")
    ax_ttft.legend()
    hits = [result["policies"][p]["summary"].get("hit_rate") or 0.0 for p in policies]
    ax_hit.bar(policies, hits, color="tab:blue")
    oracle = result.get("oracle", {}).get("warmpath")
    if oracle:
        for key, style, name in (("infinite_hit_rate", "--", "infinite cache"), ("placed_hit_rate", ":", "greedy placement")):
            if oracle.get(key) is not None:
                ax_hit.axhline(oracle[key], linestyle=style, color="black", label=f"oracle: {name}")
        ax_hit.legend()
    ax_hit.set_ylim(0, 1)
    ax_hit.set_ylabel("prefix hit rate (vLLM cached / prompt tokens)")
    ax_hit.set_title("hit rate per policy")
    fig.suptitle(f"warmpath bench: {result['workload']}, {result['num_replicas']} replicas")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
