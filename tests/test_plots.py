"""Figures a reader compares by eye, inspected as matplotlib Figures before they are saved: the compare report's
loss curves and attention statistics by layer, and a run's ``attention.png``."""

import json
import re
from types import SimpleNamespace

import pytest
import torch
import yaml
from builders import tiny_lm, tiny_seq2seq, tiny_vit
from conftest import TINY_TRUNK
from matplotlib import colormaps

from datamodules.text.tokenizers import build_tokenizer
from experiments.callbacks.attention_figure import attention_figure, token_sides
from experiments.callbacks.attention_stats import feature_sizes
from experiments.compare.plots import cell_colours, layer_figure, loss_figure
from models.core.capture import capture_attention

# ---- the compare report: fake run folders with known statistics

# (experiment folder, modality, seeds, layers): a vision cell of 2 seeds, two vision runs, a translation run
RUNS = [
    ("vision/scaled_dot", "vision", (0, 1), ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn"]),
    ("vision/dot", "vision", (0,), ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn"]),
    ("vision/general", "vision", (0,), ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn"]),
    (
        "text/toy",
        "text",
        (0,),
        ["encoder.layers.0.self_attn", "decoder.layers.0.self_attn", "decoder.layers.0.multihead_attn"],
    ),
]


def fake_runs(root):
    """Run folders as `attnlab fit` leaves them (summary.json, metrics.csv, config.yaml), the numbers chosen."""
    for i, (name, modality, seeds, names) in enumerate(RUNS):
        for seed in seeds:
            run = root / name / f"seed{seed}" / "lightning_logs" / "version_0"
            run.mkdir(parents=True)
            layers = [
                {
                    "name": layer,
                    "kind": "cross" if layer.endswith("multihead_attn") else "self",
                    "entropy": [1.0 + i + j / 4 + seed / 10, 1.5 + i + j / 4],
                    "distance": [2.0 + 1.3 * i + j + seed / 2, 3.0 + j],
                }
                for j, layer in enumerate(names)
            ]
            summary = {
                "status": "finished",
                "modality": modality,
                "experiment": str(root / name / f"seed{seed}"),
                "best": {"monitor": "val/loss", "value": 1.0 + i / 10 + seed / 20},
                "attention": {"final": {"unit": "pixels" if modality == "vision" else "tokens", "layers": layers}},
            }
            (run / "summary.json").write_text(json.dumps(summary))
            rows = [f"{step},{3.0 / (step + 1 + i)},{'' if step % 4 else 2.5 / (step + 1 + i)}" for step in range(9)]
            (run / "metrics.csv").write_text("\n".join(["step,train/loss_step,val/loss", *rows]))
            config = {"seed_everything": seed, "model": {"name": name}, "trainer": {"default_root_dir": str(run)}}
            (run / "config.yaml").write_text(yaml.safe_dump(config))


@pytest.fixture
def cells(tmp_path):
    from experiments.compare.runs import find_runs, group_cells, load_runs

    fake_runs(tmp_path / "runs")
    return group_cells(load_runs(find_runs([str(tmp_path / "runs")])))


def _cell_lines(ax):
    """(label, colour) of each legend-labelled line."""
    return [(line.get_label(), line.get_color()) for line in ax.lines if not line.get_label().startswith("_")]


def test_entropy_and_distance_put_every_run_of_a_modality_on_one_axes_in_distinct_colours(cells):
    assert [c["label"] for c in cells] == ["text/toy", "vision/dot", "vision/general", "vision/scaled_dot"]
    for key in ("entropy", "distance"):
        fig = layer_figure(cells, key, key)
        axes = fig.axes
        assert [ax.get_title() for ax in axes] == ["text", "vision"]  # one Axes per modality
        # every cell drawn, the mean of its seeds' head means a line of its own: 3 vision cells (self), the text
        # cell (self and cross)
        text, vision = axes
        means = [line for line in vision.lines if line.get_marker() == "o"]
        assert len(means) == 3 and {len(line.get_xdata()) for line in means} == {2}
        assert [line.get_marker() for line in text.lines if line.get_linestyle() != "None"] == ["o", "s"]
        # the seeds of a cell share its colour, the cells' colours are pairwise distinct
        colours = [line.get_color() for line in means]
        assert len(set(colours)) == 3 and text.lines[0].get_color() not in colours
        two_seeds = {line.get_color() for line in vision.lines if len(line.get_ydata()) == 4}  # both seeds' heads
        assert two_seeds == {colours[2]}
        # one legend for the figure: a row per cell, none inside the panels
        assert [ax.get_legend() for ax in axes] == [None, None] and len(fig.legends) == 1
        entries = [t.get_text() for t in fig.legends[0].get_texts()]
        assert entries[:4] == ["text/toy", "vision/dot", "vision/general", "vision/scaled_dot (2 seeds)"]
    distance = layer_figure(cells, "distance", "mean attention distance")
    assert [ax.get_ylabel() for ax in distance.axes] == [
        "mean attention distance (tokens)",
        "mean attention distance (pixels)",
    ]


def test_loss_curves_have_a_colour_per_cell_and_a_legend_in_each_panel(cells):
    fig = loss_figure(cells)
    for ax in fig.axes:
        labelled = _cell_lines(ax)
        assert [label for label, _ in labelled] == [
            "text/toy",
            "vision/dot",
            "vision/general",
            "vision/scaled_dot (2 seeds)",
        ]
        assert len({colour for _, colour in labelled}) == 4  # pairwise distinct
        assert [t.get_text() for t in ax.get_legend().get_texts()] == [label for label, _ in labelled]
    assert sum(line.get_linestyle() == "-" for line in fig.axes[0].lines) == 5  # every run's train loss


def test_cells_get_tab10_colours_distinct_beyond_ten_cells():
    colours = cell_colours([{}] * 20)
    assert colours[:10] == list(colormaps["tab10"].colors)  # a qualitative map: ten hues, not shades of one
    assert len(set(colours)) == 20


def test_the_compare_report_draws_the_figures(tmp_path):
    from experiments.compare import build_report, find_runs

    fake_runs(tmp_path / "runs")
    result = build_report(find_runs([str(tmp_path / "runs")]), tmp_path / "report")
    for name in ("loss", "entropy", "distance"):
        assert result["plots"][name].stat().st_size > 10_000


# ---- attention.png


def _head_means(model, *inputs):
    with torch.no_grad(), capture_attention(model) as maps, feature_sizes(model) as hw:
        model(*inputs)
    return {name: calls[0][0].mean(0) for name, calls in maps.items() if calls}, (hw[0] if hw else None)


def _panels(fig):
    return [ax for ax in fig.axes if ax.get_label() != "<colorbar>" and ax.get_images()]


def _labels(axis):
    return [t.get_text() for t in axis.get_ticklabels()]


def test_a_vit_attention_figure_has_colour_bars_and_patches_by_whole_row_and_column():
    torch.manual_seed(0)
    vit = tiny_vit().eval()  # 8x8 images in 2x2 patches: a 4x4 grid after the class token
    images = torch.randn(2, 1, 8, 8)
    maps, hw = _head_means(vit, images)
    fig = attention_figure(maps, *token_sides(vit, (images,), hw, None))
    panels = _panels(fig)
    assert len(panels) == 2 and sum(ax.get_label() == "<colorbar>" for ax in fig.axes) == 2
    assert all(ax.get_images()[0].colorbar is not None for ax in panels)
    cells = ["cls"] + [f"{r},{c}" for r in range(4) for c in range(4)]
    for ax in panels:
        assert list(ax.get_xticks()) == list(range(17)) and _labels(ax.xaxis) == _labels(ax.yaxis) == cells
        assert (
            ax.get_xlabel() == "key: cls, then patch (row, column)"
            and ax.get_ylabel() == "query: cls, then patch (row, column)"
        )


def test_a_translation_attention_figure_names_the_tokens():
    sentences = ["the cat sat", "a dog ran", "the dog sat"]
    tokenizer = build_tokenizer("word", sentences, min_frequency=1)
    src = torch.tensor([tokenizer.encode("the cat sat").ids])
    tgt = torch.tensor([[1] + tokenizer.encode("a dog").ids])  # BOS first
    model = tiny_seq2seq(tokenizer.get_vocab_size())
    maps, hw = _head_means(model, src, tgt)
    fig = attention_figure(maps, *token_sides(model, (src, tgt), hw, SimpleNamespace(tokenizers=(tokenizer,) * 2)))
    panels = {ax.get_title(): ax for ax in _panels(fig)}
    encoder, cross = panels["encoder.layers.0.self_attn"], panels["decoder.layers.0.multihead_attn"]
    assert _labels(encoder.xaxis) == _labels(encoder.yaxis) == ["the", "cat", "sat"]
    assert _labels(cross.xaxis) == ["the", "cat", "sat"] and _labels(cross.yaxis) == ["<bos>", "a", "dog"]
    assert cross.get_xlabel() == "key: source token" and cross.get_ylabel() == "query: target token"
    assert sum(ax.get_label() == "<colorbar>" for ax in fig.axes) == len(panels) == 6
    # without a tokenizer: the token ids
    fig = attention_figure(maps, *token_sides(model, (src, tgt), hw, None))
    assert _labels(_panels(fig)[0].xaxis) == [str(i) for i in src[0].tolist()]


def test_a_language_model_attention_figure_names_the_characters():
    tokenizer = build_tokenizer("char", ["to be or not to be"], min_frequency=1)
    tokens = torch.tensor([tokenizer.encode("to be").ids])
    lm = tiny_lm(tokenizer.get_vocab_size(), "learned", 16)
    maps, hw = _head_means(lm, tokens)
    fig = attention_figure(maps, *token_sides(lm, (tokens,), hw, SimpleNamespace(tokenizer=tokenizer)))
    for ax in _panels(fig):
        assert _labels(ax.xaxis) == _labels(ax.yaxis) == ["t", "o", "␣", "b", "e"]  # the space made visible
        assert ax.get_xlabel() == "key: token" and ax.get_ylabel() == "query: token"


def test_a_detr_attention_figure_names_the_cells_and_the_queries():
    from models.detection.backbone import Backbone
    from models.detection.detr import DETR

    torch.manual_seed(0)
    detr = DETR(Backbone(**TINY_TRUNK), 3, 5, d_model=32, nhead=4, num_encoder_layers=1, num_decoder_layers=1)
    images = torch.randn(1, 3, 48, 32)  # stride 16: a 3x2 feature map
    maps, hw = _head_means(detr.eval(), images)
    assert hw == (3, 2)
    panels = {ax.get_title(): ax for ax in _panels(attention_figure(maps, *token_sides(detr, (images,), hw, None)))}
    cells = ["0,0", "0,1", "1,0", "1,1", "2,0", "2,1"]
    assert _labels(panels["transformer.encoder.layers.0.self_attn"].xaxis) == cells
    cross = panels["transformer.decoder.layers.0.multihead_attn"]
    assert _labels(cross.xaxis) == cells and _labels(cross.yaxis) == ["0", "1", "2", "3", "4"]
    assert cross.get_xlabel() == "key: feature-map cell (row, column)" and cross.get_ylabel() == "query: object query"


def test_long_sequences_show_every_kth_token_or_the_first_patch_of_each_row():
    maps = {"blocks.0.attn": torch.full((100, 100), 0.01)}
    ax = _panels(attention_figure(maps, *token_sides(tiny_vit(), (torch.zeros(1, 1, 8, 8),), None, None)))[0]
    ticks = list(ax.get_xticks())
    assert ticks == list(range(0, 100, 5)) and _labels(ax.xaxis) == [str(t) for t in ticks]  # 17 labels != 100
    assert ax.get_xlabel() == "key: token index"
    assert all(re.fullmatch(r"\d+", label) for label in _labels(ax.yaxis))
    # a 7x7 patch grid (50 tokens with cls): the first patch of each row
    vit = tiny_vit(img_size=28, patch_size=4)
    ax = _panels(attention_figure({"blocks.0.attn": torch.full((50, 50), 0.02)}, *token_sides(vit, (), None, None)))[0]
    assert list(ax.get_yticks()) == [1 + 7 * r for r in range(7)]
    assert _labels(ax.yaxis) == [f"{r},0" for r in range(7)]


def test_legend_labels_flatten_nested_grid_values_to_their_leaves():
    from experiments.compare.plots import _legend_label

    cell = {"label": "sinks_text/init_args={attention={normalization=softmax,gate=elementwise}}", "runs": [1, 2, 3]}
    assert _legend_label(cell) == "sinks_text/normalization=softmax,gate=elementwise (3 seeds)"
    assert _legend_label({"label": "digits/similarity=dot", "runs": [1]}) == "digits/similarity=dot"
