"""Reports of bench runs: a table with every figure as a ratio to pow2, the JSON document, the PNG plot.

Table cells read `ratio (value)`: the policy's figure divided by pow2's, then
the figure itself. Lower is better for times, prefill tokens and imbalance;
higher for turns per second, hit rate and prediction accuracy. A ratio is "-"
when either figure is missing (no successful request, no prediction) and the
baseline row reads 1.00. Without a pow2 run that finished, the first policy
that finished is the baseline. A policy that failed has a row that says so and
why (its `error`), so a run that lost one policy still reports the others.
A run of several rounds (`bench --rounds`) adds a table of each policy's ratio
taken within each round: median and range over the rounds.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Mapping, Sequence

from cluster.writable import replace_file

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


def _done_cell(summary: Mapping) -> str:
    """How many requests a row's figures cover (`num_requests`), and how many failed (`+N failed`)."""
    done, failed = summary.get("num_requests"), summary.get("num_errors") or 0
    shown = "-" if done is None else str(done)
    return f"{shown} (+{failed} failed)" if failed else shown


def coverage_notes(summaries: Mapping[str, Mapping], baseline: str, num_planned: int | None = None) -> list[str]:
    """Rows whose figures cover fewer requests than planned (or than the baseline's), and why.

    Why: a live session stops at its first failed request, so its later steps are
    never sent; the sums (prefill tokens, turns per second) and percentiles of such
    a row describe other requests than a full row's, and its ratios compare unlike sets.
    """
    expected = num_planned if num_planned is not None else summaries[baseline].get("num_requests")
    notes = []
    for policy, summary in summaries.items():
        done, failed = summary.get("num_requests"), summary.get("num_errors") or 0
        if done is None or expected is None or (done == expected and not failed):
            continue
        unsent = expected - done - failed
        notes.append(
            f"note: {policy} completed {done} of {expected} requests ({failed} failed, {max(unsent, 0)} never sent): "
            "its figures cover other requests than a full run's, so its ratios compare unlike sets"
        )
    return notes


def _cell(value: float | None, base: float | None, fmt: str) -> str:
    shown = "-" if value is None else fmt.format(value)
    if value is None or base is None or base == 0:
        return f"- ({shown})"
    return f"{value / base:.2f} ({shown})"


def error_line(err: BaseException, limit: int = 300) -> str:
    """`Type: message` on one line, cut to `limit` characters: the `error` field of a failed run.

    Why one line: it is a row of the printed table and a field of the JSON, and a
    traceback's worth of text would bury both.
    """
    text = " ".join(str(err).split())
    line = f"{type(err).__name__}: {text}" if text else type(err).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def ratio_table(summaries: Mapping[str, Mapping | None], title: str = "",
                errors: Mapping[str, str] | None = None, num_planned: int | None = None) -> str:
    """Fixed-width table, one row per policy, each figure as `ratio to pow2 (value)`.

    Args:
        summaries: policy -> `TraceSummary.to_json()`, or None for a policy that failed.
        title: printed above the table.
        errors: policy -> why it failed; its row says so instead of figures.
        num_planned: requests the workload plans; rows that completed another number are noted.

    Returns:
        The table as text.
    """
    if not summaries:
        return f"{title}\n(no runs)"
    errors = errors or {}
    finished = [p for p, summary in summaries.items() if summary is not None]
    lines = [title] if title else []
    if not finished:
        lines.append("(no run finished)")
        lines += [f"{policy}  FAILED: {errors.get(policy, 'no result')}" for policy in summaries]
        return "\n".join(lines)
    # The first run that served a request where Ray's default served none (its figures are all None): every
    # ratio to it was blank.
    served = [p for p in finished if summaries[p].get("num_requests")] or finished
    baseline = BASELINE_POLICY if BASELINE_POLICY in served else served[0]
    base = summaries[baseline]
    rows = [["policy", "requests"] + [name for _, name, _ in METRICS]]
    for policy in finished:
        summary = summaries[policy]
        rows.append([policy, _done_cell(summary)]
                    + [_cell(summary.get(key), base.get(key), fmt) for key, _, fmt in METRICS])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    widths[0] = max([widths[0]] + [len(p) for p in summaries])
    lines.append(f"(ratio to {baseline}, value in parentheses)")
    by_policy = {row[0]: row for row in rows[1:]}
    for i, row in enumerate([rows[0]] + [by_policy.get(p) or [p] for p in summaries]):
        if len(row) == 1:
            lines.append(f"{row[0].ljust(widths[0])}  FAILED: {errors.get(row[0], 'no result')}")
        else:
            lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * width for width in widths))
    lines += coverage_notes({p: summaries[p] for p in finished}, baseline, num_planned)
    return "\n".join(lines)


def oracle_section(result: Mapping) -> str:
    """The report's oracle block (a leading newline), or "" when no run has bounds."""
    lines = oracle_lines(result)
    if not lines:
        return ""
    capacity = result.get("kv_capacity_blocks")
    placement = ""
    if capacity:
        source = {"replicas": ", as the engines report", "model config": ", from the model's shape"}.get(
            result.get("kv_capacity_source"), "")
        placement = f"; placement over {capacity} KV blocks per replica{source}"
    return f"\nhit rate vs oracle bounds (same trace{placement}):\n  " + "\n  ".join(lines)


def oracle_lines(result: Mapping) -> list[str]:
    """warmpath's hit rate as a fraction of each oracle bound of its own trace (or why the bounds failed)."""
    lines = []
    for policy, bounds in result.get("oracle", {}).items():
        if bounds.get("error"):
            lines.append(f"{policy}: bounds FAILED: {bounds['error']}")
            continue
        hit = (result["policies"][policy].get("summary") or {}).get("hit_rate")
        parts = []
        for key, name in (("infinite_hit_rate", "infinite shared cache"), ("placed_hit_rate", _placed_name(bounds))):
            bound = bounds.get(key)
            if hit is not None and bound:
                # The replay takes requests in the order they were sent; the engines served them as they arrived,
                # and a request sent later but served first can give an earlier one hits the replay cannot.
                above = " (above it: requests reached the engines out of the order they were sent)" \
                    if hit > bound + 1e-9 else ""
                parts.append(f"{hit:.3f} / {bound:.3f} = {hit / bound:.2f} of the {name}{above}")
        if parts:
            lines.append(f"{policy}: " + "; ".join(parts))
    return lines


def _placed_name(bounds: Mapping) -> str:
    """What the placed bound was: the greedy placement, or the run's own where its replay did better."""
    greedy, own = bounds.get("greedy_hit_rate"), bounds.get("own_placement_hit_rate")
    if own is None or greedy is None:
        return "greedy placement"
    which = "the run's own placement" if own > greedy else "the greedy placement"
    return f"best placement computed ({which}; greedy {greedy:.3f}, own {own:.3f})"


def _check_line(policy: str, check: Mapping) -> str:
    """One policy's simulator replay: both hit rates, or why the replay failed."""
    if check.get("error"):
        return f"{policy}: FAILED: {check['error']}"
    line = (f"{policy}: measured {check['measured_hit_rate']:.3f}, simulated {check['simulated_hit_rate']:.3f} "
            f"({'within' if check['is_within_tolerance'] else 'OUTSIDE'} +-{check['tolerance']:.2f})")
    agreement = check.get("request_agreement")
    if agreement is not None:
        line += f"; {agreement:.0%} of requests cached within one block of vLLM's count"
    pinned = check.get("pinned_hit_rate")
    if pinned is not None:
        line += f"; on the live run's own replicas: simulated {pinned:.3f}"
        if check.get("pinned_request_agreement") is not None:
            line += f", {check['pinned_request_agreement']:.0%} of requests within one block"
    return line


def rounds_baseline(rounds: Sequence[Mapping]) -> str | None:
    """pow2 where the rounds ran it, else the first policy of the first round: one baseline for every round."""
    if not rounds or not rounds[0]["order"]:
        return None
    return BASELINE_POLICY if any(BASELINE_POLICY in r["order"] for r in rounds) else rounds[0]["order"][0]


def _round_policies(rounds: Sequence[Mapping]) -> list[str]:
    """Every policy the rounds ran, in the order first run."""
    return list(dict.fromkeys(p for r in rounds for p in r["order"]))


def paired_ratios(rounds: Sequence[Mapping], baseline: str | None = None) -> dict[str, dict[str, dict]]:
    """Per policy and figure: median, min and max over the rounds of (figure / the same round's baseline).

    Why paired: both runs of a round ran minutes apart on the same machine, so
    the ratio cancels most of what makes the machine faster or slower from one
    run to the next. A round where the baseline or the policy failed, lacks the
    figure, or covers other requests than the other (a request failed, or a
    session stopped early: `coverage_notes`) is left out of that figure
    (`num_rounds` says how many count).

    Args:
        rounds: `{"order": [...], "runs": {policy: {"summary": ...} | {"error": ...}}}` per round.
        baseline: the policy every ratio divides by (default `rounds_baseline`).

    Returns:
        policy -> summary key -> {"median", "min", "max", "num_rounds"}; figures no round has are absent.
    """
    baseline = baseline or rounds_baseline(rounds)
    if baseline is None:
        return {}
    out: dict[str, dict[str, dict]] = {}
    for policy in _round_policies(rounds):
        by_key: dict[str, dict] = {}
        for key, _, _ in METRICS:
            ratios = []
            for round_ in rounds:
                base = (round_["runs"].get(baseline) or {}).get("summary") or {}
                mine = (round_["runs"].get(policy) or {}).get("summary") or {}
                if mine.get(key) is not None and base.get(key) and _cover_the_same_requests(mine, base):
                    ratios.append(mine[key] / base[key])
            if ratios:
                by_key[key] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                               "num_rounds": len(ratios)}
        out[policy] = by_key
    return out


def _cover_the_same_requests(summary: Mapping, other: Mapping) -> bool:
    """Whether two runs' figures describe the same requests: neither lost one, and they completed as many."""
    return (not summary.get("num_errors") and not other.get("num_errors")
            and summary.get("num_requests") == other.get("num_requests"))


def rounds_section(result: Mapping) -> str:
    """The report's block of paired ratios over the rounds (a leading newline), or "" for a one-round run."""
    rounds = result.get("rounds") or []
    if len(rounds) < 2:
        return ""
    baseline = rounds_baseline(rounds)
    ratios = paired_ratios(rounds)
    rows = [["policy"] + [name for _, name, _ in METRICS]]
    for policy, by_key in ratios.items():
        cells = []
        for key, _, _ in METRICS:
            figure = by_key.get(key)
            cells.append("-" if figure is None else
                         f"{figure['median']:.2f} [{figure['min']:.2f}-{figure['max']:.2f}]"
                         + ("" if figure["num_rounds"] == len(rounds) else f" n={figure['num_rounds']}"))
        rows.append([policy] + cells)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"\nratio to {baseline} within each of {len(rounds)} rounds: median [min-max]"
             " (n=: rounds that count, where some failed or covered fewer requests)"]
    for i, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * width for width in widths))
    lines += _warmpath_against_each(rounds, baseline)
    lines += [f"round {number}: {', '.join(r['order'])}" for number, r in enumerate(rounds, start=1)]
    return "\n".join(lines)


def warmpath_ttft_over_each(rounds: Sequence[Mapping]) -> dict[str, dict]:
    """warmpath's TTFT p50 over every other policy's within each round (`paired_ratios`' figure with that
    policy as the baseline): the issue's targets name two baselines. Empty without warmpath."""
    policies = _round_policies(rounds)
    if "warmpath" not in policies:
        return {}
    over = {}
    for other in policies:
        if other != "warmpath" and (figure := paired_ratios(rounds, other).get("warmpath", {}).get("ttft_p50_s")):
            over[other] = figure
    return over


def _warmpath_against_each(rounds: Sequence[Mapping], baseline: str | None) -> list[str]:
    """The report's line of `warmpath_ttft_over_each`, the baseline's column left to the table."""
    parts = [f"{other} {figure['median']:.2f} [{figure['min']:.2f}-{figure['max']:.2f}]"
             for other, figure in warmpath_ttft_over_each(rounds).items() if other != baseline]
    return [f"warmpath TTFT p50 within each round over: {', '.join(parts)}"] if parts else []


def live_report(result: Mapping) -> str:
    """The text `warmpath bench` prints: the ratio table (failed policies marked) and the oracle fractions."""
    sizes = " at GPU sizes" if result.get("scale") == "gpu" else ""
    title = (f"workload {result['workload']}{sizes}: {result['num_sessions']} sessions, {result['num_requests']} "
             f"requests, {result['num_replicas']} replicas, time scale {result['time_scale']}")
    if len(result.get("rounds") or []) > 1:
        title += f"; round 1 of {len(result['rounds'])}"
    runs = result["policies"]
    summaries = {p: run.get("summary") for p, run in runs.items()}
    errors = {p: run["error"] for p, run in runs.items() if run.get("error")}
    text = ratio_table(summaries, title, errors, result.get("num_requests")) + oracle_section(result)
    text += rounds_section(result)
    checks = result.get("simulator_check") or {}
    if checks:
        text += "\nsimulator replay of each trace (CPU cost model):\n  " + "\n  ".join(
            _check_line(policy, c) for policy, c in checks.items()
        )
    if result.get("interrupted"):
        text += "\n(interrupted: the policies not shown did not run)"
    return text


def simulation_report(runs: Sequence[Mapping]) -> str:
    """One ratio table per (workload, replica count) of a simulation grid; failed cells are marked."""
    groups: dict[tuple[str, int], dict[str, Mapping]] = {}
    for run in runs:
        groups.setdefault((run["workload"], run["num_replicas"]), {})[run["policy"]] = run
    tables = []
    for (workload, num_replicas), by_policy in groups.items():
        finished = [r for r in by_policy.values() if not r.get("error")]
        title = f"simulated {workload} on {num_replicas} replicas"
        if finished:
            title += f": {finished[0]['num_sessions']} sessions, {finished[0]['num_requests']} requests"
        bounds = {p: r["bounds"] for p, r in by_policy.items() if r.get("bounds")}
        errors = {p: r["error"] for p, r in by_policy.items() if r.get("error")}
        summaries = {p: None if r.get("error") else r["summary"] for p, r in by_policy.items()}
        tables.append(ratio_table(summaries, title, errors) + oracle_section({"policies": by_policy, "oracle": bounds}))
    return "\n\n".join(tables)


def finite_or_none(value):
    """`value` with every NaN or infinite float replaced by None (JSON null), in nested dicts and lists.

    Why: `json.dumps` writes them as `NaN`/`Infinity`, which no strict JSON
    reader accepts; a figure that has no finite value is missing.
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {key: finite_or_none(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(item) for item in value]
    return value


def write_json(path: Path, document: Mapping) -> None:
    """Writes `document` as strict JSON (non-finite figures become null, never `NaN`), replacing a file whole."""
    text = json.dumps(finite_or_none(document), indent=1, allow_nan=False) + "\n"
    replace_file(path, lambda target: target.write_text(text))


def plot_live(result: Mapping, path: Path) -> None:
    """PNG: TTFT distribution (CDF) per policy, and hit rate per policy with the oracle bounds.

    Raises:
        ImportError: matplotlib is missing (`pip install -e '.[bench]'`).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ttft, ax_hit) = plt.subplots(1, 2, figsize=(12, 4.5))
    policies = [p for p, run in result["policies"].items() if not run.get("error")]  # failed ones have no records
    for policy in policies:
        ttfts = sorted(r["ttft_s"] for r in result["policies"][policy]["records"]
                       if r.get("error") is None and r.get("ttft_s") is not None)
        if ttfts:
            ax_ttft.step(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], where="post", label=policy)
    ax_ttft.set_xscale("log")
    ax_ttft.set_xlabel("TTFT (s, log scale)")
    ax_ttft.set_ylabel("fraction of requests")
    ax_ttft.set_title("TTFT distribution")
    if policies:
        ax_ttft.legend()
    hits = [result["policies"][p]["summary"].get("hit_rate") or 0.0 for p in policies]
    ax_hit.bar(range(len(policies)), hits, color="tab:blue", tick_label=policies)
    # Each policy's bounds are those of its own trace: drawn across its own bar only.
    labelled = set()
    for x, policy in enumerate(policies):
        bounds = result.get("oracle", {}).get(policy) or {}
        for key, style, name in (("infinite_hit_rate", "--", "infinite cache"), ("placed_hit_rate", ":", "best placement computed")):
            if bounds.get(key) is not None:
                label = None if key in labelled else f"oracle of its trace: {name}"
                ax_hit.hlines(bounds[key], x - 0.4, x + 0.4, linestyles=style, color="black", label=label)
                labelled.add(key)
    if labelled:  # under the bars, which reach up to the bounds
        ax_hit.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, fontsize="small")
    ax_hit.set_ylim(0, 1)
    ax_hit.set_ylabel("prefix hit rate (vLLM cached / prompt tokens)")
    ax_hit.set_title("hit rate per policy")
    fig.suptitle(f"warmpath bench: {result['workload']}, {result['num_replicas']} replicas")
    fig.tight_layout()
    try:
        replace_file(path, lambda target: fig.savefig(target, dpi=110, format="png"))
    finally:
        plt.close(fig)
