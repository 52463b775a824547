"""Checkpoints and resume without Ray or a model: the driver's Run with fake workers that save and load a tiny
nn.Linear through actor.Actor's own save_checkpoint / load_checkpoint (torch.distributed.checkpoint, one process)."""

import json
import os
import types

import pytest
import torch

import actor
import advantage
import trainer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process


class FakeLoader:
    """The train loader's state is the number of batches taken."""

    def __init__(self):
        self.batch = 0

    def state_dict(self):
        return {"batch": self.batch}

    def load_state_dict(self, state):
        self.batch = state["batch"]

    def __iter__(self):
        while True:
            self.batch += 1
            yield [{"batch": self.batch}]


class FakeWorkers:
    """One worker's actor: an nn.Linear and its AdamW, saved and loaded by actor.Actor's methods."""

    def __init__(self):
        module = torch.nn.Linear(2, 2)
        self.actor = types.SimpleNamespace(module=module, optimizer=torch.optim.AdamW(module.parameters()), rank=0,
                                           sharded=False, optimizer_steps=0, total_optimizer_steps=10, lora_rank=0,
                                           cfg=types.SimpleNamespace(model=None))

    def save(self, path, model_only):
        actor.Actor.save_checkpoint(self.actor, path, model_only=model_only)

    def load(self, path):
        actor.Actor.load_checkpoint(self.actor, path)


@pytest.fixture(autouse=True)
def no_hf_files(monkeypatch):
    monkeypatch.setattr(actor, "save_hf_files", lambda *args, **kwargs: None)  # no model path to copy from


def make_cfg(**trainer_keys):
    cfg = trainer.Config()
    for key, value in {"logger": ["file"], "val_freq": -1, "val_before_train": False, "save_freq": 1,
                       "save_limit": -1, **trainer_keys}.items():
        setattr(cfg.trainer, key, value)
    return cfg


def fake_run(root, cfg, training_steps=4):
    """Run.__init__'s checkpoint and resume path, with fakes for the data, the workers and a step."""
    run = object.__new__(trainer.Run)
    run.cfg, run.ckpt_root, run.training_steps = cfg, str(root), training_steps
    checkpoint = trainer._find_checkpoint(run.ckpt_root, cfg.trainer.load_checkpoint_path, cfg.trainer.find_last_checkpoint)
    run.logger = trainer.Logger(run.ckpt_root, cfg.trainer.logger, cfg)
    run.train_loader, run.workers = FakeLoader(), FakeWorkers()
    run.kl_ctrl = advantage.FixedKLController(0.1)
    run.step, run.best = 0, {"best_global_step": None, "best_val_reward_score": None}
    run._resume(checkpoint)
    return run


def save_steps(root, steps, **trainer_keys):
    """Checkpoints of the given steps (each one optimizer step later), written by Run.save_checkpoint."""
    run = fake_run(root, make_cfg(**trainer_keys))
    for step in steps:
        run.step, run.train_loader.batch = step, step
        run.workers.actor.optimizer_steps = step
        run.kl_ctrl.value = step / 100
        run.save_checkpoint(None)
    run.logger.close()


# ----------------------------------------------------------------------------------------------
# B1, B3: a checkpoint is complete or it is not used
# ----------------------------------------------------------------------------------------------

BREAKS = {  # how a checkpoint is broken -> (break it, what the resume says)
    "extra_state.pt missing": (lambda p: os.remove(p / "actor" / "extra_state.pt"), "actor/extra_state.pt is missing"),
    "optim missing": (lambda p: [os.remove(f) for f in (p / "actor" / "optim").iterdir()], "actor/optim is missing"),
    "model shard truncated": (lambda p: open(p / "actor" / "model" / "__0_0.distcp", "r+b").truncate(10),
                              "actor/model/__0_0.distcp is missing or truncated"),
    "trainer_state.json missing": (lambda p: os.remove(p / "trainer_state.json"), "trainer_state.json is missing"),
    "trainer_state.json truncated": (lambda p: open(p / "trainer_state.json", "r+").truncate(5),
                                     "trainer_state.json cannot be read (JSONDecodeError"),
    "dataloader.pt missing": (lambda p: os.remove(p / "dataloader.pt"), "dataloader.pt is missing"),
    "dataloader.pt truncated": (lambda p: open(p / "dataloader.pt", "r+b").truncate(20), "dataloader.pt cannot be read"),
}


def break_checkpoint(path, how):
    BREAKS[how][0](path)


@pytest.mark.parametrize("how", list(BREAKS))
def test_an_incomplete_last_checkpoint_falls_back_to_the_newest_complete_one(tmp_path, capsys, how):
    save_steps(tmp_path, [1, 2, 3])
    break_checkpoint(tmp_path / "global_step_3", how)
    run = fake_run(tmp_path, make_cfg())
    out = capsys.readouterr().out
    assert run.step == 2 and run.train_loader.batch == 2 and run.kl_ctrl.value == 0.02
    assert run.workers.actor.optimizer_steps == 2 and run.workers.actor.optimizer.state  # the optimizer came back
    assert f"resuming from {tmp_path / 'global_step_2'}, the newest complete checkpoint; skipped: " \
           f"global_step_3: {BREAKS[how][1]}" in out, out


def test_a_checkpoint_found_complete_resumes_it_silently(tmp_path, capsys):
    save_steps(tmp_path, [1, 2])
    run = fake_run(tmp_path, make_cfg())
    assert run.step == 2 and run.workers.actor.optimizer_steps == 2 and run.kl_ctrl.value == 0.02
    assert "newest complete" not in capsys.readouterr().out


def test_a_truncated_tracker_is_reported_and_the_newest_complete_checkpoint_used(tmp_path, capsys):
    save_steps(tmp_path, [1, 2, 3])
    break_checkpoint(tmp_path / "global_step_3", "dataloader.pt missing")
    (tmp_path / trainer.TRACKER).write_text('{"last_global_st')
    run = fake_run(tmp_path, make_cfg())
    out = capsys.readouterr().out
    assert f"{tmp_path / trainer.TRACKER} cannot be read (JSONDecodeError" in out
    assert run.step == 2


def test_no_tracker_is_a_fresh_start_and_no_complete_checkpoint_an_error(tmp_path):
    save_steps(tmp_path, [1])
    os.remove(tmp_path / trainer.TRACKER)  # the first save never finished
    assert trainer._find_checkpoint(str(tmp_path), None, True) is None
    save_steps(tmp_path, [1])
    break_checkpoint(tmp_path / "global_step_1", "extra_state.pt missing")
    with pytest.raises(trainer.CheckpointError, match=r"no complete checkpoint to resume from: global_step_1: "
                                                      r"actor/extra_state.pt is missing.*find_last_checkpoint=false"):
        trainer._find_checkpoint(str(tmp_path), None, True)
    assert trainer._find_checkpoint(str(tmp_path), None, False) is None


def test_an_explicit_checkpoint_must_be_complete(tmp_path):
    save_steps(tmp_path, [1, 2])
    break_checkpoint(tmp_path / "global_step_2", "optim missing")
    path = str(tmp_path / "global_step_2")
    with pytest.raises(trainer.CheckpointError, match=r"cannot resume from .*global_step_2: actor/optim is missing"):
        trainer._find_checkpoint(str(tmp_path), path, True)
    assert trainer._find_checkpoint(str(tmp_path), str(tmp_path / "global_step_1"), True).endswith("global_step_1")
    with pytest.raises(trainer.CheckpointError, match="must be an existing global_step_N folder"):
        trainer._find_checkpoint(str(tmp_path), str(tmp_path / "global_step_7"), True)


def test_a_save_model_only_checkpoint_is_not_resumed(tmp_path):
    save_steps(tmp_path, [1], save_model_only=True)
    with pytest.raises(trainer.CheckpointError, match="save_model_only=true .* merge.py"):
        trainer._find_checkpoint(str(tmp_path), None, True)


def test_the_actor_refuses_a_checkpoint_without_optimizer_or_extra_state(tmp_path):
    save_steps(tmp_path, [1])
    break_checkpoint(tmp_path / "global_step_1", "optim missing")
    os.rmdir(tmp_path / "global_step_1" / "actor" / "optim")
    break_checkpoint(tmp_path / "global_step_1", "extra_state.pt missing")
    with pytest.raises(FileNotFoundError, match="lacks extra_state.pt, optim"):
        FakeWorkers().load(str(tmp_path / "global_step_1" / "actor"))


def test_checkpoints_are_checked_before_ray_starts(tmp_path, toy, monkeypatch):
    save_steps(tmp_path, [1])
    break_checkpoint(tmp_path / "global_step_1", "trainer_state.json truncated")

    def no_ray(*args):
        raise AssertionError("Ray started before the checkpoint was checked")

    monkeypatch.setattr(trainer, "WorkerGroup", no_ray)
    cfg = trainer.load_config(None, [f"data.train_files={toy['colors']}@train", f"data.val_files={toy['colors']}@test",
                                     f"worker.actor.model.model_path={toy['vl_model']}", "trainer.logger=[file]",
                                     f"trainer.save_checkpoint_path={tmp_path}"])
    with pytest.raises(trainer.CheckpointError, match="global_step_1: trainer_state.json cannot be read"):
        trainer.Run(cfg)
