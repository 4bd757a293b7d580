"""A metric against a swept number, over seeds: learning rate, evaluation length, image size; or against the
training step (`logged_points`).

The number comes from a sweep's grid key whose values are all numbers (``model.init_args.lr``: each cell is a
point), or from metrics named with an ``@`` suffix (``val/loss@2x``, ``val/acc@42px``: each run logs every
point). A series is one line of the plot: {"label", "points": {x: {seed: value}}}; the value of a run is the last
one it logged.
"""

from __future__ import annotations

import math
import re
from typing import Any

from experiments.compare.runs import one_per_seed, train_loss, varying_keys
from experiments.compare.stats import baseline_value, interval, lr_sensitivity

SUFFIXED = re.compile(r"^(?P<base>.+)@(?P<x>\d+(?:\.\d+)?)(?P<unit>[a-z]*)$")  # val/acc@42px -> val/acc, 42, px


def _number(text: str) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def final_value(run: dict[str, Any], key: str) -> float | None:
    """The last value of ``key`` in the run's metrics.csv (None when never logged)."""
    series = run["metrics"].get(key)
    return series[-1][1] if series else None


def swept_keys(cells: list[dict[str, Any]]) -> list[str]:
    """The settings whose values are numbers, at least three of them, within one group of cells: a sweep's grid
    keys (``model.init_args.lr``, ``model.init_args.attention.normalization.init_args.k``), or outside a sweep the
    settings that vary between runs."""
    keys = []
    for group in dict.fromkeys(c["group"] for c in cells):
        members = [c for c in cells if c["group"] == group]
        for key in dict.fromkeys([*members[0]["reference"], *varying_keys(members)]):
            values = [_number(c["settings"].get(key)) for c in members if key in c["settings"]]
            if len(set(values)) >= 3 and None not in values and key not in keys:
                keys.append(key)
    return keys


def swept_series(cells: list[dict[str, Any]], key: str, metric: str) -> list[dict[str, Any]]:
    """One series per group and setting of the other keys that vary (as the cells' names give them): x = the cell's
    value of ``key``."""
    lines: dict[str, dict[str, Any]] = {}
    for cell in cells:
        x = _number(cell["settings"].get(key))
        if x is None:
            continue
        rest = ", ".join(",".join(names) for k, names in cell["names"].items() if k != key)
        label = f"{cell['group']}" + (f": {rest}" if rest else "")
        line = lines.setdefault(label, {"label": label, "points": {}, "runs": {}})
        line["points"][x] = {r["seed"]: final_value(r, metric) for r in one_per_seed(cell)}
        line["runs"][x] = {r["seed"]: r for r in one_per_seed(cell)}
    return list(lines.values())


def reference_point(cells: list[dict[str, Any]], key: str, baseline: str | None = None) -> float | None:
    """The value of ``key`` the other points of its axis are paired with: ``baseline`` KEY=VALUE when it names this
    key, else the first grid value (outside a sweep, the first cell's)."""
    chosen = baseline_value(cells, key, baseline) if baseline else None
    return _number(chosen or cells[0]["reference"].get(key, cells[0]["settings"].get(key)))


def logged_points(cell: dict[str, Any], key: str) -> dict[float, dict[Any, float]]:
    """{step: {seed: value}}: ``key`` at every step where the cell's seeds logged it in their metrics.csv."""
    points: dict[float, dict[Any, float]] = {}
    for run in one_per_seed(cell):
        for step, value in run["metrics"].get(key, []):
            points.setdefault(step, {})[run["seed"]] = value
    return points


def suffixed_metrics(cells: list[dict[str, Any]]) -> dict[str, list[str]]:
    """ "val/loss@x" -> ["val/loss@1x", "val/loss@2x", ..]: the metrics logged at several points, by base and unit."""
    found: dict[str, set[str]] = {}
    for key in {k for cell in cells for run in cell["runs"] for k in run["metrics"]}:
        if match := SUFFIXED.match(key):
            found.setdefault(f"{match['base']}@{match['unit'] or '-'}", set()).add(key)
    return {base: sorted(keys, key=lambda k: float(SUFFIXED.match(k)["x"])) for base, keys in found.items()}


def suffixed_series(cells: list[dict[str, Any]], keys: list[str]) -> list[dict[str, Any]]:
    """One series per cell: x = the number after ``@`` of each of ``keys``."""
    series = []
    for cell in cells:
        runs = one_per_seed(cell)
        points = {
            float(SUFFIXED.match(k)["x"]): {r["seed"]: final_value(r, k) for r in runs if k in r["metrics"]}
            for k in keys
        }
        points = {x: seeds for x, seeds in points.items() if seeds}
        if points:
            series.append({"label": cell["label"], "points": points})
    return series


def band(points: dict[float, dict[Any, float | None]]) -> list[tuple[float, dict[str, Any]]]:
    """(x, the mean and 95% t-interval over the seeds' finite values) for every x with one, in order of x."""
    out = []
    for x in sorted(points):
        values = [v for v in points[x].values() if v is not None and math.isfinite(v)]
        if values:
            out.append((x, interval(values)))
    return out


def sensitivities(series: list[dict[str, Any]], metric: str) -> dict[str, dict[Any, float]]:
    """Per series of a learning-rate sweep: {seed: `lr_sensitivity` of ``metric``} over the seeds that ran every
    learning rate (series with no such seed are left out)."""
    out = {}
    for line in series:
        rates = sorted(line["runs"])
        seeds = set.intersection(*(set(line["runs"][x]) for x in rates))
        per_seed = {}
        for seed in sorted(seeds, key=str):
            runs = [line["runs"][x][seed] for x in rates]
            first = [train_loss(r["metrics"])[:1] for r in runs]  # [(step, ℓ0)]: the loss near initialisation
            if all(first):
                per_seed[seed] = lr_sensitivity([(final_value(r, metric), f[0][1]) for r, f in zip(runs, first)])
        if per_seed:
            out[line["label"]] = per_seed
    return out
