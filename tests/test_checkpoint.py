"""Checkpoints and resume without Ray or a model: the driver's Run with fake workers that save and load a tiny
nn.Linear through actor.Actor's own save_checkpoint / load_checkpoint (torch.distributed.checkpoint, one process)."""

import importlib.machinery
import json
import os
import shutil
import sys
import types

import pytest
import torch

import actor
import advantage
import run_folder
import trainer
from config import Config, OptimConfig, load_config

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
        optimizer = torch.optim.AdamW(module.parameters())
        schedule = actor.lr_schedule(optimizer, OptimConfig(lr_warmup_steps=20), training_steps=100)
        self.actor = types.SimpleNamespace(module=module, optimizer=optimizer, lr_scheduler=schedule, rank=0,
                                           sharded=False, optimizer_steps=0, lora_rank=0,
                                           cfg=types.SimpleNamespace(model=None, optim=OptimConfig()))

    def update(self):
        """One optimizer step and one LR-schedule step (warm-up: the lr of step t is 1e-3 x t / 20)."""
        a = self.actor
        a.module(torch.ones(1, 2)).sum().backward()
        a.optimizer.step()
        a.optimizer.zero_grad()
        a.lr_scheduler.step()
        a.optimizer_steps += 1

    def save(self, path, model_only):
        actor.Actor.save_checkpoint(self.actor, path, model_only=model_only)

    def load(self, path):
        actor.Actor.load_checkpoint(self.actor, path)


@pytest.fixture(autouse=True)
def no_hf_files(monkeypatch):
    monkeypatch.setattr(actor, "save_hf_files", lambda *args, **kwargs: None)  # no model path to copy from


def make_cfg(kl_type="adaptive", **trainer_keys):
    cfg = Config()
    cfg.algorithm.kl_type = kl_type
    for key, value in {"logger": ["file"], "val_freq": -1, "val_before_train": False, "save_freq": 1,
                       "save_limit": -1, **trainer_keys}.items():
        setattr(cfg.trainer, key, value)
    return cfg


def fake_run(root, cfg, training_steps=4):
    """Run.__init__'s checkpoint and resume path, with fakes for the data, the workers and a step."""
    run = object.__new__(trainer.Run)
    run.cfg, run.ckpt_root, run.training_steps = cfg, str(root), training_steps
    t = cfg.trainer
    checkpoint = run_folder.find_checkpoint(run.ckpt_root, t.load_checkpoint_path, t.find_last_checkpoint, t.val_only)
    run.logger = run_folder.Logger(run.ckpt_root, cfg.trainer.logger, cfg)
    run.train_loader, run.workers = FakeLoader(), FakeWorkers()
    if checkpoint:  # Run.__init__ loads the data's position before the workers start
        run._load_data_position(checkpoint)
    run.kl_ctrl = (advantage.AdaptiveKLController(0.1, 0.1, 10000) if cfg.algorithm.kl_type == "adaptive" else
                   advantage.FixedKLController(0.1))
    run.step, run.best = 0, {"best_global_step": None, "best_val_reward_score": None}
    run._resume(checkpoint)
    return run


def save_steps(root, steps, kl_type="adaptive", **trainer_keys):
    """Checkpoints of the given steps (each one optimizer step later), written by Run.save_checkpoint."""
    run = fake_run(root, make_cfg(kl_type, **trainer_keys))
    for step in steps:  # steps 1, 2, ...: one update each
        run.step, run.train_loader.batch = step, step
        run.workers.update()
        run.kl_ctrl.value = step / 100
        run.save_checkpoint({})
    run.logger.close()


# --- B1, B3: a checkpoint is complete or it is not used -----------------------------------------------------

BREAKS = {  # how a checkpoint is broken -> (break it, what the resume says)
    "extra_state.pt missing": (lambda p: os.remove(p / "actor" / "extra_state.pt"), "actor/extra_state.pt is missing"),
    "optim missing": (lambda p: [os.remove(f) for f in (p / "actor" / "optim").iterdir()],
                      "actor/optim/.metadata is missing"),
    "model shard truncated": (lambda p: open(p / "actor" / "model" / "__0_0.distcp", "r+b").truncate(10),
                              "actor/model/__0_0.distcp is missing or truncated"),
    "trainer_state.json missing": (lambda p: os.remove(p / "trainer_state.json"), "trainer_state.json is missing"),
    "trainer_state.json truncated": (lambda p: open(p / "trainer_state.json", "r+").truncate(5),
                                     "trainer_state.json cannot be read (JSONDecodeError"),
    "dataloader.pt missing": (lambda p: os.remove(p / "dataloader.pt"), "dataloader.pt is missing"),
    "dataloader.pt truncated": (lambda p: open(p / "dataloader.pt", "r+b").truncate(20),
                                "dataloader.pt cannot be read"),
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
    assert run.workers.actor.lr_scheduler.get_last_lr()[0] == pytest.approx(1e-3 * 2 / 20)  # and the LR schedule
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
    (tmp_path / run_folder.TRACKER).write_text('{"last_global_st')
    run = fake_run(tmp_path, make_cfg())
    out = capsys.readouterr().out
    assert f"{tmp_path / run_folder.TRACKER} cannot be read (JSONDecodeError" in out
    assert run.step == 2


def test_no_tracker_and_no_complete_checkpoint_is_a_fresh_start_and_with_a_tracker_an_error(tmp_path, capsys):
    save_steps(tmp_path, [1])
    os.remove(tmp_path / run_folder.TRACKER)  # the first save never finished
    break_checkpoint(tmp_path / "global_step_1", "trainer_state.json missing")
    assert run_folder.find_checkpoint(str(tmp_path), None, True) is None
    assert "none is complete (global_step_1: trainer_state.json is missing): starting afresh" in capsys.readouterr().out
    aside = next(tmp_path.glob("earlier_*"))  # not cut and deleted as its steps are saved again: moved, weights kept
    assert (aside / "global_step_1" / "actor" / "model" / ".metadata").exists() and not folders(tmp_path)
    assert [json.loads(line)["step"] for line in open(aside / "experiment_log.jsonl")] == [1]
    save_steps(tmp_path, [1])
    break_checkpoint(tmp_path / "global_step_1", "extra_state.pt missing")
    with pytest.raises(run_folder.CheckpointError, match=r"no complete checkpoint to resume from: global_step_1: "
                                                      r"actor/extra_state.pt is missing.*find_last_checkpoint=false"):
        run_folder.find_checkpoint(str(tmp_path), None, True)
    assert run_folder.find_checkpoint(str(tmp_path), None, False) is None


def test_checkpoints_without_a_tracker_resume_from_the_newest_complete_one(tmp_path, capsys):
    """global_step_N folders copied into a new save folder, or a tracker lost: before, a silent fresh start from step 1
    that later overwrote or rotated them away."""
    os.makedirs(tmp_path / "old")
    os.makedirs(tmp_path / "new")
    save_steps(tmp_path / "old", [1, 2, 3])
    for step in (2, 3):
        os.rename(tmp_path / "old" / f"global_step_{step}", tmp_path / "new" / f"global_step_{step}")
    break_checkpoint(tmp_path / "new" / "global_step_3", "dataloader.pt missing")
    run = fake_run(tmp_path / "new", make_cfg())
    out = capsys.readouterr().out
    assert run.step == 2 and run.train_loader.batch == 2 and run.workers.actor.optimizer_steps == 2
    assert f"{tmp_path / 'new' / run_folder.TRACKER} is missing; looking for the newest complete checkpoint" in out
    assert f"resuming from {tmp_path / 'new' / 'global_step_2'}, the newest complete checkpoint; skipped: " \
           f"global_step_3: dataloader.pt is missing" in out, out


def test_a_fresh_start_moves_checkpoints_without_a_tracker_aside_too(tmp_path):
    save_steps(tmp_path, [1, 2])
    os.remove(tmp_path / run_folder.TRACKER)
    save_steps(tmp_path, [1], find_last_checkpoint=False)
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("earlier_")]
    assert len(aside) == 1 and sorted(p.name for p in aside[0].glob("global_step_*")) == ["global_step_1",
                                                                                         "global_step_2"]
    assert run_folder.checkpoint_problem(str(aside[0] / "global_step_2")) is None  # untouched
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == ["global_step_1"]


def test_a_fresh_start_over_an_earlier_run_moves_its_files_aside(tmp_path):
    """find_last_checkpoint=false where a run left checkpoints: its logs, tracker and checkpoints go to earlier_<time>/
    untouched; the new run starts with empty logs and its own checkpoints (before, the logs were cut to nothing and
    the old checkpoints were overwritten or rotated away)."""
    save_steps(tmp_path, [1, 2])
    old_rows = open(tmp_path / "experiment_log.jsonl").read()
    assert old_rows.count('"step"') == 2
    save_steps(tmp_path, [1], find_last_checkpoint=False)
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("earlier_")]
    assert len(aside) == 1 and (aside[0] / "experiment_log.jsonl").read_text() == old_rows
    assert sorted(p.name for p in aside[0].glob("global_step_*")) == ["global_step_1", "global_step_2"]
    assert json.load(open(aside[0] / run_folder.TRACKER))["last_global_step"] == 2
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == ["global_step_1"]
    assert [json.loads(line)["step"] for line in open(tmp_path / "experiment_log.jsonl")] == [1]
    assert fake_run(tmp_path, make_cfg()).step == 1  # the new run's checkpoint resumes


def test_an_explicit_checkpoint_must_be_complete(tmp_path):
    save_steps(tmp_path, [1, 2])
    break_checkpoint(tmp_path / "global_step_2", "optim missing")
    path = str(tmp_path / "global_step_2")
    with pytest.raises(run_folder.CheckpointError,
                       match=r"cannot resume from .*global_step_2: actor/optim/.metadata is missing"):
        run_folder.find_checkpoint(str(tmp_path), path, True)
    assert run_folder.find_checkpoint(str(tmp_path), str(tmp_path / "global_step_1"), True).endswith("global_step_1")
    with pytest.raises(run_folder.CheckpointError, match="must be an existing global_step_N folder"):
        run_folder.find_checkpoint(str(tmp_path), str(tmp_path / "global_step_7"), True)


def test_a_save_model_only_checkpoint_is_not_resumed(tmp_path):
    save_steps(tmp_path, [1], save_model_only=True)
    with pytest.raises(run_folder.CheckpointError, match="save_model_only=true .* merge.py"):
        run_folder.find_checkpoint(str(tmp_path), None, True)


def test_the_actor_refuses_a_checkpoint_without_optimizer_or_extra_state(tmp_path):
    save_steps(tmp_path, [1])
    break_checkpoint(tmp_path / "global_step_1", "optim missing")
    os.rmdir(tmp_path / "global_step_1" / "actor" / "optim")
    break_checkpoint(tmp_path / "global_step_1", "extra_state.pt missing")
    with pytest.raises(FileNotFoundError, match="lacks extra_state.pt, optim"):
        FakeWorkers().load(str(tmp_path / "global_step_1" / "actor"))


def test_the_actor_refuses_another_optimizers_state_and_loads_checkpoints_without_the_key(tmp_path):
    """adamw_bf16's state has a Kahan compensation that plain AdamW's lacks: DCP's error for the missing key (a
    BaseException, past `except Exception`) named neither setting. A checkpoint written before extra_state.pt held
    the strategy loads as before."""
    save_steps(tmp_path, [1])
    workers = FakeWorkers()
    workers.actor.cfg.optim.strategy = "adamw_bf16"
    with pytest.raises(ValueError, match="optim.strategy=adamw, this run has optim.strategy=adamw_bf16: resume with"):
        workers.load(str(tmp_path / "global_step_1" / "actor"))
    extra_path = tmp_path / "global_step_1" / "actor" / "extra_state.pt"
    extra = torch.load(extra_path, weights_only=True)
    assert extra.pop("optim_strategy") == "adamw"
    torch.save(extra, extra_path)
    FakeWorkers().load(str(tmp_path / "global_step_1" / "actor"))


def test_checkpoints_are_checked_before_ray_starts(tmp_path, toy, monkeypatch):
    save_steps(tmp_path, [1])
    break_checkpoint(tmp_path / "global_step_1", "trainer_state.json truncated")

    def no_ray(*args):
        raise AssertionError("Ray started before the checkpoint was checked")

    monkeypatch.setattr(trainer, "WorkerGroup", no_ray)
    cfg = load_config(None, [f"data.train_files={toy['colors']}@train", f"data.val_files={toy['colors']}@test",
                                     f"worker.actor.model.model_path={toy['vl_model']}", "trainer.logger=[file]",
                                     f"trainer.save_checkpoint_path={tmp_path}"])
    with pytest.raises(run_folder.CheckpointError, match="global_step_1: trainer_state.json cannot be read"):
        trainer.Run(cfg)


def test_another_data_config_is_a_one_line_checkpoint_error_before_ray_starts(tmp_path, toy, monkeypatch, capsys):
    """Resumed with another data.rollout_batch_size: the loader's ValueError came after Ray started and the model
    loaded (minutes for a 7B model), as a traceback."""
    save_steps(tmp_path, [1])
    torch.save({"epoch": 0, "batch": 1, "batch_size": 8}, tmp_path / "global_step_1" / "dataloader.pt")
    (tmp_path / "experiment_config.json").write_text('{"data": {"rollout_batch_size": 512}}')  # the run's
    monkeypatch.setattr(trainer, "WorkerGroup", lambda *args: pytest.fail("Ray started before the data was checked"))
    code = trainer.main([f"data.train_files={toy['colors']}@train", f"data.val_files={toy['colors']}@test",
                         f"worker.actor.model.model_path={toy['vl_model']}", "trainer.logger=[file]",
                         f"trainer.save_checkpoint_path={tmp_path}", "data.rollout_batch_size=4",
                         "worker.actor.global_batch_size=2"])
    err = [line for line in capsys.readouterr().err.splitlines()  # without datasets' progress bars (a fresh cache)
           if line.strip() and "Generating" not in line]
    assert code == 2 and len(err) == 1, err  # the one line, not a traceback
    assert err[0].startswith(f"checkpoint error: cannot resume from {tmp_path / 'global_step_1'}: ")
    assert "saved with batch_size=8, now it is 4" in err[0] and "Keep data.rollout_batch_size" in err[0]
    assert "find_last_checkpoint=false" in err[0]
    saved = json.load(open(tmp_path / "experiment_config.json"))  # the config that trained, not the refused one's
    assert saved["data"]["rollout_batch_size"] == 512, "a refused resume overwrote experiment_config.json"


# --- B2 and the loop: after a kill at any point and a resume, each step's row once, in order ----------------

class Kill(BaseException):
    """A SIGKILL: nothing after it runs (not an Exception, so nothing catches it)."""


def run_loop(root, run_id, training_steps=6, save_freq=2, seen=None, logger=("file",), **trainer_keys):
    """Run.fit with a fake step that logs {"run": run_id} and records the step counter it ran at."""
    run = fake_run(root, make_cfg(save_freq=save_freq, logger=list(logger), **trainer_keys), training_steps)
    run.validate = lambda: {"val/reward_score": 0.0}

    def train_step():
        if seen is not None:
            seen.append(run.step)
        return {"run": run_id}

    run.train_step = train_step
    try:
        run.fit()
    finally:
        run.logger.close()
    return run


def kill_at(monkeypatch, when, step):
    """Patch the loop to die at `when` in step `step` of a run with checkpoints every 2 steps."""
    write, remove_old, log = trainer.write_atomic, trainer.remove_old_checkpoints, run_folder.Logger.log

    def write_then_die(path, text):
        saved = json.loads(text) if path.endswith(("trainer_state.json", run_folder.TRACKER)) else {}
        if when == "before trainer_state.json" and path.endswith("trainer_state.json") and saved["global_step"] == step:
            raise Kill
        if when == "before the tracker" and path.endswith(run_folder.TRACKER) and saved["last_global_step"] == step:
            raise Kill
        write(path, text)

    def remove_old_then_die(root, last, *args):
        remove_old(root, last, *args)
        if when == "after the tracker" and last == step:
            raise Kill

    def log_then_die(self, metrics, at):
        if at == step and when == "mid-line":
            self.jsonl.write('{"step": %d, "ru' % at)
            self.jsonl.flush()
            raise Kill
        log(self, metrics, at)
        if at == step and when == "after the row":
            raise Kill

    monkeypatch.setattr(trainer, "write_atomic", write_then_die)
    monkeypatch.setattr(trainer, "remove_old_checkpoints", remove_old_then_die)
    monkeypatch.setattr(run_folder.Logger, "log", log_then_die)


@pytest.mark.parametrize("when, step, resumed", [
    ("after the row", 3, 2),  # between checkpoints: row 3 is written again by the resumed run
    ("mid-line", 3, 2),  # a row cut short
    ("after the row", 4, 2),  # a checkpoint step: the row is on disk, the checkpoint not yet complete
    ("before trainer_state.json", 4, 2),
    ("before the tracker", 4, 2),  # the checkpoint is complete, the tracker still names step 2
    ("after the tracker", 4, 4),  # the checkpoint counts: its row must be in the log
])
def test_after_a_kill_and_a_resume_the_log_holds_each_step_once_in_order(tmp_path, monkeypatch, when, step, resumed):
    with monkeypatch.context() as patch:
        kill_at(patch, when, step)
        with pytest.raises(Kill):
            run_loop(tmp_path, run_id=1)
    seen = []
    run = run_loop(tmp_path, run_id=2, seen=seen)
    assert seen == list(range(resumed + 1, 7)) and run.step == 6  # the step counter continues after the checkpoint
    rows = [json.loads(line) for line in open(tmp_path / "experiment_log.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["run"] for r in rows] == [1] * resumed + [2] * (6 - resumed)  # the resumed steps from the resumed run
    assert all("timing_s/save_checkpoint" in r for r in rows if r["step"] % 2 == 0)


class TensorBoardView:
    """What TensorBoard shows of a log folder: (step, tag) -> value. A writer opened with purge_step hides the events
    that earlier writers wrote at steps >= purge_step (torch's SummaryWriter docstring); a stand-in for the package."""

    def __init__(self):
        self.events = []  # (step, tag, value)

    def SummaryWriter(self, log_dir, purge_step=None):
        if purge_step is not None:
            self.events = [e for e in self.events if e[0] < purge_step]
        return types.SimpleNamespace(add_scalar=lambda tag, value, step: self.events.append((step, tag, value)),
                                     close=lambda: None)


def test_after_a_kill_and_a_resume_tensorboard_shows_each_step_once(tmp_path, monkeypatch):
    view = TensorBoardView()
    for name, module in (("tensorboard", types.ModuleType("tensorboard")),
                         ("torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=view.SummaryWriter))):
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        monkeypatch.setitem(sys.modules, name, module)
    with monkeypatch.context() as patch:
        kill_at(patch, "after the row", 3)  # steps 1-3 logged, the checkpoint of step 2 is the last one
        with pytest.raises(Kill):
            run_loop(tmp_path, run_id=1, logger=("file", "tensorboard"))
    run_loop(tmp_path, run_id=2, logger=("file", "tensorboard"))
    runs = sorted((step, value) for step, tag, value in view.events if tag == "run")
    assert runs == [(1, 1.0), (2, 1.0), (3, 2.0), (4, 2.0), (5, 2.0), (6, 2.0)]  # step 3 once, from the resumed run


def test_a_run_resumed_from_another_runs_checkpoint_and_run_again_logs_each_step_once(tmp_path, capsys):
    """trainer.load_checkpoint_path into another run's folder, the command run twice: this run's log held steps
    3, 4, 3, 4 (it was cut back only for a checkpoint in its own folder). The second time a warning says that this
    folder holds a later complete checkpoint."""
    os.makedirs(tmp_path / "a")
    os.makedirs(tmp_path / "b")
    save_steps(tmp_path / "a", [1, 2])
    for run_id in (1, 2):
        run_loop(tmp_path / "b", run_id, training_steps=4, load_checkpoint_path=str(tmp_path / "a" / "global_step_2"))
    rows = [json.loads(line) for line in open(tmp_path / "b" / "experiment_log.jsonl")]
    assert [(r["step"], r["run"]) for r in rows] == [(3, 2), (4, 2)]
    out = capsys.readouterr().out
    assert out.count("warning") == 1 and f"warning: {tmp_path / 'b'} holds global_step_4, a complete checkpoint " \
                                          f"later than trainer.load_checkpoint_path={tmp_path / 'a'}" in out, out


def test_a_resume_from_another_folders_checkpoint_sets_this_folders_whole_run_aside(tmp_path, capsys):
    """load_checkpoint_path=a/global_step_4 into b, which holds its own run of steps 1 and 2: b's checkpoints, tracker
    and log rows (another run's) stayed, the rows under the resumed run's, the folders for rotation to remove and the
    tracker naming b's step 2 for a plain resume. Now all go aside together, the logs as a copy, and b's log holds the
    resumed run's rows alone."""
    os.makedirs(tmp_path / "a")
    os.makedirs(tmp_path / "b")
    save_steps(tmp_path / "a", [4])
    run_loop(tmp_path / "b", run_id=1, training_steps=2, save_freq=1)
    run_loop(tmp_path / "b", run_id=2, training_steps=6, save_freq=1, save_limit=2,
             load_checkpoint_path=str(tmp_path / "a" / "global_step_4"))
    assert "another folder's checkpoint: this folder's run goes aside" in capsys.readouterr().out
    (aside,) = [p for p in (tmp_path / "b").iterdir() if p.name.startswith("earlier_")]
    assert folders(aside) == [1, 2] and json.load(open(aside / run_folder.TRACKER))["last_global_step"] == 2
    assert [json.loads(line)["run"] for line in open(aside / "experiment_log.jsonl")] == [1, 1]
    rows = [json.loads(line) for line in open(tmp_path / "b" / "experiment_log.jsonl")]
    assert [(r["step"], r["run"]) for r in rows] == [(5, 2), (6, 2)] and folders(tmp_path / "b") == [5, 6]


def test_a_resume_from_an_older_checkpoint_sets_the_later_ones_aside_so_a_plain_resume_agrees(tmp_path, capsys):
    """load_checkpoint_path=global_step_1 with steps 2, 3 saved, stopped before its next save: the logs were cut to step
    1, but the tracker still said 3, so a plain resume went on from 3 without rows 2 and 3. Now 2 and 3 move aside."""
    run_loop(tmp_path, run_id=1, training_steps=3, save_freq=1)
    shutil.copytree(tmp_path / "global_step_3", tmp_path / "global_step_4", ignore=lambda *_: ["trainer_state.json"])
    fake_run(tmp_path, make_cfg(load_checkpoint_path=str(tmp_path / "global_step_1"))).logger.close()  # stopped
    assert f"resuming from {tmp_path / 'global_step_1'}: the later steps run again: global_step_2, global_step_3 " \
           f"moved from {tmp_path} to {tmp_path}/earlier_" in capsys.readouterr().out
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("earlier_")]
    assert len(aside) == 1 and folders(aside[0]) == [2, 3] and folders(tmp_path) == [1, 4]  # 4: a save cut short
    assert run_folder.checkpoint_problem(str(aside[0] / "global_step_3")) is None
    assert json.load(open(tmp_path / run_folder.TRACKER))["last_global_step"] == 1
    assert run_loop(tmp_path, run_id=2, training_steps=3, save_freq=1).step == 3  # a plain resume
    rows = [json.loads(line) for line in open(tmp_path / "experiment_log.jsonl")]
    assert [(r["step"], r["run"]) for r in rows] == [(1, 1), (2, 2), (3, 2)]


def test_validating_an_older_checkpoint_leaves_the_run_as_it_is(tmp_path, capsys):
    """val_only with load_checkpoint_path=global_step_1 cut the logs back to step 1, though nothing runs again."""
    run_loop(tmp_path, run_id=1, training_steps=3, save_freq=1)
    run = fake_run(tmp_path, make_cfg(val_only=True, load_checkpoint_path=str(tmp_path / "global_step_1")), 3)
    run.validate = lambda: {"val/reward_score": 0.5}
    assert run.fit() == {"val/reward_score": 0.5}
    run.logger.close()
    rows = [json.loads(line) for line in open(tmp_path / "experiment_log.jsonl")]
    assert [(r["step"], r["run"], r.get("val/reward_score")) for r in rows] == [(1, 1, 0.5), (2, 1, None), (3, 1, 0.0)]
    assert folders(tmp_path) == [1, 2, 3] and json.load(open(tmp_path / run_folder.TRACKER))["last_global_step"] == 3
    assert "dropped" not in capsys.readouterr().out


def test_a_resume_with_no_step_left_says_so(tmp_path, capsys):
    run_loop(tmp_path, run_id=1, training_steps=4)
    run = run_loop(tmp_path, run_id=2, training_steps=4)
    assert run.step == 4 and "step 4 of 4 done: nothing left to train" in capsys.readouterr().out


def test_a_kill_before_the_first_checkpoint_starts_the_log_afresh(tmp_path, monkeypatch):
    with monkeypatch.context() as patch:
        kill_at(patch, "after the row", 1)
        with pytest.raises(Kill):
            run_loop(tmp_path, run_id=1, save_freq=2)
    run_loop(tmp_path, run_id=2)
    rows = [json.loads(line) for line in open(tmp_path / "experiment_log.jsonl")]
    assert [(r["step"], r["run"]) for r in rows] == [(s, 2) for s in range(1, 7)]


# --- Checkpoint rotation: save_limit, the best checkpoint kept ----------------------------------------------

@pytest.mark.parametrize("failing", ["workers", "row", "tracker"])
def test_a_failed_save_names_the_free_space_and_keeps_the_last_checkpoint(tmp_path, monkeypatch, failing):
    """torch.save on a full disk fails as "unexpected pos 704 vs 598", the step's log row and the tracker's write as
    ENOSPC: the error names the step, the folder and the free space; the earlier checkpoint still resumes."""
    save_steps(tmp_path, [1])
    run, write = fake_run(tmp_path, make_cfg()), trainer.write_atomic

    def full_disk(*args, **kwargs):
        if failing == "tracker" and not args[0].endswith(run_folder.TRACKER):
            return write(*args, **kwargs)  # trainer_state.json, written before the tracker
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") \
            if failing == "workers" else OSError(28, "No space left on device")

    where = {"workers": (run.workers, "save"), "row": (run.logger, "log"), "tracker": (trainer, "write_atomic")}
    monkeypatch.setattr(*where[failing], full_disk)
    run.step = 2
    with pytest.raises(RuntimeError, match=r"checkpoint of step 2 to .*global_step_2 failed with [0-9.]+ GiB free "
                                           r"on its disk; the last complete checkpoint is still there: .*(unex|No sp)"):
        run.save_checkpoint({})
    run.logger.close()
    assert fake_run(tmp_path, make_cfg()).step == 1


def test_rotation_and_a_step_saved_again_keep_what_merge_py_wrote_in_the_folder(tmp_path, capsys):
    """merge.py's actor/merged in step 1 and an --output beside it, actor/adapter in step 3: save_limit's rotation and
    the save of step 3 again (a resumed run reaching it once more) deleted them with the checkpoint, without a word.
    Rotation keeps them in place; a step saved again moves its earlier weights' output aside (it is stale there)."""
    def write(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "w").write("kept")

    run = fake_run(tmp_path, make_cfg(save_limit=1))
    for step in (1, 2, 3):
        run.step = step
        run.save_checkpoint({})
        if step == 1:
            write(tmp_path / "global_step_1" / "actor" / "merged" / "model.safetensors")
            write(tmp_path / "global_step_1" / "export" / "config.json")  # merge.py --output global_step_1/export
    write(tmp_path / "global_step_3" / "actor" / "adapter" / "adapter_model.safetensors")
    run.save_checkpoint({})  # step 3 again
    run.logger.close()
    assert folders(tmp_path) == [1, 3]  # step 2 went whole
    assert sorted(str(p.relative_to(tmp_path / "global_step_1")) for p in (tmp_path / "global_step_1").rglob("*")
                  if p.is_file()) == ["actor/merged/model.safetensors", "export/config.json"]
    (aside,) = [n for n in os.listdir(tmp_path) if n.startswith("earlier_")]
    assert (tmp_path / aside / "global_step_3/actor/adapter/adapter_model.safetensors").read_text() == "kept"
    assert run_folder.checkpoint_problem(str(tmp_path / "global_step_3")) is None
    out = capsys.readouterr().out
    assert out.count(f"{tmp_path / 'global_step_1'}: removing the checkpoint but keeping what else is there: "
                     f"actor/merged, export") == 1, out
    assert f"{tmp_path / 'global_step_3'}: removing the checkpoint but keeping what else is there: actor/adapter" in out


def folders(root):
    return sorted(int(n.split("_")[-1]) for n in os.listdir(root) if n.startswith("global_step_"))


def saved_folder(path):
    """A step folder as rotation sees a finished save: its trainer_state.json, written last."""
    os.makedirs(path)
    (path / "trainer_state.json").write_text("{}")


def test_rotation_keeps_the_newest_and_the_best(tmp_path):
    for step in (5, 10, 15, 20, 25, 30):
        saved_folder(tmp_path / f"global_step_{step}")
    run_folder.remove_old_checkpoints(str(tmp_path), 30, 10, 3)  # EasyR1's own case: keeps 10, 25 and 30
    assert folders(tmp_path) == [10, 25, 30]
    run_folder.remove_old_checkpoints(str(tmp_path), 30, None, 2)
    assert folders(tmp_path) == [25, 30]
    run_folder.remove_old_checkpoints(str(tmp_path), 30, None, -1)  # save_limit <= 0 keeps all
    assert folders(tmp_path) == [25, 30]
    for step in (35, 40):  # 40: a stopped run's later folder, not counted toward the limit and not removed
        saved_folder(tmp_path / f"global_step_{step}")
    run_folder.remove_old_checkpoints(str(tmp_path), 35, None, 2)
    assert folders(tmp_path) == [30, 35, 40]


def test_save_limit_and_the_best_validation_score_across_a_resume(tmp_path):
    """Scores 0.1, 0.9, 0.2, 0.3 at steps 1-4 with save_limit 2: step 2 (the best) and the newest remain; the
    best comes back with the resume, so step 5 (0.5) does not displace it."""
    run = fake_run(tmp_path, make_cfg(save_limit=2))
    for step, score, remain in zip(range(1, 5), (0.1, 0.9, 0.2, 0.3), ([1], [1, 2], [2, 3], [2, 4])):
        run.step = step
        run.save_checkpoint({"val/reward_score": score})
        assert folders(tmp_path) == remain
    run.logger.close()
    assert json.load(open(tmp_path / run_folder.TRACKER)) == {"last_global_step": 4, "best_global_step": 2,
                                                          "best_val_reward_score": 0.9}
    run = fake_run(tmp_path, make_cfg(save_limit=2))
    assert run.step == 4 and run.best == {"best_global_step": 2, "best_val_reward_score": 0.9}
    run.step = 5
    run.save_checkpoint({"val/reward_score": 0.5})
    run.logger.close()
    assert folders(tmp_path) == [2, 5]


# --- B7: checkpoint files load as data (weights_only) ------------------------------------------------------

class Payload:
    """Unpickled, it creates a file: code that a checkpoint file must not be able to run."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def test_extra_state_and_dataloader_state_load_as_data_only(tmp_path):
    save_steps(tmp_path, [1])
    step = tmp_path / "global_step_1"
    marker = tmp_path / "code_ran"
    extra = torch.load(step / "actor" / "extra_state.pt", weights_only=True)  # what save_checkpoint writes loads so
    torch.save({**extra, "rng": {**extra["rng"], "python": Payload(str(marker))}}, step / "actor" / "extra_state.pt")
    with pytest.raises(Exception, match="Weights only load failed"):
        FakeWorkers().load(str(step / "actor"))
    assert not marker.exists()
    os.makedirs(tmp_path / "b")
    save_steps(tmp_path / "b", [1])
    step = tmp_path / "b" / "global_step_1"
    torch.save({"batch": Payload(str(marker))}, step / "dataloader.pt")
    run = object.__new__(trainer.Run)  # _resume alone, past the check that would skip this checkpoint
    run.cfg, run.ckpt_root, run.workers, run.train_loader = make_cfg(), str(tmp_path / "b"), FakeWorkers(), FakeLoader()
    run.kl_ctrl, run.best = advantage.FixedKLController(0.1), {"best_global_step": None, "best_val_reward_score": None}
    with pytest.raises(Exception, match="Weights only load failed"):
        run._load_data_position(str(step))
    assert not marker.exists()
    assert "dataloader.pt cannot be read (UnpicklingError" in run_folder.checkpoint_problem(str(step))


def test_the_command_line_says_a_checkpoint_error_in_one_line(tmp_path, capsys):
    """python trainer.py ... trainer.load_checkpoint_path=<missing>: exit code 2 and one line saying what to change,
    found before Ray starts (no traceback)."""
    code = trainer.main(["trainer.logger=[file]", f"trainer.save_checkpoint_path={tmp_path}",
                         f"trainer.load_checkpoint_path={tmp_path / 'global_step_7'}"])
    err = [line for line in capsys.readouterr().err.splitlines()  # without datasets' progress bars
           if line.strip() and "Generating" not in line]
    assert code == 2 and len(err) == 1 and err[0].startswith("checkpoint error: trainer.load_checkpoint_path=")


# --- Rotation edge cases, the best checkpoint on a tie, rewind of generations.log ---------------------------

def test_save_limit_zero_keeps_every_checkpoint(tmp_path):
    for step in (1, 2, 3):
        os.makedirs(tmp_path / f"global_step_{step}")
    run_folder.remove_old_checkpoints(str(tmp_path), 3, 1, 0)  # <= 0: keep all (as -1), not "keep only step and best"
    assert folders(tmp_path) == [1, 2, 3]


def test_a_hand_made_zero_padded_step_folder_is_left_alone(tmp_path):
    """global_step_007 is not a folder trainer.py writes (it would be global_step_7): rotation neither counts it
    toward save_limit nor removes it, and it is not a checkpoint to resume from."""
    for name in ("global_step_1", "global_step_2", "global_step_007"):
        saved_folder(tmp_path / name)
    run_folder.remove_old_checkpoints(str(tmp_path), 9, None, 3)  # step 9 (being saved), 2 and 1: the newest 3
    assert sorted(os.listdir(tmp_path)) == ["global_step_007", "global_step_1", "global_step_2"]
    assert run_folder.saved_steps(str(tmp_path)) == [1, 2]


def test_the_best_checkpoint_is_the_first_to_reach_the_top_score(tmp_path):
    """Steps 1-5 scored -, 0.5, 0.5, -, 0.4 (-: no validation): no best before the first validation; then step 2,
    which the tie at step 3 does not displace, nor a step without validation."""
    run = fake_run(tmp_path, make_cfg(save_limit=2))
    for step, score, best in zip(range(1, 6), (None, 0.5, 0.5, None, 0.4), (None, 2, 2, 2, 2)):
        run.step = step
        run.save_checkpoint({} if score is None else {"val/reward_score": score})
        assert run.best == {"best_global_step": best, "best_val_reward_score": best and 0.5}, step
    run.logger.close()
    assert folders(tmp_path) == [2, 5]  # save_limit 2: the best and the newest


def test_rewind_cuts_generations_log_back_too(tmp_path, capsys):
    """generations.log rows of steps 1, 2, 3 and one cut short: rewind(2) keeps those of steps 1 and 2 (they are in
    the checkpoint; step 3 runs again and logs its generations again)."""
    cfg = load_config(None, ["trainer.logger=[file]"])
    logger = run_folder.Logger(str(tmp_path), cfg.trainer.logger, cfg)
    for step in (1, 2, 3):
        logger.log_generations([{"prompt": "p", "response": f"r{step}", "ground_truth": "g", "score": 1.0}], step)
    logger.generations.write('{"step": 4, "pro')  # killed while writing
    logger.generations.flush()
    logger.rewind(2)
    logger.close()
    assert [json.loads(line)["response"] for line in open(tmp_path / "generations.log")] == ["r1", "r2"]
    assert "generations.log: dropped 2 lines of the steps that run again" in capsys.readouterr().out
    logger = run_folder.Logger(str(tmp_path), cfg.trainer.logger, cfg)
    logger.rewind(2, generations=1)  # a resume at step 2 that validates first: step 2's rows are logged again
    logger.close()
    assert [json.loads(line)["response"] for line in open(tmp_path / "generations.log")] == ["r1"]


def test_a_failed_step_keeps_the_reward_functions_traceback(tmp_path):
    """fit's 'training stopped at step N' kept only the message (from None): the reward function's own traceback,
    chained by reward.py, was gone, so a KeyError in it could not be found in the user's file."""
    run = fake_run(tmp_path, make_cfg(save_freq=-1))
    user_error = KeyError("missing_key_in_user_code")

    def train_step():
        if run.step == 2:
            raise RuntimeError("reward function 'mine.py:main' raised KeyError on sample 3") from user_error
        return {"run": 1}

    run.train_step = train_step
    with pytest.raises(RuntimeError, match="training stopped at step 2: reward function 'mine.py:main'") as caught:
        run.fit()
    run.logger.close()
    assert caught.value.__cause__ is user_error
    assert [json.loads(line)["step"] for line in open(tmp_path / "experiment_log.jsonl")] == [1]
