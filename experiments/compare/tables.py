"""The report's tables: one row per run, the √d section, one row per cell (mean ± half-width of the 95%
t-interval over its seeds) and the paired comparisons; each as (columns, rows) of strings, and as Markdown."""

from __future__ import annotations

import math
from typing import Any

from experiments.compare.runs import STATS, by_seed
from experiments.compare.stats import comparison, interval, paired, pairs
from experiments.runfolder import Summary


def _num(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if abs(value) >= 1e9:
        return f"{value / 1e9:.2f} G"
    if abs(value) >= 1e6:
        return f"{value / 1e6:.2f} M"
    if abs(value) >= 1e4:
        return f"{value / 1e3:.1f} k"
    return f"{value:.{digits}g}"


def _best(summary: Summary) -> str:
    best = summary.best or {}
    return f"{best['monitor']} = {best['value']:.4g}" if best.get("value") is not None else "-"


def run_rows(runs: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    columns = [
        "run",
        "modality",
        "dataset",
        "similarity",
        "positions",
        "params",
        "FLOPs/sample",
        "samples/s",
        "tokens/s",
        "best",
        "entropy (nats)",
        "distance",
        "special share",
        "logit var",
        "max weight",
    ]
    rows = []
    for r in runs:
        s, f = r["summary"], r["final"]
        unit = ((s.attention or {}).get("final") or {}).get("unit", "")
        rows.append(
            [
                r["label"],
                s.modality or "-",
                s.dataset or "-",
                r["similarity"] or "-",
                r["positions"] or "-",
                _num((s.params or {}).get("total")),
                _num(s.flops_per_sample),
                _num((s.throughput or {}).get("samples_per_s")),
                _num((s.throughput or {}).get("tokens_per_s")),
                _best(s),
                _num(f.get("entropy")),
                f"{_num(f.get('distance'))} {unit}" if f.get("distance") is not None else "-",
                _num(f.get("special")),
                _num(f.get("logit_var")),
                _num(f.get("max_weight")),
            ]
        )
    return columns, rows


def scaling_rows(runs: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The √d section: runs of one modality that differ in similarity (all of them, sorted)."""
    columns = [
        "modality",
        "similarity",
        "positions",
        "run",
        "logit var init",
        "logit var end",
        "max weight init",
        "max weight end",
        "saturated init",
        "saturated end",
        "grad norm step 1",
        "grad norm mean",
        "best",
    ]
    by_modality: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by_modality.setdefault(r["summary"].modality or "-", []).append(r)
    rows = []
    order = {"scaled_dot": 0, "dot": 1, "general": 2}
    for modality_, group in sorted(by_modality.items()):
        if len({r["similarity"] for r in group}) < 2:
            continue
        for r in sorted(group, key=lambda r: (order.get(r["similarity"], 9), str(r["positions"]), r["label"])):
            i, f, g = r["init"], r["final"], r["summary"].grad_norm or {}
            rows.append(
                [
                    modality_,
                    r["similarity"] or "-",
                    r["positions"] or "-",
                    r["label"],
                    _num(i.get("logit_var")),
                    _num(f.get("logit_var")),
                    _num(i.get("max_weight")),
                    _num(f.get("max_weight")),
                    _num(i.get("saturated")),
                    _num(f.get("saturated")),
                    _num(g.get("first")),
                    _num(g.get("mean")),
                    _best(r["summary"]),
                ]
            )
    return columns, rows


def plus_minus(stat: dict[str, Any]) -> str:
    return _num(stat["mean"]) + (f" ± {_num(stat['half'])}" if stat["half"] is not None else "")


def cell_rows(cells: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    columns = ["cell", "modality", "n", "seeds", "best", *(label for _, label in STATS)]
    rows = []
    for cell in cells:
        row = [cell["label"], cell["modality"], str(len(cell["runs"])), ",".join(str(r["seed"]) for r in cell["runs"])]
        for key in ("best", *(k for k, _ in STATS)):
            values = list(by_seed(cell, key).values())
            text = plus_minus(interval(values)) if values else "-"
            row.append(f"{cell['monitor']} = {text}" if key == "best" and values and cell.get("monitor") else text)
        rows.append(row)
    return columns, rows


def paired_rows(
    cells: list[dict[str, Any]], baseline: str | None = None
) -> tuple[list[str], list[list[str]], list[str]]:
    """The paired comparisons over common seeds, and one sentence per comparison of the best metric."""
    columns = ["comparison", "metric", "n", "difference", "95% CI", "p (paired t)"]
    rows, conclusions = [], []
    for cell, ref, key, varying in pairs(cells, baseline):
        name = comparison(cell, ref, key, varying)
        for metric, label in (("best", cell.get("monitor") or "best"), *STATS):
            a, b = by_seed(cell, metric), by_seed(ref, metric)
            seeds = [s for s in a if s in b]
            if len(seeds) < 2:
                continue
            d = paired([a[s] for s in seeds], [b[s] for s in seeds])
            ci = f"{d['low']:.3g} to {d['high']:.3g}"
            p = "-" if d["p"] is None or math.isnan(d["p"]) else f"{d['p']:.2g}"
            rows.append([name, label, str(d["n"]), f"{d['mean']:+.3g}", ci, p])
            if metric == "best":
                conclusions.append(f"{name}: {d['mean']:+.3g} {label} (95% CI {ci}, n={d['n']}, paired t-test p={p})")
    return columns, rows, conclusions


def markdown_table(columns: list[str], rows: list[list[str]]) -> str:
    cell = lambda v: str(v).replace("|", "\\|")  # noqa: E731
    return "\n".join(
        ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    )
