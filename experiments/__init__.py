"""What a user runs: the `attnlab` CLI, its callbacks, `attnlab compare` and `attnlab sweep`. Class paths written
before the move into rooms import as they did (`experiments.renames`)."""

from experiments.renames import install

install()
