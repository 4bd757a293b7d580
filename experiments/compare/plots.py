"""Plots of the report, each one PNG drawn on a matplotlib Figure (no display needed): training loss,
attention statistics by layer, the √d section, every seed of every cell, a metric against a swept number.
Each cell (a run and its seeds) has one colour in every plot (`cell_colours`); ``loss_figure`` and
``layer_figure`` return their Figure, which `save` writes."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from matplotlib import colormaps
from matplotlib.figure import Figure  # no pyplot: no global backend, nothing to close
from matplotlib.lines import Line2D

from experiments.compare.runs import STATS, by_seed, train_loss
from experiments.compare.stats import interval

SEED_COLUMNS = 4  # panels in a row of the seeds figure


def seeds_figure(cells: list[dict[str, Any]]) -> Figure:
    """Per group, one panel per measure, at most `SEED_COLUMNS` in a row (a group's panels start a new row): every
    seed's value (dots) and the mean with its 95% interval (bars, in the cell's colour)."""
    groups = list(dict.fromkeys(c["group"] for c in cells))
    measures = [("best", "best")] + [(k, label) for k, label in STATS if any(by_seed(c, k) for c in cells)]
    columns = min(SEED_COLUMNS, len(measures))
    per_group = -(-len(measures) // columns)  # rows of panels per group
    fig = Figure(figsize=(3.4 * columns, 3.2 * per_group * len(groups)), layout="constrained")
    axes = fig.subplots(per_group * len(groups), columns, squeeze=False)
    colours = dict(zip(map(id, cells), cell_colours(cells)))  # as in the other plots
    for g, group in enumerate(groups):
        members = [c for c in cells if c["group"] == group]
        panels = axes[g * per_group : (g + 1) * per_group].flat
        for ax, (key, label) in zip(panels, measures):
            _seed_panel(ax, members, key, [colours[id(c)] for c in members])
            monitor = next((c.get("monitor") for c in members if c.get("monitor")), None)
            ax.set_title(f"{group}: {monitor or label}" if key == "best" else f"{group}: {label}", fontsize=9)
        for ax in list(axes[g * per_group : (g + 1) * per_group].flat)[len(measures) :]:
            ax.set_visible(False)
        axes[g * per_group, 0].legend(fontsize=6)
    return fig


def _seed_panel(ax: Any, members: list[dict[str, Any]], key: str, colours: list[Any]) -> None:
    """One measure of a group's cells: x = the cell, named by what its label says beyond the group."""
    group = members[0]["group"]
    names = [c["label"].removeprefix(f"{group}/") for c in members]
    keys = [re.findall(r"([\w.]+)=", name) for name in names]
    if all(k == keys[0] for k in keys) and keys[0]:  # "similarity=dot,positions=learned": ticks "dot,learned"
        names = [re.sub(r"[\w.]+=", "", name) for name in names]
        ax.set_xlabel(", ".join(keys[0]), fontsize=7)
    for x, (cell, colour) in enumerate(zip(members, colours)):
        values = list(by_seed(cell, key).values())
        if not values:
            continue
        dots, bars = (None, None) if x else ("a seed", "mean, 95% CI")  # one legend entry each
        xs = [x + (i - (len(values) - 1) / 2) * 0.06 for i in range(len(values))]  # jittered
        ax.plot(xs, values, "o", color="gray", alpha=0.6, ms=4, label=dots)
        stat = interval(values)
        ax.errorbar(x + 0.25, stat["mean"], stat["half"] or 0, fmt="s", color=colour, capsize=4, label=bars)
    ax.set_xticks(range(len(members)), names, rotation=30, ha="right", fontsize=7)
    ax.grid(alpha=0.3, axis="y")


def cell_colours(cells: list[dict[str, Any]]) -> list[Any]:
    """One colour per cell, pairwise distinct, in the cells' order: tab10's, then tab20's lighter ten (the same run
    keeps its colour in every figure drawn from the same cells)."""
    tab20 = colormaps["tab20"].colors
    palette = list(colormaps["tab10"].colors) + [tab20[i] for i in range(1, 20, 2)]
    return [palette[i % len(palette)] for i in range(len(cells))]


def flat_label(label: str) -> str:
    """A cell label with nested keys flattened to their leaves: "sinks/init_args={attention={gate=x}}" ->
    "sinks/gate=x"."""
    while (flat := re.sub(r"[\w.]+=\{([^{}]*)\}", r"\1", label)) != label:
        label = flat
    return label


def _legend_label(cell: dict[str, Any]) -> str:
    n = len(cell["runs"])
    return flat_label(cell["label"]) + (f" ({n} seeds)" if n > 1 else "")


def loss_figure(cells: list[dict[str, Any]]) -> Figure:
    """Training loss of every run against the fraction of its training, raw (log scale) and relative to its first
    value; one colour per cell (its seeds share it), a legend in each panel."""
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    raw, rel = fig.subplots(1, 2)
    for cell, colour in zip(cells, cell_colours(cells)):
        label = _legend_label(cell)
        for r in cell["runs"]:
            curve = train_loss(r["metrics"])
            if not curve:
                continue
            last = max(step for step, _ in curve) or 1
            x = [step / last for step, _ in curve]
            y = [v for _, v in curve]
            lone = dict(marker="_", ms=12) if len(x) == 1 else {}  # a line of one point: a dash, not nothing
            raw.plot(x, y, color=colour, label=label, **lone)
            rel.plot(x, [v / y[0] for v in y] if y[0] else y, color=colour, label=label, **lone)
            label = None  # one legend entry per cell
            val = r["metrics"].get("val/loss")
            if val:
                raw.plot([s / last for s, _ in val], [v for _, v in val], "o", ms=3, color=colour)
    raw.set(xlabel="fraction of training", ylabel="loss (train: line, val: dots)", yscale="log", title="loss")
    rel.set(xlabel="fraction of training", ylabel="train loss / first train loss", title="loss relative to its start")
    for ax in (raw, rel):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    return fig


GROWTH = (("train/sink_mass", "sink mass"), ("train/attn_out_max", "max |x| of the attention output"))


def growth_figure(cells: list[dict[str, Any]]) -> Figure | None:
    """How sinks and outliers grow: each of `GROWTH` logged during training against the step, one row per metric,
    one panel per modality; per cell the mean over its seeds (line) and their minimum to maximum (band), in the cell's
    colour; one legend. None when no run logged them."""
    from experiments.compare.curves import logged_points

    logged = {k: label for k, label in GROWTH if any(k in r["metrics"] for c in cells for r in c["runs"])}
    drawn = [c for c in cells if any(k in r["metrics"] for k in logged for r in c["runs"])]
    if not drawn:
        return None
    colours = dict(zip(map(id, cells), cell_colours(cells)))
    modalities = list(dict.fromkeys(c["modality"] for c in drawn))
    fig = Figure(figsize=(2.5 + 4.5 * len(modalities), 3.4 * len(logged)), layout="constrained")
    axes = fig.subplots(len(logged), len(modalities), squeeze=False)
    for axes_row, (key, label) in zip(axes, logged.items()):
        for ax, modality_ in zip(axes_row, modalities):
            for cell in (c for c in drawn if c["modality"] == modality_):
                points = logged_points(cell, key)
                seeds = {x: [v for v in points[x].values() if math.isfinite(v)] for x in sorted(points)}
                steps = [x for x, values in seeds.items() if values]
                if not steps:
                    continue
                means = [sum(seeds[x]) / len(seeds[x]) for x in steps]
                ax.plot(steps, means, color=colours[id(cell)], label=_legend_label(cell))
                spread = [min(seeds[x]) for x in steps], [max(seeds[x]) for x in steps]
                ax.fill_between(steps, *spread, color=colours[id(cell)], alpha=0.2, linewidth=0)
            ax.set(title=f"{modality_}: {label}", xlabel="step", ylabel=label)
            ax.grid(alpha=0.3)
    entries = {line.get_label(): line for ax in axes.flat for line in ax.lines}  # a cell once, in its colour
    fig.legend(handles=list(entries.values()), fontsize=7, loc="outside right upper")
    return fig


def _final(run: dict[str, Any]) -> dict[str, Any]:
    return (run["summary"].attention or {}).get("final") or {}


def layer_figure(cells: list[dict[str, Any]], key: str, ylabel: str) -> Figure | None:
    """``key`` of each attention layer at the end of training, one panel per modality with every cell on it: per
    cell, the mean over its seeds of the mean over heads as a line (one colour per cell), each head of each seed as a
    dot; a key with one value per layer (``out_max``) is a layer's one head. One legend. None when no run has ``key``.
    """
    drawn = [c for c in cells if any(_heads(layer, key) for layer in _cell_layers(c))]
    if not drawn:
        return None
    colours = dict(zip(map(id, cells), cell_colours(cells)))
    modalities = list(dict.fromkeys(c["modality"] for c in drawn))
    fig = Figure(figsize=(2.5 + 4.5 * len(modalities), 4), layout="constrained")
    axes = fig.subplots(1, len(modalities), squeeze=False)[0]
    for ax, modality_ in zip(axes, modalities):
        members = [c for c in drawn if c["modality"] == modality_]
        runs = [r for c in members for r in c["runs"]]
        names = list(dict.fromkeys(layer["name"] for r in runs for layer in _final(r).get("layers", [])))
        for cell in members:
            _draw_layers(ax, names, cell["runs"], key, colours[id(cell)], _legend_label(cell))
        units = sorted({_final(r).get("unit") for r in runs} - {None})
        unit = f" ({', '.join(units)})" if key == "distance" and units else ""
        ax.set_xticks(range(len(names)), [_short(name) for name in names], rotation=60, fontsize=7)
        ax.set(title=modality_, ylabel=ylabel + unit)
        ax.grid(alpha=0.3)
    per_head = any(isinstance(layer.get(key), list) for c in drawn for layer in _cell_layers(c))
    fig.legend(handles=_layer_legend(axes, per_head), fontsize=7, loc="outside right upper")
    return fig


def _cell_layers(cell: dict[str, Any]) -> list[dict[str, Any]]:
    return [layer for r in cell["runs"] for layer in _final(r).get("layers", [])]


def _heads(layer: dict[str, Any], key: str) -> list[float]:
    """A layer's ``key`` per head: its list, a one-value list for a layer-wide number, [] when not measured."""
    value = layer.get(key)
    return [] if value is None else value if isinstance(value, list) else [value]


def _draw_layers(ax: Any, names: list[str], runs: list[dict], key: str, colour: Any, label: str) -> None:
    """One cell's ``key`` at x = the layer's place in ``names``: self- and cross-attention layers as two lines of the
    mean over the seeds of the head means, each head of each seed a dot."""
    for kind, style in (("self", "o-"), ("cross", "s--")):
        seeds: dict[str, list[list[float]]] = {}  # layer name -> each seed's heads
        for r in runs:
            for layer in _final(r).get("layers", []):
                if layer["kind"] == kind and _heads(layer, key):
                    seeds.setdefault(layer["name"], []).append(_heads(layer, key))
        if not seeds:
            continue
        ours = sorted(seeds, key=names.index)
        means = [sum(sum(h) / len(h) for h in seeds[name]) / len(seeds[name]) for name in ours]
        ax.plot([names.index(name) for name in ours], means, style, color=colour, ms=4, label=label)
        label = None  # one legend entry per cell
        for name in ours:
            heads = [h for seed in seeds[name] for h in seed]
            ax.plot([names.index(name)] * len(heads), heads, ".", color=colour, alpha=0.35, ms=4)


def _layer_legend(axes: Any, per_head: bool) -> list[Line2D]:
    """The cells (by colour), then the markers: self- and cross-attention means, a head of a seed (``per_head``) or a
    seed."""
    lines = [line for ax in axes for line in ax.lines]
    mean = "mean over seeds of the head means" if per_head else "mean over seeds"
    keys = [Line2D([], [], color="gray", marker="o", ms=4, label=f"self-attention: {mean}")]
    if any(line.get_marker() == "s" for line in lines):
        keys.append(Line2D([], [], color="gray", marker="s", ls="--", ms=4, label=f"cross-attention: {mean}"))
    dot = "a head of a seed" if per_head else "a seed"
    keys.append(Line2D([], [], color="gray", marker=".", ls="", alpha=0.5, label=dot))
    return [line for line in lines if not line.get_label().startswith("_")] + keys


def _short(name: str) -> str:
    parts = name.split(".")
    stack = next((p for p in parts if p in ("encoder", "decoder", "blocks")), "")
    index = next((p for p in parts if p.isdigit()), "")
    kind = "x" if parts[-1] == "multihead_attn" else ""
    return f"{stack[:3]}{index}{kind}" or name


def save(fig: Figure, path: Path) -> None:
    """``fig`` as a PNG, laid out tight unless it brings its own layout engine."""
    if fig.get_layout_engine() is None:
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
    save(fig, path)


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
    if ax.lines:
        ax.legend(fontsize=7)
    save(fig, path)
