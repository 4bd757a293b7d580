"""What the text DataModules (`datamodules.text.parallel`, `datamodules.text.corpus`) share: the checks of their common arguments, the stages of
``setup``, the token store's preparation and mapping, tokenizer bookkeeping (saved beside the run, carried by the
checkpoint) and the loaders.

The store (`datamodules.text.token_store`) is prepared on first use, whoever asks first: the tokenizer's vocabulary is
linked into the model before the Trainer runs ``prepare_data``, and a trained tokenizer comes out of the same
preparation. Under a lock in ``cache_dir``, the first process (of any rank, on any node that shares the folder)
prepares, the others wait and map the finished files; ``prepare_data`` (Lightning's local rank 0 of each node)
does the same, and ``setup`` finds the store ready and maps it.
"""

from __future__ import annotations

import time
from functools import cached_property
from pathlib import Path

import pytorch_lightning as pl
from tokenizers import Tokenizer
from torch.utils.data import DataLoader, Dataset

from datamodules.loading import loader_settings
from datamodules.text.prepare import report
from datamodules.text.token_budget import WholeBatches
from datamodules.text.token_store import ID_TYPES, build_once, store_folder
from datamodules.text.tokenizers import BOS_ID, EOS_ID, PAD_ID


class TokenizedDataModule(pl.LightningDataModule):
    """The base of the text DataModules. Subclasses implement `_tokenizers`, `_predict_set` (the inputs of
    `attnlab predict`), `_setup_splits` (the datasets another stage needs), and for the store `_store_key`,
    `_store_label` and `_build` (write the store into a temporary folder, return its meta)."""

    pad_id, bos_id, eos_id = PAD_ID, BOS_ID, EOS_ID

    task: str  # for messages: "translation", "language modelling"
    tokenizer_kinds: tuple[str, ...]  # the values of data.tokenizer
    pretrained_hint: str = ""  # what the folder of data.tokenizer=pretrained holds, for messages

    def __init__(self):
        """Saves the subclass's arguments as ``hparams`` and refuses bad values of those both take."""
        super().__init__()
        self.save_hyperparameters()  # Lightning collects the arguments of the subclass's __init__ too
        hp = self.hparams
        # refuses a bad num_workers now, not at the first batch
        loader_settings(hp.num_workers, hp.pin_memory, hp.persistent_workers)
        if hp.tokenizer not in self.tokenizer_kinds:
            raise ValueError(
                f"data.tokenizer={hp.tokenizer!r} is not known for {self.task}; choose {', '.join(self.tokenizer_kinds[:-1])} or {self.tokenizer_kinds[-1]}"
            )
        if hp.tokenizer == "pretrained" and hp.tokenizer_dir is None:
            raise ValueError(
                f"data.tokenizer=pretrained needs data.tokenizer_dir: the pretrained model's folder (or hub name){self.pretrained_hint}"
            )
        if hp.batch_size is not None and hp.batch_size < 1:  # None: a subclass bounds batches otherwise
            raise ValueError(f"data.batch_size={hp.batch_size} must be >= 1")
        if hp.tokenizer_train_chars is not None and hp.tokenizer_train_chars < 1:
            raise ValueError(
                f"data.tokenizer_train_chars={hp.tokenizer_train_chars} must be >= 1, or null to train on all the text"
            )
        if hp.predict_file not in (None, "-") and not Path(hp.predict_file).is_file():
            raise FileNotFoundError(f"data.predict_file: file {hp.predict_file} does not exist")
        if hp.token_dtype is not None and hp.token_dtype not in ID_TYPES:
            raise ValueError(
                f"data.token_dtype={hp.token_dtype!r} is not an id type; choose uint16 or uint32 (or null)"
            )

    @cached_property
    def store(self) -> tuple[Path, dict]:
        """(folder, meta) of the token store, prepared now if no process has."""
        folder = store_folder(self.hparams.cache_dir, self._store_label(), self._store_key())

        def build(tmp: Path) -> dict:
            start = time.perf_counter()
            meta = self._build(tmp)
            report(folder, tmp, meta["arrays"], time.perf_counter() - start)
            return meta

        return folder, build_once(folder, build)

    def prepare_data(self) -> None:
        self.store  # noqa: B018  # prepared once per node (Lightning calls this on each node's local rank 0)

    def _store_key(self) -> dict:
        raise NotImplementedError

    def _store_label(self) -> str:
        raise NotImplementedError

    def _build(self, folder: Path) -> dict:
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        if stage == "fit":
            self._save_tokenizers()
        if stage == "predict":
            self.predict_set = self._predict_set()
        else:
            self._setup_splits(stage)

    def _predict_set(self) -> Dataset:
        raise NotImplementedError

    def _setup_splits(self, stage: str | None) -> None:
        raise NotImplementedError

    def _tokenizers(self) -> dict[str, Tokenizer]:
        """File stem -> tokenizer, e.g. {"tokenizer": ...} or {"tokenizer.en": ..., "tokenizer.de": ...}."""
        raise NotImplementedError

    def _save_tokenizers(self) -> None:
        if self.trainer is None or self.trainer.global_rank != 0:
            return
        root = Path(self.trainer.default_root_dir)
        root.mkdir(parents=True, exist_ok=True)
        for stem, tokenizer in self._tokenizers().items():
            tokenizer.save(str(root / f"{stem}.json"))

    def state_dict(self) -> dict:
        return {"tokenizers": {stem: t.to_str() for stem, t in self._tokenizers().items()}}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("tokenizers", {})
        for stem, tokenizer in self._tokenizers().items():
            if stem in saved and saved[stem] != tokenizer.to_str():
                theirs = Tokenizer.from_str(saved[stem]).get_vocab_size()
                raise ValueError(
                    f"the checkpoint's {stem} ({theirs} tokens) is not the one this data built ({tokenizer.get_vocab_size()} tokens): "
                    "use the same tokenizer settings and training data as the run that made the checkpoint, or set "
                    f"data.tokenizer_dir to that run's folder (it holds {stem}.json)"
                )

    def _loader(
        self, dataset: Dataset, collate, sampler=None, shuffle: bool = False, whole_batches: bool = False
    ) -> DataLoader:
        """A loader of ``data.batch_size`` items a batch; ``whole_batches``: ``sampler`` yields lists of indices
        (token-budget batches, `datamodules.text.token_budget`), each read as one batch."""
        hp = self.hparams
        return DataLoader(
            WholeBatches(dataset) if whole_batches else dataset,
            batch_size=None if whole_batches else hp.batch_size,  # None: one sampler item, one batch
            sampler=sampler,
            shuffle=shuffle,
            collate_fn=collate,
            **loader_settings(hp.num_workers, hp.pin_memory, hp.persistent_workers),
        )
