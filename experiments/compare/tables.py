"""The report's tables: one row per run, the √d section, one row per cell (mean ± half-width of the 95%
t-interval over its seeds) and the paired comparisons; each as (columns, rows) of strings, and as Markdown."""

from __future__ import annotations

import math
from functools import partial
from typing import Any

from experiments.compare.curves import band
from experiments.compare.runs import STATS, by_seed
from experiments.compare.stats import comparison, interval, paired, pairs
from experiments.runfolder import Summary, cli_value, short_names


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


def _distance(r: dict[str, Any]) -> str:
    unit = ((r["summary"].attention or {}).get("final") or {}).get("unit", "")
    return f"{_num(r['final']['distance'])} {unit}" if r["final"].get("distance") is not None else "-"


# a table's columns: name -> its text for a loaded run (`experiments.compare.runs.load_runs`)
RUN_COLUMNS = {
    "run": lambda r: r["label"],
    "modality": lambda r: r["summary"].modality or "-",
    "dataset": lambda r: r["summary"].dataset or "-",
    "similarity": lambda r: r["similarity"] or "-",
    "positions": lambda r: r["positions"] or "-",
    "params": lambda r: _num((r["summary"].params or {}).get("total")),
    "FLOPs/sample": lambda r: _num(r["summary"].flops_per_sample),
    "samples/s": lambda r: _num((r["summary"].throughput or {}).get("samples_per_s")),
    "tokens/s": lambda r: _num((r["summary"].throughput or {}).get("tokens_per_s")),
    "best": lambda r: _best(r["summary"]),
    **{label: (lambda r, key=key: _num(r["final"].get(key))) for key, label in STATS},
    "distance": _distance,  # with its unit, in the place STATS gives it
    "status": lambda r: r["summary"].state() or "-",  # finished, or running, killed, stale, interrupted, failed
}
SCALING_COLUMNS = {
    "modality": RUN_COLUMNS["modality"],
    "similarity": RUN_COLUMNS["similarity"],
    "positions": RUN_COLUMNS["positions"],
    "run": RUN_COLUMNS["run"],
    "logit var init": lambda r: _num(r["init"].get("logit_var")),
    "logit var end": lambda r: _num(r["final"].get("logit_var")),
    "max weight init": lambda r: _num(r["init"].get("max_weight")),
    "max weight end": lambda r: _num(r["final"].get("max_weight")),
    "saturated init": lambda r: _num(r["init"].get("saturated")),
    "saturated end": lambda r: _num(r["final"].get("saturated")),
    "grad norm step 1": lambda r: _num((r["summary"].grad_norm or {}).get("first")),
    "grad norm mean": lambda r: _num((r["summary"].grad_norm or {}).get("mean")),
    "best": RUN_COLUMNS["best"],
}


def readable(value: Any, names: dict[str, str] | None = None) -> str:
    """A setting as the tables show it: null -> none; {class_path: models.core.attend.ClippedSoftmax, init_args: {alpha:
    4}} -> ClippedSoftmax(alpha=4), a class path by its name in ``names`` (`class_names`); a mapping of fields ->
    (key=value, ...)."""
    names = names or {}
    if value is None:
        return "none"
    if isinstance(value, str):
        return names.get(value, value)
    if not isinstance(value, dict):
        return cli_value(value)
    path = value.get("class_path")
    args = ", ".join(f"{k}={readable(v)}" for k, v in ((value.get("init_args") or {}) if path else value).items())
    return f"{names.get(path, path) if path else ''}({args})" if args or not path else names.get(path, path)


def class_names(values: list[Any]) -> dict[str, str]:
    """The class paths among ``values`` (a dotted string, a mapping's class_path) -> the shortest tail that tells
    them apart: ClippedSoftmax, or my_attention.TopK beside other.TopK."""
    paths = [v.get("class_path") if isinstance(v, dict) else v for v in values]
    return short_names(list(dict.fromkeys(p for p in paths if isinstance(p, str) and "." in p)))


def _field_text(run: dict[str, Any], field: str, names: dict[str, str]) -> str:
    fields = run["attention_fields"]
    return readable(fields[field], names) if field in fields else "-"


def attention_columns(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A column for each field of the attention block (and register_tokens, init_values) whose value differs
    between ``runs``: name -> its text for a run ("-" where the run has no such field)."""
    columns = {}
    for field in dict.fromkeys(k for r in runs for k in r["attention_fields"]):
        names = class_names([r["attention_fields"].get(field) for r in runs])
        text = partial(_field_text, field=field, names=names)
        if len({text(r) for r in runs}) > 1:
            columns[field] = text
    return columns


def run_columns(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """`RUN_COLUMNS` with the attention fields that vary after positions."""
    columns = list(RUN_COLUMNS.items())
    cut = list(RUN_COLUMNS).index("positions") + 1
    extra = [(f, column) for f, column in attention_columns(runs).items() if f not in RUN_COLUMNS]
    return dict(columns[:cut] + extra + columns[cut:])


def run_rows(runs: list[dict[str, Any]], columns: dict[str, Any] | None = None) -> tuple[list[str], list[list[str]]]:
    columns = run_columns(runs) if columns is None else columns
    return list(columns), [[text(r) for text in columns.values()] for r in runs]


def scaling_rows(runs: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The √d section: runs of one modality that differ in similarity (all of them, sorted)."""
    by_modality: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by_modality.setdefault(r["summary"].modality or "-", []).append(r)
    order = {"scaled_dot": 0, "dot": 1, "general": 2}
    shown = [
        r
        for _, group in sorted(by_modality.items())
        if len({r["similarity"] for r in group}) > 1
        for r in sorted(group, key=lambda r: (order.get(r["similarity"], 9), str(r["positions"]), r["label"]))
    ]
    return run_rows(shown, SCALING_COLUMNS)


def plus_minus(stat: dict[str, Any]) -> str:
    return _num(stat["mean"]) + (f" ± {_num(stat['half'])}" if stat["half"] is not None else "")


def series_table(series: list[dict[str, Any]], unit: str = "") -> str:
    """The values behind a plot against a swept number: a row per series, a column per x, mean ± half-width of
    the 95% t-interval over the seeds' finite values (with n when a seed is missing or diverged)."""
    xs = sorted({x for line in series for x in line["points"]})
    rows = []
    for line in series:
        stats = dict(band(line["points"]))
        row = [line["label"]]
        for x in xs:
            stat, seeds = stats.get(x), len(line["points"].get(x, {}))
            row.append("-" if stat is None else plus_minus(stat) + (f" (n={stat['n']})" if stat["n"] < seeds else ""))
        rows.append(row)
    return markdown_table(["series", *(f"{x:g}{unit}" for x in xs)], rows)


SMALL_N = 5  # fewer seeds than this: a cell's t-interval is marked and report.md says why


def axis_pairs(series: list[dict[str, Any]], x_ref: float) -> list[list[str]]:
    """Each point of each series against the same series at ``x_ref``, paired over the seeds with a finite value at
    both: the series, x, n, the mean difference (x - x_ref), its 95% t-interval and the paired t-test's p-value."""
    rows = []
    for line in series:
        ref = {s: v for s, v in line["points"].get(x_ref, {}).items() if v is not None and math.isfinite(v)}
        for x in sorted(line["points"]):
            values = {s: v for s, v in line["points"][x].items() if v is not None and math.isfinite(v)}
            seeds = [s for s in values if s in ref]
            if x != x_ref and len(seeds) > 1:
                d = paired([values[s] for s in seeds], [ref[s] for s in seeds])
                rows.append([line["label"], f"{x:g}", *_paired_cells(d)])
    return rows


def cell_rows(cells: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """One row per cell: the attention fields that vary between cells, n (marked * from 2 to `SMALL_N` - 1), the
    seeds, and the mean ± half-width of the 95% t-interval of the best metric and each statistic."""
    fields = attention_columns([c["runs"][0] for c in cells])
    columns = ["cell", "modality", *fields, "n", "seeds", "best", *(label for _, label in STATS)]
    rows = []
    for cell in cells:
        n = len(cell["runs"])
        row = [cell["label"], cell["modality"], *(text(cell["runs"][0]) for text in fields.values())]
        row += [f"{n}*" if 1 < n < SMALL_N else str(n), ",".join(str(r["seed"]) for r in cell["runs"])]
        for key in ("best", *(k for k, _ in STATS)):
            values = list(by_seed(cell, key).values())
            text = plus_minus(interval(values)) if values else "-"
            row.append(f"{cell['monitor']} = {text}" if key == "best" and values and cell.get("monitor") else text)
        rows.append(row)
    return columns, rows


def small_n_note(cells: list[dict[str, Any]]) -> str | None:
    """The footnote to the cells' table when a cell has 2 to `SMALL_N` - 1 seeds: how much wider its interval is
    (Student's t quantile, scipy.stats.t) than with `SMALL_N`."""
    from scipy import stats

    small = sorted({len(c["runs"]) for c in cells if 1 < len(c["runs"]) < SMALL_N})
    if not small:
        return None
    t = {n: f"{stats.t.ppf(0.975, n - 1):.3g} at n={n}" for n in (*small, SMALL_N)}
    return (
        f"* n={', '.join(map(str, small))}: the t-interval is wide (its half-width is t × the standard error, "
        f"t = {', '.join(t[n] for n in small)} against {t[SMALL_N]}); {SMALL_N} or more seeds give a usable interval."
    )


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
            n, difference, ci, p = _paired_cells(paired([a[s] for s in seeds], [b[s] for s in seeds]))
            rows.append([name, label, n, difference, ci, p])
            if metric == "best":
                conclusions.append(f"{name}: {difference} {label} (95% CI {ci}, n={n}, paired t-test p={p})")
    return columns, rows, conclusions


def _paired_cells(d: dict[str, Any]) -> list[str]:
    """n, the mean difference, its 95% CI and the paired t-test's p-value, as the report prints them."""
    p = "-" if d["p"] is None or math.isnan(d["p"]) else f"{d['p']:.2g}"
    return [str(d["n"]), f"{d['mean']:+.3g}", f"{d['low']:.3g} to {d['high']:.3g}", p]


def sensitivity_rows(per_series: dict[str, dict[Any, float]]) -> tuple[list[list[str]], list[list[str]]]:
    """The LR sensitivity of each series (its seeds, mean ± half-width of the 95% t-interval), and each series
    against the first of its group (paired over the seeds both ran: difference, 95% CI, p)."""
    rows = [[label, str(len(v)), plus_minus(interval(list(v.values())))] for label, v in per_series.items()]
    (ref_label, ref), *others = per_series.items() or [(None, {})]
    pairs_ = []
    for label, values in others:
        if len(seeds := [s for s in values if s in ref]) > 1:
            d = paired([values[s] for s in seeds], [ref[s] for s in seeds])
            pairs_.append([f"{label} vs {ref_label}", *_paired_cells(d)])
    return rows, pairs_


def markdown_table(columns: list[str], rows: list[list[str]]) -> str:
    cell = lambda v: str(v).replace("|", "\\|")  # noqa: E731
    return "\n".join(
        ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    )
