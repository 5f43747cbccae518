"""The service-level targets of the seed material, and pass/fail against measured figures.

A line with no data (e.g. KV usage when the engine publishes no gauges) is neither passed nor
failed: it says "no data", and the SLA as a whole does not hold without it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Sla:
    ttft_p95_ms: float = 300.0  # TTFT P95 < 300 ms
    tps_p50: float = 40.0  # per-request decode speed P50 > 40 tok/s
    error_rate: float = 0.001  # failed / finished < 0.1 %
    kv_usage: float = 0.90  # KV cache blocks in use < 90 % (peak)
    queue_depth: int = 25  # requests waiting for their first token < 25 (peak)

    def __post_init__(self) -> None:
        if min(self.ttft_p95_ms, self.tps_p50, self.queue_depth) <= 0:
            raise ValueError(f"SLA targets must be positive: {self}")
        if not (0 < self.error_rate < 1 and 0 < self.kv_usage <= 1):
            raise ValueError(f"error_rate and kv_usage are fractions in (0, 1]: {self}")

    def request_meets(self, *, ok: bool, ttft_ms: float | None, tps: float | None) -> bool:
        """One request's share of the SLA (for goodput): it completed, its first token came
        within the TTFT target and it streamed at least at the TPS target. A one-token answer
        has no decode speed and is judged on TTFT alone."""
        if not ok or ttft_ms is None or ttft_ms >= self.ttft_p95_ms:
            return False
        return tps is None or tps > self.tps_p50


@dataclass(frozen=True, kw_only=True)
class SlaLine:
    name: str
    target: str
    measured: float | None
    unit: str
    passed: bool | None  # None: no data

    @property
    def verdict(self) -> str:
        return {True: "PASS", False: "FAIL", None: "no data"}[self.passed]

    def measured_text(self) -> str:
        if self.measured is None:
            return "—"
        if self.unit == "%":
            return f"{100 * self.measured:.2f}".rstrip("0").rstrip(".") + " %"
        if not self.unit:
            return f"{self.measured:g}"
        digits = 0 if abs(self.measured) >= 1000 else 1 if abs(self.measured) >= 10 else 2
        return f"{self.measured:.{digits}f} {self.unit}".strip()


def check(
    sla: Sla,
    *,
    ttft_p95_ms: float | None,
    tps_p50: float | None,
    error_rate: float | None,
    kv_usage_max: float | None,
    queue_depth_max: float | None,
) -> list[SlaLine]:
    def line(name: str, target: str, value: float | None, unit: str, ok) -> SlaLine:
        return SlaLine(
            name=name,
            target=target,
            measured=value,
            unit=unit,
            passed=None if value is None else bool(ok(value)),
        )

    return [
        line("TTFT P95", f"< {sla.ttft_p95_ms:g} ms", ttft_p95_ms, "ms", lambda v: v < sla.ttft_p95_ms),
        line("TPS P50", f"> {sla.tps_p50:g} tok/s", tps_p50, "tok/s", lambda v: v > sla.tps_p50),
        line("Error rate", f"< {100 * sla.error_rate:g} %", error_rate, "%", lambda v: v < sla.error_rate),
        line("KV memory", f"< {100 * sla.kv_usage:g} %", kv_usage_max, "%", lambda v: v < sla.kv_usage),
        line("Queue depth", f"< {sla.queue_depth}", queue_depth_max, "", lambda v: v < sla.queue_depth),
    ]  # fmt: skip


def holds(lines: list[SlaLine], *, allow_missing: bool = False) -> bool:
    """Every line passed (lines without data count as failed unless `allow_missing`)."""
    return all(line.passed is True or (allow_missing and line.passed is None) for line in lines)
