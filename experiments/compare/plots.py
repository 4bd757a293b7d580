"""Plots of the report, each one PNG drawn on a matplotlib Figure (no display needed): training loss,
attention statistics by layer, the √d section, every seed of every cell, a metric against a swept number."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from matplotlib import colormaps
from matplotlib.figure import Figure  # no pyplot: no global backend, nothing to close

from experiments.compare.runs import STATS, by_seed, train_loss
from experiments.compare.stats import interval


def plot_cells(cells: list[dict[str, Any]], path: Path) -> None:
    """One row per group, one panel per measure: every seed's value (dots) and the mean with its 95% interval (bars)."""
    groups = list(dict.fromkeys(c["group"] for c in cells))
    measures = [("best", "best")] + [(k, label) for k, label in STATS if any(by_seed(c, k) for c in cells)]
    fig = Figure(figsize=(3.2 * len(measures), 3.4 * len(groups)))
    axes = fig.subplots(len(groups), len(measures), squeeze=False)
    for axes_row, group in zip(axes, groups):
        members = [c for c in cells if c["group"] == group]
        names = [c["label"].removeprefix(f"{group}/") for c in members]
        keys = ", ".join(re.findall(r"([\w.]+)=", names[0]))  # "similarity=dot,positions=learned": ticks "dot,learned"
        names = [re.sub(r"[\w.]+=", "", name) for name in names]
        for ax, (key, label) in zip(axes_row, measures):
            for x, cell in enumerate(members):
                values = list(by_seed(cell, key).values())
                if not values:
                    continue
                dots, bars = (None, None) if x else ("a seed", "mean, 95% CI")  # one legend entry each
                xs = [x + (i - (len(values) - 1) / 2) * 0.06 for i in range(len(values))]  # jittered
                ax.plot(xs, values, "o", color="gray", alpha=0.6, ms=4, label=dots)
                stat = interval(values)
                ax.errorbar(x + 0.25, stat["mean"], stat["half"] or 0, fmt="s", color="tab:blue", capsize=4, label=bars)
            monitor = next((c.get("monitor") for c in members if c.get("monitor")), None)
            ax.set_title(f"{group}: {monitor or label}" if key == "best" else f"{group}: {label}", fontsize=9)
            ax.set_xticks(range(len(members)), names, rotation=30, ha="right", fontsize=7)
            ax.set_xlabel(keys, fontsize=7)
            ax.grid(alpha=0.3, axis="y")
        axes_row[0].legend(fontsize=6)
    _save(fig, path)


def plot_losses(runs: list[dict[str, Any]], path: Path) -> None:
    """Training loss of every run against the fraction of its training, raw (log scale) and relative to its first value."""
    fig = Figure(figsize=(11, 4))
    raw, rel = fig.subplots(1, 2)
    for ax in (raw, rel):
        ax.set_prop_cycle(color=[colormaps["tab20"](i % 20) for i in range(len(runs))])
        ax.grid(alpha=0.3)
    for r in runs:
        curve = train_loss(r["metrics"])
        if not curve:
            continue
        last = max(step for step, _ in curve) or 1
        x = [step / last for step, _ in curve]
        y = [v for _, v in curve]
        raw.plot(x, y, label=r["label"])
        rel.plot(x, [v / y[0] for v in y] if y[0] else y, label=r["label"])
        val = r["metrics"].get("val/loss")
        if val:
            raw.plot([s / last for s, _ in val], [v for _, v in val], "o", ms=3, color=raw.lines[-1].get_color())
    raw.set(xlabel="fraction of training", ylabel="loss (train: line, val: dots)", yscale="log", title="loss")
    rel.set(xlabel="fraction of training", ylabel="train loss / first train loss", title="loss relative to its start")
    if rel.lines:
        rel.legend(fontsize=7)
    _save(fig, path)


def plot_by_layer(runs: list[dict[str, Any]], key: str, ylabel: str, path: Path) -> bool:
    """One panel per run: ``key`` of each attention layer (mean over heads as a line, heads as dots)."""
    panels = [(r, ((r["summary"].attention or {}).get("final") or {})) for r in runs]
    panels = [(r, a) for r, a in panels if any(layer.get(key) for layer in a.get("layers", []))]
    if not panels:
        return False
    cols = min(len(panels), 4)
    rows = -(-len(panels) // cols)
    fig = Figure(figsize=(4 * cols, 3.6 * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax, (r, attention) in zip(axes.flat, panels):
        layers = [layer for layer in attention["layers"] if layer.get(key)]
        for kind, marker in (("self", "o"), ("cross", "s")):
            idx = [i for i, layer in enumerate(layers) if layer["kind"] == kind]
            if not idx:
                continue
            means = [sum(layers[i][key]) / len(layers[i][key]) for i in idx]
            ax.plot(idx, means, marker=marker, label=f"{kind}-attention (head mean)")
            for i in idx:
                ax.plot([i] * len(layers[i][key]), layers[i][key], ".", color="gray", alpha=0.5, ms=4)
        ax.set_xticks(range(len(layers)), [_short(layer["name"]) for layer in layers], rotation=60, fontsize=6)
        unit = f" ({attention.get('unit')})" if key == "distance" else ""
        ax.set(title=panel_title(r), ylabel=ylabel + unit)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    _save(fig, path)
    return True


def panel_title(run: dict[str, Any]) -> str:
    """The run's label, and its modality below when the label does not already say it (not "vision / vision")."""
    modality_ = run["summary"].modality
    return run["label"] if not modality_ or modality_ in run["label"].split("/") else f"{run['label']}\n{modality_}"


def _short(name: str) -> str:
    parts = name.split(".")
    stack = next((p for p in parts if p in ("encoder", "decoder", "blocks")), "")
    index = next((p for p in parts if p.isdigit()), "")
    kind = "x" if parts[-1] == "multihead_attn" else ""
    return f"{stack[:3]}{index}{kind}" or name


def _save(fig: Figure, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def plot_scaling(runs: list[dict[str, Any]], path: Path) -> None:
    """Logit variance and max weight at initialisation, by similarity, one group per modality (log scale)."""
    groups: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for r in runs:
        groups.setdefault(r["summary"].modality or "-", {}).setdefault(r["similarity"] or "-", []).append(r)
    groups = {m: g for m, g in groups.items() if len(g) > 1}
    panels = (
        ("logit_var", "init", "logit variance at init"),
        ("max_weight", "init", "max weight at init"),
        ("max_weight", "final", "max weight at the end"),
    )
    fig = Figure(figsize=(13, 3.6))
    axes = fig.subplots(1, len(panels))
    sims = [s for s in ("scaled_dot", "dot", "general") if any(s in by_sim for by_sim in groups.values())]
    width = 0.8 / len(sims)
    colors = {"scaled_dot": "tab:blue", "dot": "tab:orange", "general": "tab:green"}
    for ax, (key, stage, label) in zip(axes, panels):
        for j, sim in enumerate(sims):
            xs, ys = [], []
            for i, (_modality, by_sim) in enumerate(sorted(groups.items())):
                values = [r[stage].get(key) for r in by_sim.get(sim, []) if r[stage].get(key) is not None]
                if values:
                    xs.append(i + (j - (len(sims) - 1) / 2) * width)
                    ys.append(sum(values) / len(values))
            ax.bar(xs, ys, width, label=sim, color=colors[sim])
        ax.set_xticks(range(len(groups)), sorted(groups))
        ax.set(title=label, yscale="log" if key == "logit_var" else "linear")
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=7)
    _save(fig, path)


def plot_against(series: list[dict[str, Any]], xlabel: str, ylabel: str, path: Path, log_x: bool = False) -> None:
    """A metric against a swept number (`experiments.compare.curves`): per series, the mean over the seeds (line)
    and its 95% t-interval (band; none where one seed ran)."""
    from experiments.compare.curves import band

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for line in series:
        points = band(line["points"])
        if not points:
            continue
        drawn = ax.plot([x for x, _ in points], [s["mean"] for _, s in points], "o-", ms=4, label=line["label"])
        spread = [(x, s["low"], s["high"]) for x, s in points if s["half"] is not None]
        if spread:
            ax.fill_between(*zip(*spread), color=drawn[0].get_color(), alpha=0.2)  # x, low, high
    ax.set(xscale="log" if log_x else "linear", xlabel=xlabel, ylabel=ylabel)
    ticks = sorted({x for line in series for x in line["points"]})
    ax.set_xticks(ticks, [f"{x:g}" for x in ticks])  # the swept values themselves
    ax.minorticks_off()
    ax.set_title("mean over the seeds; band: 95% t-interval", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, path)
