"""The `attnlab` command: LightningCLI over every model and DataModule of the suite.

    attnlab fit --config configs/vision/digits.yaml
    attnlab test --config configs/vision/digits.yaml --ckpt_path best
    attnlab fit --config configs/vision/digits.yaml --print_config

Configs name the classes (``model.class_path``, ``data.class_path``). Facts about the data that
a model needs (number of classes, channels, image size, vocabulary sizes, special token ids) are
linked from the DataModule's attribute of the same name to the model's init argument, so they
are never typed twice; a link applies only where both sides have the name.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from pytorch_lightning.cli import LightningCLI

# DataModule attribute -> model init argument of the same name.
LINKED_ATTRIBUTES = (
    "num_classes",
    "in_chans",
    "img_size",
    "vocab_size",
    "src_vocab_size",
    "tgt_vocab_size",
    "pad_id",
    "bos_id",
    "eos_id",
)


class AttnlabCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        for name in LINKED_ATTRIBUTES:
            parser.link_arguments(f"data.{name}", f"model.init_args.{name}", apply_on="instantiate")

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, FileNotFoundError) as err:  # a user's bad value, raised where it entered
            _fail(err)
        if self.subcommand in ("validate", "test", "predict"):
            self._resolve_saved_checkpoint()

    def _resolve_saved_checkpoint(self) -> None:
        """`--ckpt_path best|last` in a fresh process: the newest such checkpoint of this experiment."""
        cfg = self.config_init[self.subcommand]
        alias = cfg.get("ckpt_path")
        if alias not in ("best", "last"):
            return
        root = Path(self.trainer.default_root_dir)
        found = sorted(root.glob(f"**/checkpoints/{alias}*.ckpt"), key=os.path.getmtime)
        if not found:
            _fail(f"--ckpt_path {alias}: no '{alias}*.ckpt' under {root}/; run `attnlab fit` with this config first or pass a checkpoint file")
        cfg["ckpt_path"] = str(found[-1])
        print(f"attnlab: using checkpoint {found[-1]}", file=sys.stderr)


def _fail(err: object) -> None:
    print(f"attnlab: error: {err}", file=sys.stderr)
    sys.exit(2)


def main(args: list[str] | None = None) -> AttnlabCLI:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing downloads at run time
    return AttnlabCLI(
        model_class=None,
        datamodule_class=None,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
