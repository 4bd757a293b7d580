"""Facts about the data that a model needs, linked by `attnlab` from the DataModule's attribute of
the same name to the model's init argument, so they are never typed twice. A link applies only
where both sides have the name. Shared by the CLI, the W&B config log and the benchmarks."""

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
