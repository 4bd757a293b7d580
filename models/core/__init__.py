"""The attention core that every modality imports, importing none: the attention block (`attention_config`), multi-head
attention (`attention`), its kernels (`attend`, `padding_free`), positions, layers and stacks (`transformer`), the
KV cache, registers, and `capture` of the weights."""
