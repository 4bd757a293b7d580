"""Facts about the data that a model needs, linked by `attnlab` from the DataModule's attribute of
the same name to the model's init argument, so they are never typed twice. A link applies only
where both sides have the name. Shared by the CLI, the W&B config log and the benchmarks."""

from jsonargparse import ArgumentParser

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


def init_options(cls: type) -> list[str]:
    """The init arguments of ``cls`` as `attnlab` parses them: a LightningModule's own, then those of the
    network its ``**network`` builds (jsonargparse resolves them)."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls)
    return list(parser.get_defaults().keys())
