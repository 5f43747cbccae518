"""Pictures of the event log (matplotlib, Agg): stage latency bars, TTFT histogram, waterfalls.

Every function writes one PNG and returns its path; with no data it still writes a figure that
says so, so a report always has all of its pictures.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

STAGE_COLORS = {
    "gateway": "#4e79a7",
    "auth": "#f28e2b",
    "context": "#e15759",
    "tokenize": "#76b7b2",
    "engine": "#59a14f",
    "detokenize": "#edc948",
    "ledger": "#b07aa1",
}


@dataclass(frozen=True, kw_only=True)
class Hop:
    """One stage hop of a request, in ms from the request's arrival."""

    stage: str
    in_ms: float  # its input published
    start_ms: float  # the stage started on it
    end_ms: float  # its output published


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _no_data(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in the log", ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def stage_latency_bars(rows: list[dict], path: Path) -> Path:
    """rows: stage, queue_p50_ms, queue_p95_ms, service_p50_ms, service_p95_ms (pipeline order)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 0.6 * max(len(rows), 3) + 1.5))
    if not rows:
        _no_data(ax, "stage hops")
    else:
        names = [r["stage"] for r in rows]
        y = range(len(rows))
        width = 0.2
        series = [
            ("queue P50", "queue_p50_ms", "#9ecae1"),
            ("queue P95", "queue_p95_ms", "#3182bd"),
            ("service P50", "service_p50_ms", "#a1d99b"),
            ("service P95", "service_p95_ms", "#31a354"),
        ]
        for i, (label, key, color) in enumerate(series):
            values = [max(r[key] or 0.0, 1e-3) for r in rows]
            ax.barh([v + (i - 1.5) * width for v in y], values, width, label=label, color=color)
        ax.set_yticks(list(y), names)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("milliseconds (log scale)")
        ax.legend(loc="lower right", fontsize=8)
    ax.set_title("Per-stage latency: queue wait vs service time")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def ttft_histogram(ttfts_ms: list[float], sla_ms: float, path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if not ttfts_ms:
        _no_data(ax, "first tokens")
    else:
        import numpy as np

        values = np.asarray(ttfts_ms)  # [num_requests]
        ax.hist(values, bins=min(40, max(5, len(values) // 3)), color="#4e79a7")
        p50, p95 = np.percentile(values, [50, 95])
        for x, label, style in ((p50, "P50", "--"), (p95, "P95", "-"), (sla_ms, "SLA", ":")):
            ax.axvline(x, color="black" if label != "SLA" else "red", linestyle=style)
            ax.annotate(f"{label} {x:.0f} ms", (x, ax.get_ylim()[1] * 0.9), rotation=90, fontsize=8)
        ax.set_xlabel("time to first token (ms)")
        ax.set_ylabel("requests")
    ax.set_title("TTFT distribution")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def waterfall(
    requests: list[tuple[str, list[Hop]]],
    path: Path,
    title: str,
    first_token_ms: dict[str, float] | None = None,
) -> Path:
    """One row per request (top: first given): each hop drawn as a pale queue segment (input
    published -> stage start) and a solid service segment (start -> output published); a black
    tick marks the request's first token (TTFT) when known."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 0.5 * max(len(requests), 3) + 1.8))
    if not requests:
        _no_data(ax, "requests")
    else:
        for row, (name, hops) in enumerate(requests):
            ttft = (first_token_ms or {}).get(name)
            if ttft is not None:
                ax.plot([ttft, ttft], [row - 0.4, row + 0.4], color="black", linewidth=2, zorder=3)
            for hop in hops:
                color = STAGE_COLORS.get(hop.stage, "#999999")
                queue = max(hop.start_ms - hop.in_ms, 0.0)
                ax.barh(row, queue, left=hop.in_ms, color=color, alpha=0.3, height=0.6)
                ax.barh(
                    row,
                    max(hop.end_ms - hop.start_ms, 0.0),
                    left=hop.start_ms,
                    color=color,
                    height=0.6,
                )
        ax.set_yticks(range(len(requests)), [rid[-16:] for rid, _ in requests], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("ms since arrival (pale: queue wait, solid: service, tick: first token)")
        seen = {h.stage for _, hops in requests for h in hops}
        handles = [
            plt.Rectangle((0, 0), 1, 1, color=c) for s, c in STAGE_COLORS.items() if s in seen
        ]
        ax.legend(handles, [s for s in STAGE_COLORS if s in seen], fontsize=8, loc="best")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
