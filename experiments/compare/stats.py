"""Statistics over seeds (scipy.stats): each cell's mean with its 95% t-interval, and each cell against its reference
over the seeds both ran (the mean difference, its t-interval and the paired t-test's p-value).

Zero variance: when every value (or every paired difference) is the same, the interval has zero width (scipy's
too), and a paired comparison has no p-value (None, printed "-"): scipy's ``ttest_rel`` gives t = ±inf and
p = 0 for a constant nonzero difference and NaN for a zero one, and differences equal but for rounding give any p
at all; none of these is evidence about the seeds.
"""

from __future__ import annotations

import json
import math
from typing import Any

CONFIDENCE = 0.95


def _constant(values: list[float]) -> bool:
    """No spread beyond rounding: the t statistic is undefined."""
    return max(values) - min(values) <= 1e-12 * max(1.0, abs(sum(values) / len(values)))


def interval(values: list[float], confidence: float = CONFIDENCE) -> dict[str, float | int | None]:
    """Mean, n, and the t-interval over ``values`` (scipy.stats.ttest_1samp: sample standard deviation, n - 1
    degrees of freedom) with its half-width; one value has no interval (None)."""
    from scipy import stats

    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return {"mean": mean, "n": n, "half": None, "low": None, "high": None}
    if _constant(values):  # scipy gives (mean, mean) too, after a warning about the lost precision
        low, high = mean, mean
    else:
        low, high = (float(x) for x in stats.ttest_1samp(values, 0.0).confidence_interval(confidence))
    return {"mean": mean, "n": n, "half": (high - low) / 2, "low": low, "high": high}


def paired(a: list[float], b: list[float], confidence: float = CONFIDENCE) -> dict[str, float | int | None]:
    """a - b over the same seeds (a[i] and b[i] share a seed): the mean difference with its t-interval, and the
    p-value of the paired t-test (scipy.stats.ttest_rel); None where the differences have no spread."""
    from scipy import stats

    diffs = [x - y for x, y in zip(a, b)]
    out = interval(diffs, confidence)
    out["p"] = float(stats.ttest_rel(a, b).pvalue) if len(diffs) > 1 and not _constant(diffs) else None
    return out


def pairs(
    cells: list[dict[str, Any]], baseline: str | None = None
) -> list[tuple[dict[str, Any], dict[str, Any], str, list[str]]]:
    """(cell, reference cell, the key they differ in, the keys that vary in their group): each cell against the cell
    equal to it but for one key at its reference value (the first grid value; outside a sweep, the first cell's; or
    ``baseline`` KEY=VALUE)."""
    base_key, _, base_value = (baseline or "").partition("=")
    out = []
    for group in dict.fromkeys(c["group"] for c in cells):
        members = [c for c in cells if c["group"] == group]
        keys = [k for k in members[0]["settings"] if len({c["settings"].get(k) for c in members}) > 1]
        varying = keys
        reference = {k: members[0]["reference"].get(k, members[0]["settings"][k]) for k in keys}
        if baseline:
            keys = [k for k in keys if k == base_key or k.endswith("." + base_key)]
            reference = {k: base_value for k in keys}
        by_settings = {json.dumps(c["settings"], sort_keys=True): c for c in members}
        for key in keys:  # one key at a time: every cell that changes it, in the grid's order
            for cell in members:
                if cell["settings"].get(key) == reference[key]:
                    continue
                ref = by_settings.get(json.dumps({**cell["settings"], key: reference[key]}, sort_keys=True))
                if ref is not None:
                    out.append((cell, ref, key, varying))
    return out


def comparison(cell: dict[str, Any], ref: dict[str, Any], key: str, varying: list[str]) -> str:
    """ "text, dot vs scaled_dot (positions=learned)": the group, the two values, the other settings that vary."""
    context = ", ".join(f"{k.rpartition('.')[2]}={cell['settings'][k]}" for k in varying if k != key)
    return f"{cell['group']}, {cell['settings'][key]} vs {ref['settings'][key]}" + (f" ({context})" if context else "")


def lr_sensitivity(points: list[tuple[float | None, float]]) -> float:
    """Learning-rate sensitivity of one seed's runs (Wortsman et al. 2023, §2.2): E_η[min(ℓ(η), ℓ0) - ℓ*], the mean
    over the rates (the sweep's grid, evenly spaced in log) of the final loss capped at the initial loss ℓ0, minus
    the best final loss ℓ*. ``points``: (final loss, initial loss) per rate; a diverged run (None, NaN, inf) counts
    as ℓ0. 0: the same loss at every rate."""
    capped = [
        initial if final is None or not math.isfinite(final) else min(final, initial) for final, initial in points
    ]
    return sum(capped) / len(capped) - min(capped)
