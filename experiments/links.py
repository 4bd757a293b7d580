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


def links_not_taken(cls: type) -> set[str]:
    """The linked facts that ``cls`` takes no init argument for. LightningCLI records every link's value in the
    hyper-parameters it hands a LightningModule (a decoder-only LM is given ``pad_id``, ``bos_id`` and ``eos_id``),
    and hands a ``--ckpt_path`` file's hyper-parameters back to the constructor: these must be left out of both."""
    return set(LINKED_ATTRIBUTES) - set(init_options(cls))


def init_options(cls: type) -> list[str]:
    """The init arguments of ``cls`` as `attnlab` parses them: a LightningModule's own, then those of the
    network its ``**network`` builds (jsonargparse resolves them)."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls)
    return list(parser.get_defaults().keys())
