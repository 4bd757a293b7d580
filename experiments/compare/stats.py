"""Statistics over seeds (scipy.stats): each cell's mean with its 95% t-interval, and each cell against its reference
over the seeds both ran (the mean difference, its t-interval and the paired t-test's p-value).

Zero variance: when every value (or every paired difference) is the same, the interval has zero width (scipy's
too), and a paired comparison has no p-value (None, printed "-"): scipy's ``ttest_rel`` gives t = ±inf and
p = 0 for a constant nonzero difference and NaN for a zero one, and differences equal but for rounding give any p
at all; none of these is evidence about the seeds.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from typing import Any

from experiments.compare.runs import varying_keys
from experiments.runfolder import cli_value, setting_leaves, setting_text

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


class BaselineError(ValueError):
    """A ``--baseline`` that names no setting, or no value, of the runs compared."""


def pairs(
    cells: list[dict[str, Any]], baseline: str | None = None
) -> list[tuple[dict[str, Any], dict[str, Any], str, list[str]]]:
    """(cell, reference cell, the key they differ in, the keys that vary in their group): each cell against the cell
    equal to it but for one key at its reference value (the first grid value; outside a sweep, the first cell's; or
    the value that ``baseline`` KEY=VALUE names: `baseline_value`)."""
    out = []
    for group in dict.fromkeys(c["group"] for c in cells):
        members = [c for c in cells if c["group"] == group]
        varying = varying_keys(members)
        reference = {k: members[0]["reference"].get(k, members[0]["settings"][k]) for k in varying}
        if baseline:
            reference = {k: baseline_value(members, k, baseline) for k in varying}
            reference = {k: v for k, v in reference.items() if v is not None}
        by_settings = {json.dumps(c["settings"], sort_keys=True): c for c in members}
        for key in reference:  # one key at a time: every cell that changes it, in the grid's order
            for cell in members:
                if cell["settings"].get(key) == reference[key]:
                    continue
                ref = by_settings.get(json.dumps({**cell["settings"], key: reference[key]}, sort_keys=True))
                if ref is not None:
                    out.append((cell, ref, key, varying))
    return out


def _names_key(leaf: str, key: str) -> bool:
    """Whether ``key`` (similarity, normalization.k, model.init_args.lr) names the fit key ``leaf``."""
    bare = ".".join(p for p in leaf.split(".") if p != "init_args")
    return any(x == key or x.endswith("." + key) for x in (leaf, bare))


def _same(value: Any, text: str) -> bool:
    if text in (setting_text(value), cli_value(value)):
        return True
    try:
        return float(cli_value(value)) == float(text)
    except ValueError:
        return False


def _leaves(cell: dict[str, Any], key: str) -> dict[str, Any]:
    return setting_leaves(key, cell["values"].get(key))


def baseline_value(members: list[dict[str, Any]], key: str, baseline: str) -> str | None:
    """The value of setting ``key`` that ``baseline`` KEY=VALUE names in a group: KEY names the setting or one of
    its leaves (normalization inside {attention: {normalization: softmax}}); of several values that hold it, the one
    that sets fewest leaves (softmax rather than softmax with a gate). None when no cell has it."""
    base_key, _, base_value = baseline.partition("=")
    held = [
        c
        for c in members
        if any(_names_key(leaf, base_key) and _same(v, base_value) for leaf, v in _leaves(c, key).items())
    ]
    return min(held, key=lambda c: len(_leaves(c, key)))["settings"][key] if held else None


def check_baseline(cells: list[dict[str, Any]], baseline: str) -> None:
    """BaselineError, one line, unless some cell's setting that varies holds ``baseline`` KEY=VALUE."""
    base_key, _, base_value = baseline.partition("=")
    named: dict[str, None] = {}  # the short names of the leaves that vary, as cell names show them
    held = []  # the values of the leaves KEY names
    for group in dict.fromkeys(c["group"] for c in cells):
        members = [c for c in cells if c["group"] == group]
        for key in varying_keys(members):
            for cell in members:
                for name, (leaf, value) in zip(cell["names"][key], _leaves(cell, key).items()):
                    named[name.partition("=")[0]] = None
                    if _names_key(leaf, base_key):
                        held.append(value)
    if any(_same(v, base_value) for v in held):
        return
    if held:
        known = ", ".join(dict.fromkeys(setting_text(v) for v in held))
        raise BaselineError(f"--baseline {baseline}: no run has {base_key}={base_value}; known values: {known}")
    known = ", ".join(named) or "none"
    first = cells[0]
    same = [
        setting_text(v) for k in first["values"] for leaf, v in _leaves(first, k).items() if _names_key(leaf, base_key)
    ]
    if same:
        raise BaselineError(f"--baseline {baseline}: every run has {base_key}={same[0]}; the keys that vary: {known}")
    close = difflib.get_close_matches(base_key, list(named), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise BaselineError(f"--baseline {baseline}: no run has key {base_key!r}; known keys: {known}{hint}")


def comparison(cell: dict[str, Any], ref: dict[str, Any], key: str, varying: list[str]) -> str:
    """ "text, dot vs scaled_dot (positions=learned)": the group, the two values (a word as it is; a number or a
    mapping by its name: k=4 vs k=2, normalization=softmax1 vs normalization=softmax), the other settings that vary."""
    context = ", ".join(",".join(cell["names"][k]) for k in varying if k != key)
    worded = all(re.fullmatch(r"[A-Za-z_][\w.-]*", c["settings"][key]) for c in (cell, ref))
    a, b = (c["settings"][key] if worded else ",".join(c["names"][key]) for c in (cell, ref))
    return f"{cell['group']}, {a} vs {b}" + (f" ({context})" if context else "")


def lr_sensitivity(points: list[tuple[float | None, float]]) -> float:
    """Learning-rate sensitivity of one seed's runs (Wortsman et al. 2023, §2.2): E_η[min(ℓ(η), ℓ0) - ℓ*], the mean
    over the rates (the sweep's grid, evenly spaced in log) of the final loss capped at the initial loss ℓ0, minus
    the best final loss ℓ*. ``points``: (final loss, initial loss) per rate; a diverged run (None, NaN, inf) counts
    as ℓ0. 0: the same loss at every rate."""
    capped = [
        initial if final is None or not math.isfinite(final) else min(final, initial) for final, initial in points
    ]
    return sum(capped) / len(capped) - min(capped)
