"""EagleDataModule: real 2-process DDP (gloo, CPU) fit + validate with disjoint data per rank;
YAML configs parse; plain-script use."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml

from eagle_data.stream.config import ReadConfig
from eagle_data.stream.datamodule import EagleDataModule
from eagle_data.tools.synthetic import write_synthetic

CONFIGS = sorted((Path(__file__).parents[1] / "configs").glob("datamodule*.yaml"))


class TinyDrafter(L.LightningModule):
    def __init__(self, hidden: int, log_dir: str):
        super().__init__()
        self.lin = torch.nn.Linear(hidden, 1)
        self.log_dir = log_dir
        self.seen: dict[str, list[str]] = {"train": [], "val": []}

    def _step(self, batch, stage):
        self.seen[stage] += batch["keys"]
        h = batch["hidden_states"].float()
        m = batch["loss_mask"].float()
        loss = ((self.lin(h).squeeze(-1) * m).sum() / m.sum().clamp(min=1)) ** 2
        self.log(f"{stage}_loss", loss, sync_dist=True, batch_size=h.shape[0])
        return loss

    def training_step(self, batch, _):
        return self._step(batch, "train")

    def validation_step(self, batch, _):
        self._step(batch, "val")

    def on_fit_end(self):
        Path(self.log_dir, f"rank{self.global_rank}.json").write_text(json.dumps(self.seen))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_ddp_two_ranks_disjoint_and_complete(tmp_path):
    train, val = tmp_path / "train", tmp_path / "val"
    write_synthetic(train, [7, 6, 5])   # uneven shards: 18 samples
    write_synthetic(val, [5], rank=0)
    dm = EagleDataModule(train=str(train), val=str(val), batch_size=4, num_workers=1, pin_memory=False,
                         hidden_size=8, dtype="bfloat16")
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_fork", max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, num_sanity_val_steps=0,
                        enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(TinyDrafter(8, str(tmp_path)), datamodule=dm)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    tr = [s["train"] for s in seen]
    assert set(tr[0]).isdisjoint(tr[1]) and sorted(tr[0] + tr[1]) == [f"syn_{g:09d}" for g in range(18)]
    va = [s["val"] for s in seen]
    assert set(va[0]).isdisjoint(va[1]) and len(va[0]) + len(va[1]) == 5


def test_plain_script_epochs_and_token_budget(tmp_path):
    write_synthetic(tmp_path, [6, 6])
    dm = EagleDataModule(train=str(tmp_path), max_tokens=16, num_workers=0, pin_memory=False)
    dl = dm.train_dataloader()
    assert dl is dm.train_dataloader()
    e0 = [k for b in dl for k in b["keys"]]
    e1 = [k for b in dl for k in b["keys"]]
    assert sorted(e0) == sorted(e1) and len(e0) == 12 and e0 != e1
    dm.set_epoch(0)
    assert [k for b in dl for k in b["keys"]] == e0
    assert dm.val_dataloader() == []


@pytest.mark.parametrize("kw,name", [({"batch_size": -1}, "batch_size"), ({"batch_size": 0}, "batch_size"),
                                     ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -5}, "max_tokens"),
                                     ({"max_batch_size": 0}, "max_batch_size"),
                                     ({"bucket_window": 0}, "bucket_window"),
                                     ({"val_batch_size": 0}, "val_batch_size"),
                                     ({"num_workers": -1}, "num_workers")])
def test_bad_batching_arguments_are_refused_at_construction(tmp_path, kw, name):
    """Refused before any loader exists (not an empty epoch or a ZeroDivisionError mid-fit)."""
    with pytest.raises(ValueError, match=rf"^{name} must be .*, got {kw[name]}$"):
        EagleDataModule(train=str(tmp_path / "not-read-yet"), **kw)
    write_synthetic(tmp_path, [4])
    dm = EagleDataModule(train=str(tmp_path), val=str(tmp_path), batch_size=3, val_batch_size=1,
                         num_workers=0, pin_memory=False)
    assert [len(b["keys"]) for b in dm.val_dataloader()] == [1, 1, 1, 1]


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_configs_parse(path, tmp_path, capsys):
    """The documented uses of configs/datamodule*.yaml: a plain script, the project's
    LightningCLI (``--data FILE``), and ``eagle-data train --data FILE`` (path handed to it)."""
    from eagle_data.cli import main as cli
    from eagle_train.cli import make_cli

    write_synthetic(tmp_path, [3])
    want = [f"syn_{g:09d}" for g in range(3)]
    args = yaml.safe_load(path.read_text())
    assert EagleDataModule(**{**args, "train": str(tmp_path)}).pin_memory is torch.cuda.is_available()  # no CPU warning
    dm = EagleDataModule(**{**args, "train": str(tmp_path), "pin_memory": False})
    assert sorted(k for b in dm.train_dataloader() for k in b["keys"]) == want

    train_cfg = str(Path(__file__).parents[1] / "configs/train/smollm2_cpu.yaml")
    parsed = make_cli(args=["--config", train_cfg, "--data", str(path), "--data.train", str(tmp_path)],
                      run=False, parse_only=True).config["data"].as_dict()
    parsed.pop("__path__", None)  # jsonargparse notes which file the section came from
    assert parsed == {**args, "train": str(tmp_path)}
    dm = EagleDataModule(**{**parsed, "pin_memory": False})
    assert sorted(k for b in dm.train_dataloader() for k in b["keys"]) == want

    cfg = yaml.safe_load(Path(train_cfg).read_text()) | {"data": str(path)}  # what `eagle-data train` passes
    parsed = make_cli(args=cfg, run=False, parse_only=True).config["data"].as_dict()
    parsed.pop("__path__", None)
    assert parsed == args
    with pytest.raises(SystemExit):
        cli.main(["train", "--config", train_cfg, "--data", str(path), "--print_config"])
    assert str(path) in capsys.readouterr().out


def test_defaults_follow_the_machine(monkeypatch):
    """No pinning without CUDA (it would warn on every batch), workers from the CPU count."""
    import os

    import torch

    from eagle_data.stream.datamodule import EagleDataModule

    for cpus, want in ((2, 1), (1, 0), (64, 4), (None, 0)):
        monkeypatch.setattr(os, "cpu_count", lambda c=cpus: c)
        dm = EagleDataModule(train="unused")
        assert dm.num_workers == want and dm.pin_memory == torch.cuda.is_available()
    assert EagleDataModule(train="unused", num_workers=3, pin_memory=True).num_workers == 3


def test_one_read_config_for_dataset_loader_and_datamodule(tmp_path):
    """The reading options are declared once (ReadConfig): the DataModule's --data options are its
    fields (a command-line token budget wins over a config's batch_size), the DataModule, its
    dataset and its loader hold one config, and the dataset takes it or its fields alike."""
    import dataclasses

    from eagle_data.stream.dataset import EagleShardDataset
    from eagle_train.cli import make_cli

    write_synthetic(tmp_path, [4])
    train_cfg = str(Path(__file__).parents[1] / "configs/train/smollm2_cpu.yaml")
    parsed = make_cli(args=["--config", train_cfg, "--data.train", str(tmp_path), "--data.max_tokens", "16"],
                      run=False, parse_only=True).config["data"].as_dict()
    fields = [f.name for f in dataclasses.fields(ReadConfig)]
    assert set(fields) <= set(parsed) and parsed["batch_size"] == 1 and parsed["max_tokens"] == 16
    dm = EagleDataModule(**{**parsed, "pin_memory": False})
    read = ReadConfig(**{k: parsed[k] for k in fields})
    ds = dm.train_dataloader().dataset
    assert dm.read == read and ds.read is dm.read and ds.batch_size is None
    by_fields = EagleShardDataset(tmp_path, **{k: parsed[k] for k in fields})
    assert EagleShardDataset(tmp_path, read=read).plan_facts() == by_fields.plan_facts()
    assert EagleShardDataset(tmp_path, read=read, max_tokens=None).batch_size == 1  # keywords over read's
    with pytest.raises(ValueError, match="^on_error must be 'raise' or 'skip', got 'ignore'$"):
        EagleDataModule(train=str(tmp_path), on_error="ignore")
    with pytest.raises(TypeError, match="batch_sise"):
        EagleShardDataset(tmp_path, batch_sise=2)
