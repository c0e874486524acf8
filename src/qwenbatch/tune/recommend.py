"""The pick of a sweep, by stated rules.

1. Memory: a setting must keep its peak under the memory limit less a margin (10%).
2. Latency: when an SLO is given, its p95 request latency must be within it.
3. Knee: of the settings left, per token budget, the smallest ``max_num_seqs`` to which the budget's
   fastest setting adds at most 10% output throughput; the knee of the budget with the highest
   throughput wins. If only the largest setting swept qualifies, throughput never flattened: the
   fastest. (Measured against the fastest, not the next setting: a plateau of two settings within
   the host's noise, then a rise, stopped the next-setting rule short. On the AVX2 kind it picked 2
   sequences at 30.6 output tok/s where 8 ran 38.9.)

The report names the rule that decided: ``knee`` or ``max-throughput`` when the constraints did not
bind, ``memory-limit`` or ``latency-slo`` when the unconstrained pick broke one and a smaller
setting won instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from qwenbatch.tune.measure import Measurement

DEFAULT_MEMORY_MARGIN = 0.10
DEFAULT_KNEE_GAIN = 0.10


@dataclass
class Rules:
    memory_limit_mib: float | None = None
    memory_margin: float = DEFAULT_MEMORY_MARGIN
    latency_slo_s: float | None = None
    knee_gain: float = DEFAULT_KNEE_GAIN  # "the fastest setting adds at most this share of throughput"


@dataclass
class Recommendation:
    pick: Measurement
    decided_by: str  # "knee", "max-throughput", "memory-limit" or "latency-slo"
    reason: str
    runner_up: Measurement | None  # the fastest other setting that meets the constraints

    def to_dict(self) -> dict:
        return {
            "max_num_seqs": self.pick.max_num_seqs,
            "max_num_batched_tokens": self.pick.max_num_batched_tokens,
            "decided_by": self.decided_by,
            "reason": self.reason,
            "pick": self.pick.to_dict(),
            "runner_up": self.runner_up.to_dict() if self.runner_up else None,
        }


class NoSettingFits(ValueError):
    """Every measured setting failed or broke a constraint."""


def fits_memory(m: Measurement, rules: Rules) -> bool:
    if rules.memory_limit_mib is None or m.peak_memory_mib is None:
        return True
    return m.peak_memory_mib <= rules.memory_limit_mib * (1 - rules.memory_margin)


def meets_slo(m: Measurement, rules: Rules) -> bool:
    return rules.latency_slo_s is None or m.latency_p95_s <= rules.latency_slo_s


def knee(candidates: list[Measurement], gain: float) -> tuple[Measurement, bool]:
    """(the knee setting, whether throughput flattened at all) among ``candidates``."""
    budgets = sorted({m.max_num_batched_tokens or 0 for m in candidates})
    knees = []
    for budget in budgets:
        curve = sorted(
            (m for m in candidates if (m.max_num_batched_tokens or 0) == budget), key=lambda m: m.max_num_seqs
        )
        fastest = max(m.output_tps for m in curve)
        pick = next(m for m in curve if fastest <= m.output_tps * (1 + gain))
        knees.append((pick, pick is not curve[-1]))
    return max(knees, key=lambda k: k[0].output_tps)


def recommend(measurements: list[Measurement], rules: Rules) -> Recommendation:
    """Apply the rules to our engine's successful measurements; NoSettingFits when none qualifies."""
    ok = [m for m in measurements if m.ok and m.system == "qwenbatch"]
    if not ok:
        raise NoSettingFits("no setting ran successfully")
    allowed = [m for m in ok if fits_memory(m, rules) and meets_slo(m, rules)]
    if not allowed:
        raise NoSettingFits(_why_none(ok, rules))
    free_pick, flattened = knee(ok, rules.knee_gain)
    # The constraints decide only when the free pick breaks one: the knee among the allowed settings alone can lie
    # below it (the fastest allowed setting is slower), though the free pick itself is allowed.
    allowed_free = fits_memory(free_pick, rules) and meets_slo(free_pick, rules)
    pick = free_pick if allowed_free else knee(allowed, rules.knee_gain)[0]
    if pick is free_pick:
        decided_by = "knee" if flattened else "max-throughput"
        reason = (
            f"the fastest setting adds at most {rules.knee_gain:.0%} output throughput to it"
            if flattened
            else "throughput still rises at the largest setting swept; it is the fastest"
        )
    elif not fits_memory(free_pick, rules):
        decided_by = "memory-limit"
        reason = (
            f"{free_pick.label} would peak at {free_pick.peak_memory_mib:.0f} MiB, over the "
            f"{rules.memory_limit_mib:.0f} MiB limit less a {rules.memory_margin:.0%} margin"
        )
    else:
        decided_by = "latency-slo"
        reason = (
            f"{free_pick.label} has p95 latency {free_pick.latency_p95_s * 1000:.0f} ms, over the "
            f"{rules.latency_slo_s * 1000:.0f} ms SLO"
        )
    others = [m for m in allowed if m is not pick]
    runner_up = max(others, key=lambda m: m.output_tps) if others else None
    return Recommendation(pick, decided_by, reason, runner_up)


def _why_none(ok: list[Measurement], rules: Rules) -> str:
    if not any(fits_memory(m, rules) for m in ok):
        return f"every setting peaks over the {rules.memory_limit_mib:.0f} MiB memory limit less its margin"
    return f"no setting within the memory limit meets the p95 latency SLO of {rules.latency_slo_s * 1000:.0f} ms"
