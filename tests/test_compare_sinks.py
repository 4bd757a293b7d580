"""`attnlab compare`'s figures of attention sinks and outliers: sink mass and max |x| per layer, their growth during
training, and the ViT's [CLS] maps with and without registers, checked against means computed here by hand."""

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml

from datamodules.vision.classification import DigitsDataModule
from experiments.compare.plots import growth_figure, layer_figure
from models.core.capture import capture_attention
from models.vision.module import ImageClassifier

# cell -> (modality, seeds, layers); each layer's heads' sink mass and its max |x| come from `_layer`
CELLS = {
    "vision/softmax": ("vision", (0, 1, 2), ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn"]),
    "vision/clipped": ("vision", (0, 1), ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn"]),
    "text/softmax": ("text", (0, 1), ["decoder.layers.0.self_attn", "decoder.layers.0.multihead_attn"]),
}
STEPS = (0, 20, 40)


def _layer(cell: str, seed: int, j: int) -> tuple[list[float], float]:
    """Chosen numbers: the sink mass of a layer's two heads and its max |x|."""
    base = len(cell) / 10
    return [base + j + seed / 4, base + j / 2 + seed**2 / 8], 3.0 * base + 2 * j + seed


def _logged(cell: str, seed: int, step: int) -> tuple[float, float]:
    """Chosen numbers: train/sink_mass and train/attn_out_max at ``step``."""
    return len(cell) / 20 + step / 100 + (seed - 1) ** 2 / 5, 1.0 + step / 10 + 3 * seed


def fake_runs(root, sinks: bool = True):
    """Run folders as `attnlab fit` leaves them; without ``sinks``, runs from before the sink statistics."""
    for cell, (modality, seeds, names) in CELLS.items():
        for seed in seeds:
            run = root / cell / f"seed{seed}" / "lightning_logs" / "version_0"
            run.mkdir(parents=True)
            layers = []
            for j, name in enumerate(names):
                layer = {"name": name, "kind": "cross" if name.endswith("multihead_attn") else "self"}
                layer["entropy"] = [1.0 + j, 1.5]
                if sinks:
                    layer["sink_mass"], layer["out_max"] = _layer(cell, seed, j)
                layers.append(layer)
            summary = {
                "status": "finished",
                "modality": modality,
                "experiment": str(root / cell / f"seed{seed}"),
                "best": {"monitor": "val/loss", "value": 1.0 + seed},
                "attention": {"final": {"layers": layers}},
            }
            (run / "summary.json").write_text(json.dumps(summary))
            header = "step,train/loss,train/sink_mass,train/attn_out_max" if sinks else "step,train/loss"
            rows = [f"{s},{2.0 - s / 100}" + (",{},{}".format(*_logged(cell, seed, s)) if sinks else "") for s in STEPS]
            (run / "metrics.csv").write_text("\n".join([header, *rows]))
            config = {"seed_everything": seed, "model": {"name": cell}, "trainer": {"default_root_dir": str(run)}}
            (run / "config.yaml").write_text(yaml.safe_dump(config))


def _cells(root):
    from experiments.compare.runs import find_runs, group_cells, load_runs

    return group_cells(load_runs(find_runs([str(root)])))


@pytest.fixture
def cells(tmp_path):
    fake_runs(tmp_path / "runs")
    return _cells(tmp_path / "runs")


def _panel(fig, title: str):
    return next(ax for ax in fig.axes if ax.get_title() == title)


def _line(ax, label: str):
    return next(line for line in ax.lines if line.get_label() == label)


def test_sink_mass_per_layer_is_each_cells_mean_over_seeds_of_the_head_means(cells):
    fig = layer_figure(cells, "sink_mass", "sink mass")
    for cell, (modality, seeds, names) in CELLS.items():
        ax = _panel(fig, modality)
        heads = np.array(
            [[_layer(cell, seed, j)[0] for j in range(len(names))] for seed in seeds]
        )  # (seeds, layers, 2)
        drawn = [line for line in ax.lines if line.get_label() == f"{cell} ({len(seeds)} seeds)"]
        if modality == "text":  # one self- and one cross-attention layer: a line each, at their places
            assert [list(line.get_xdata()) for line in ax.lines if line.get_linestyle() != "None"] == [[0], [1]]
            drawn = [line for line in ax.lines if line.get_linestyle() != "None"]
            assert np.allclose([line.get_ydata()[0] for line in drawn], heads.mean((0, 2)))
        else:
            assert np.allclose(drawn[0].get_ydata(), heads.mean((0, 2)))
        dots = [line for line in ax.lines if line.get_marker() == "." and line.get_color() == drawn[0].get_color()]
        assert [sorted(line.get_ydata()) for line in dots] == [sorted(heads[:, j].ravel()) for j in range(len(names))]


def test_max_abs_output_per_layer_takes_one_value_per_layer_and_seed(cells):
    fig = layer_figure(cells, "out_max", "max |x|")
    ax = _panel(fig, "vision")
    for cell in ("vision/softmax", "vision/clipped"):
        seeds = CELLS[cell][1]
        values = np.array([[_layer(cell, seed, j)[1] for j in range(2)] for seed in seeds])  # (seeds, layers)
        line = _line(ax, f"{cell} ({len(seeds)} seeds)")
        assert np.allclose(line.get_ydata(), values.mean(0))
        dots = [d for d in ax.lines if d.get_marker() == "." and d.get_color() == line.get_color()]
        assert [sorted(d.get_ydata()) for d in dots] == [sorted(values[:, j]) for j in range(2)]
    assert [t.get_text() for t in fig.legends[0].get_texts()][-1] == "a seed"


def test_growth_is_the_mean_over_seeds_with_a_min_to_max_band_per_modality(cells):
    fig = growth_figure(cells)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == [f"{m}: {k}" for k in ("sink mass", "max |x| of the attention output") for m in ("text", "vision")]
    for i, key in enumerate(("sink mass", "max |x| of the attention output")):
        for cell, (modality, seeds, _) in CELLS.items():
            ax = _panel(fig, f"{modality}: {key}")
            values = np.array([[_logged(cell, seed, s)[i] for s in STEPS] for seed in seeds])  # (seeds, steps)
            line = _line(ax, f"{cell} ({len(seeds)} seeds)")
            assert list(line.get_xdata()) == list(STEPS) and np.allclose(line.get_ydata(), values.mean(0))
            band = next(c for c in ax.collections if np.allclose(c.get_facecolor()[0][:3], line.get_color()[:3]))
            vertices = band.get_paths()[0].vertices  # the polygon around the band
            for k, step in enumerate(STEPS):
                ys = vertices[vertices[:, 0] == step, 1]
                assert np.isclose(ys.min(), values[:, k].min()) and np.isclose(ys.max(), values[:, k].max())
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [
        "text/softmax (2 seeds)",
        "vision/clipped (2 seeds)",
        "vision/softmax (3 seeds)",
    ]


def test_report_embeds_each_sink_figure_after_its_sentence_only_when_runs_have_the_data(tmp_path):
    from experiments.compare import build_report, find_runs

    fake_runs(tmp_path / "runs")
    result = build_report(find_runs([str(tmp_path / "runs")]), tmp_path / "report")
    report = (tmp_path / "report" / "report.md").read_text()
    section = report.split("## Attention sinks and outliers\n\n")[1].split("\n\n")
    for name, file in (
        ("sink_mass", "attention_sink_mass.png"),
        ("out_max", "attention_out_max.png"),
        ("growth", "sink_growth.png"),
    ):
        assert result["plots"][name].stat().st_size > 10_000 and result["plots"][name].name == file
        sentence = section[section.index(f"![{name}]({file})") - 1]
        assert sentence.endswith(".") and sentence.count(". ") == 0  # one sentence
    assert "cls_maps" not in result["plots"]  # no registers among these runs

    fake_runs(tmp_path / "old", sinks=False)
    result = build_report(find_runs([str(tmp_path / "old")]), tmp_path / "old_report")
    assert "Attention sinks" not in (tmp_path / "old_report" / "report.md").read_text()
    assert not {"sink_mass", "out_max", "growth"} & result["plots"].keys() and "entropy" in result["plots"]


# ---- the [CLS] maps: two real tiny ViT runs on the digits, without and with 4 registers


@pytest.fixture(scope="module")
def register_runs(tmp_path_factory):
    from experiments.cli import main

    root = tmp_path_factory.mktemp("runs")
    for name, registers in (("registers", 4), ("softmax", 0)):  # folders in this order: the figure reorders them
        main(
            [
                "fit",
                "--config",
                "configs/vision/digits.yaml",
                f"--trainer.default_root_dir={root}/{name}",
                "--trainer.max_epochs=1",
                "--trainer.limit_train_batches=2",
                "--trainer.limit_val_batches=1",
                f"--model.init_args.register_tokens={registers}",
            ]
        )
    return root


def _expected_maps(run_dir, registers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """By hand: the first 4 validation images and the last layer's [CLS] row over the 4x4 patches, mean over heads."""
    data = yaml.safe_load((run_dir / "config.yaml").read_text())["data"]["init_args"]
    datamodule = DigitsDataModule(**data)
    datamodule.setup("validate")
    images = next(iter(datamodule.val_dataloader()))[0][:4]
    vit = ImageClassifier.load_from_checkpoint(run_dir / "checkpoints" / "best.ckpt", map_location="cpu").model.eval()
    with torch.no_grad(), capture_attention(vit) as maps:
        vit(images)
    last = list(maps.values())[-1][-1]  # (4, H, 1 + registers + 16, same)
    return images, last[:, :, 0, 1 + registers :].mean(1).reshape(4, 4, 4)


@pytest.mark.slow
def test_cls_maps_put_softmax_first_and_draw_each_cells_last_layer_head_mean(register_runs, tmp_path):
    from experiments.compare import build_report, find_runs
    from experiments.compare.cls_maps import registers_figure

    cells = _cells(register_runs)
    assert [c["label"] for c in cells] == ["registers", "softmax"]
    fig = registers_figure(cells)
    axes = np.array(fig.axes).reshape(2, 4)
    assert [row[0].get_ylabel() for row in axes] == ["softmax", "registers"]
    for row, (name, registers) in zip(axes, (("softmax", 0), ("registers", 4))):
        run_dir = next((register_runs / name).rglob("summary.json")).parent
        images, heats = _expected_maps(run_dir, registers)
        for ax, image, heat in zip(row, images, heats):
            shown, drawn = ax.get_images()
            assert np.allclose(shown.get_array(), (image[0] - image.min()) / (image.max() - image.min()), atol=1e-6)
            assert np.allclose(drawn.get_array(), heat.numpy(), atol=1e-6)
    result = build_report(find_runs([str(register_runs)]), tmp_path / "report")
    assert result["plots"]["cls_maps"].stat().st_size > 10_000
    assert "![cls_maps](cls_maps.png)" in (tmp_path / "report" / "report.md").read_text()


@pytest.mark.slow
def test_cls_maps_without_a_checkpoint_are_left_out_with_the_reason(register_runs, tmp_path, capsys):
    from experiments.compare import build_report, find_runs

    shutil.copytree(register_runs, tmp_path / "runs")
    best = next((tmp_path / "runs" / "registers").rglob("best.ckpt"))
    best.unlink()
    result = build_report(find_runs([str(tmp_path / "runs")]), tmp_path / "report")
    line = f"The [CLS] attention maps are left out: {best}: no best checkpoint"
    assert line in (tmp_path / "report" / "report.md").read_text() and line in capsys.readouterr().err
    assert "cls_maps" not in result["plots"] and result["plots"]["sink_mass"].is_file()


def test_the_cls_maps_read_against_plain_softmax_put_a_kernel_of_ones_own_among_the_others():
    from experiments.compare.cls_maps import _plain_softmax

    def cell(attention, registers=0):
        hparams = {"attention": attention, "register_tokens": registers}
        return {"runs": [{"summary": SimpleNamespace(hparams=hparams)}]}

    assert _plain_softmax(cell({"normalization": "softmax"}))
    assert not _plain_softmax(
        cell({"normalization": "softmax", "kernel": {"class_path": "my_attention.DiffAttention"}})
    )
    assert not _plain_softmax(cell({"normalization": "softmax", "gate": "headwise"}))
    assert not _plain_softmax(cell({"normalization": "softmax"}, registers=4))
