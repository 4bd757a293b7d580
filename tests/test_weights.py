"""The one path for foreign weights (`models.weights`): `resolve` finds a path or a hub name in huggingface_hub's
cache (offline as huggingface_hub itself decides), `read_state` unwraps, `load_checked` loads every tensor or
raises one line naming the source and what does not fit. Nothing downloads: the hub's endpoint is unreachable."""

import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest
import timm
import torch
from safetensors.torch import save_file
from torch import nn

from models.vision.module import ImageClassifier
from models.weights import load_checked, read_state, resolve

COMMIT = "0123456789abcdef0123456789abcdef01234567"
ROOT = Path(__file__).parents[1]


@pytest.fixture(autouse=True)
def hub(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache, offline, whose endpoint refuses connections should a test go online."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    return tmp_path / "hub-cache"


def cached_snapshot(cache: Path, repository: str) -> Path:
    """The folder of ``repository``'s snapshot in the cache, laid out as huggingface_hub writes it."""
    repo = cache / f"models--{repository.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    folder = repo / "snapshots" / COMMIT
    folder.mkdir(parents=True)
    return folder


def test_a_timm_hub_name_is_read_from_huggingface_hubs_cache_offline(hub):
    """A timm hub repository (model.safetensors in timm's names) found in the cache while offline: timm's logits."""
    torch.manual_seed(0)
    args = dict(img_size=16, patch_size=4, in_chans=1, num_classes=3, embed_dim=16, depth=1, num_heads=2)
    theirs = timm.models.VisionTransformer(**args).eval()
    save_file(theirs.state_dict(), str(cached_snapshot(hub, "timm/vit_tiny_test.attnlab") / "model.safetensors"))
    ours = ImageClassifier(**args, init_from="timm/vit_tiny_test.attnlab").eval()
    x = torch.randn(2, 1, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)


def test_a_hub_name_the_cache_lacks_is_refused_as_huggingface_hub_decides(monkeypatch):
    with pytest.raises(ValueError) as offline:
        resolve("attnlab-tests/nothing", "model.init_from", "a path", ["*.json"])
    assert str(offline.value) == (
        "model.init_from=attnlab-tests/nothing: not a local path, and offline (HF_HUB_OFFLINE=1) the Hugging Face "
        "cache does not hold it; set HF_HUB_OFFLINE=0 to download it, or give a local folder instead "
        "(where online: `hf download attnlab-tests/nothing --local-dir DIR`, then model.init_from=DIR)"
    )
    # huggingface_hub's constant, not the environment variable (HF_HUB_OFFLINE=1 here), says whether it is offline
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    with pytest.raises(ValueError, match=r"does not hold it and the hub cannot be reached \(.*\), or give a local"):
        resolve("attnlab-tests/nothing", "model.init_from", "a path", ["*.json"])


def test_paths_and_local_only_settings_are_never_hub_names(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"^key: .*/no/such.pth does not exist \(a path\)$"):
        resolve(str(tmp_path / "no/such.pth"), "key", "a path", ["*.json"])
    with pytest.raises(FileNotFoundError, match=r"^key: owner/name does not exist \(a local file\)$"):
        resolve("owner/name", "key", "a local file", hub_files=None)
    with pytest.raises(FileNotFoundError, match=r"owner/name.pth does not exist"):
        resolve("owner/name.pth", "key", "a path", ["*.json"])


def test_read_state_unwraps_and_strips_and_refuses_what_is_not_a_state_dict(tmp_path):
    weight = torch.ones(2)
    torch.save({"state_dict": {"module.model.w": weight}, "epoch": 3}, tmp_path / "a.ckpt")
    assert read_state(tmp_path / "a.ckpt", "key").keys() == {"model.w"}
    torch.save({"model": {"w": weight}, "args": None}, tmp_path / "b.pth")
    assert read_state(tmp_path / "b.pth", "key").keys() == {"w"}
    torch.save([weight], tmp_path / "list.pth")
    with pytest.raises(ValueError, match=f"^key: {tmp_path / 'list.pth'} does not hold a state dict of tensors$"):
        read_state(tmp_path / "list.pth", "key")
    (tmp_path / "folder").mkdir()
    with pytest.raises(FileNotFoundError, match="folder holds no weights \\(model.safetensors, pytorch_model.bin\\)"):
        read_state(tmp_path / "folder", "key")


class Tied(nn.Module):
    def __init__(self, width: int = 4):
        super().__init__()
        self.embed = nn.Embedding(5, width)
        self.out = nn.Linear(width, 5)
        self.out.weight = self.embed.weight  # one matrix, two names
        self.norm = nn.BatchNorm1d(width)


def test_load_checked_fills_tied_names_and_tolerates_batchnorm_counters():
    source, target = Tied(), Tied()
    state = {k: v for k, v in source.state_dict().items() if k not in ("out.weight", "norm.num_batches_tracked")}
    load_checked(target, state, "src", "model")
    torch.testing.assert_close(target.out.weight, source.embed.weight)
    torch.testing.assert_close(target.norm.running_mean, source.norm.running_mean)


def test_load_checked_names_the_source_and_every_kind_of_misfit_in_one_line():
    state = Tied(width=3).state_dict() | {f"extra.{i}": torch.zeros(1) for i in range(4)}
    del state["norm.bias"]
    with pytest.raises(ValueError) as err:
        load_checked(Tied(), state, "model.init_from=x.pth", "Tied", "check the width")
    assert str(err.value) == (
        "model.init_from=x.pth does not fit this Tied: embed.weight is (5, 4) in the model and (5, 3) in the file "
        "(5 tensors of another shape); the file lacks ['norm.bias']; the model lacks ['extra.0', 'extra.1', 'extra.2'] "
        "(4 in all); check the width"
    )


@pytest.mark.slow
def test_attnlab_keeps_the_hub_offline_when_the_user_does_not_set_hf_hub_offline(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env |= {"HF_HUB_CACHE": str(tmp_path), "HF_ENDPOINT": "http://127.0.0.1:9", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "experiments.cli", "fit", "--config", "configs/vision/digits.yaml"]
        + ["--model.init_args.init_from=attnlab-tests/no-such-vit", f"--trainer.default_root_dir={tmp_path}"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    assert "offline (HF_HUB_OFFLINE=1) the Hugging Face cache does not hold it" in done.stderr.strip().splitlines()[-1]
