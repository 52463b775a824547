"""run_folder.py's pieces alone: the log's amended row, the tracker and the checkpoints a resume sets aside, what
makes a checkpoint incomplete, the generations a resume that validates first cuts, the KL coefficient a resume
restores, val_only leaving the run folder as it is, rows cut short, the later-checkpoint warning, a tracker naming a
missing step, what a fresh start moves aside and what removing a checkpoint keeps. (The whole resume path, with Run
and fake workers, is in tests/test_checkpoint.py.)"""

import json
import os
import re
import shutil

import pytest
import torch
from transformers import AutoProcessor, AutoTokenizer

import actor
import data
import run_folder
import trainer
from config import load_config
from test_checkpoint import (Kill, fake_run, folders, kill_at, make_cfg, no_hf_files,  # noqa: F401 (a fixture)
                             run_loop, save_steps, saved_folder)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process


def test_amending_a_row_replaces_its_values_and_keeps_the_others(tmp_path):
    """A step validated again (a resume that validates first) has one row: the new val/reward_score, the old
    reward/overall."""
    logger = run_folder.Logger(str(tmp_path), ["file"], make_cfg())
    logger.log({"val/reward_score": 0.5, "reward/overall": 0.1}, 3)
    logger.log({"val/reward_score": 0.9}, 3, amend=True)
    logger.close()
    rows = [json.loads(line) for line in open(tmp_path / "experiment_log.jsonl")]
    assert rows == [{"step": 3, "val/reward_score": 0.9, "reward/overall": 0.1}]


def test_a_resume_sets_later_steps_aside_and_the_tracker_keeps_the_best(tmp_path, monkeypatch):
    """Resuming step 1 of this root, which holds steps 1 and 2: step 2 goes aside and the tracker names step 1 as
    the last, with the best checkpoint as it was."""
    for step in (1, 2):
        os.makedirs(tmp_path / f"global_step_{step}")
    (tmp_path / run_folder.TRACKER).write_text(json.dumps({"last_global_step": 2}))
    monkeypatch.setattr(run_folder, "checkpoint_problem", lambda path: None)  # both complete
    best = {"best_global_step": 1, "best_val_reward_score": 0.5}
    run_folder.set_aside_later(str(tmp_path), str(tmp_path / "global_step_1"), 1, best)
    assert json.loads((tmp_path / run_folder.TRACKER).read_text()) == {"last_global_step": 1, **best}
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("earlier_")]  # moved there, not deleted
    assert os.listdir(aside) == ["global_step_2"] and not (tmp_path / "global_step_2").exists()


def test_a_resume_from_another_runs_checkpoint_sets_this_roots_tracker_aside(tmp_path, monkeypatch):
    """load_checkpoint_path in another folder: this root's step 2 and its tracker (which names it) go aside
    together, into one earlier_<time>/ folder."""
    root, other = tmp_path / "root", tmp_path / "other"
    os.makedirs(root / "global_step_2")
    os.makedirs(other / "global_step_1")
    (root / run_folder.TRACKER).write_text(json.dumps({"last_global_step": 2}))
    monkeypatch.setattr(run_folder, "checkpoint_problem", lambda path: None)
    run_folder.set_aside_later(str(root), str(other / "global_step_1"), 1, {})
    (aside,) = os.listdir(root)
    assert aside.startswith("earlier_") and sorted(os.listdir(root / aside)) == [run_folder.TRACKER, "global_step_2"]


def test_a_shard_one_byte_short_or_a_state_without_kl_coef_is_incomplete(tmp_path):
    """The last item of a DCP shard cut by one byte, or a trainer_state.json without kl_coef (the resume reads it):
    the checkpoint is not complete, and the problem is named."""
    save_steps(tmp_path, [1, 2])
    shard = tmp_path / "global_step_1" / "actor" / "model" / "__0_0.distcp"
    os.truncate(shard, os.path.getsize(shard) - 1)
    assert run_folder.checkpoint_problem(str(tmp_path / "global_step_1")) == \
        "actor/model/__0_0.distcp is missing or truncated"
    (tmp_path / "global_step_2" / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    assert run_folder.checkpoint_problem(str(tmp_path / "global_step_2")) == \
        "trainer_state.json lacks global_step or kl_coef"


def test_a_resume_that_validates_first_cuts_the_resumed_steps_generations(tmp_path):
    """Resuming step 2 with val_before_train: the validation logs step 2's generations again, so generations.log
    keeps steps 0 and 1 only (experiment_log.jsonl keeps step 2's row, which the validation amends)."""
    save_steps(tmp_path, [1, 2])
    (tmp_path / "generations.log").write_text("".join(json.dumps({"step": s, "response": "r"}) + "\n"
                                                      for s in (0, 1, 2)))
    run = fake_run(tmp_path, make_cfg(val_before_train=True))
    run.logger.close()
    assert run.step == 2
    assert [json.loads(line)["step"] for line in open(tmp_path / "generations.log")] == [0, 1]


@pytest.mark.parametrize("saved, resumed, beta", [("fixed", "fixed", 0.1), ("fixed", "adaptive", 0.1),
                                                  ("adaptive", "fixed", 0.1), ("adaptive", "adaptive", 0.02),
                                                  (None, "adaptive", 0.02), (None, "fixed", 0.1)])
def test_only_an_adaptive_controller_resumes_its_beta(tmp_path, saved, resumed, beta):
    """Saved at beta 0.02: a fixed beta is the config's (0.1 here: a changed kl_coef applies after a resume), and an
    adaptive controller that follows a fixed one starts from its kl_coef, not the old fixed value. A checkpoint saved
    before kl_type was stored (None) had its beta restored whatever the type: an adaptive run resumes it still."""
    save_steps(tmp_path, [1, 2], kl_type=saved or "adaptive")
    if saved is None:
        path = tmp_path / "global_step_2" / "trainer_state.json"
        path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "kl_type"}))
    assert fake_run(tmp_path, make_cfg(kl_type=resumed)).kl_ctrl.value == beta


def test_validating_the_base_model_in_a_runs_folder_moves_nothing(tmp_path):
    """val_only with find_last_checkpoint=false validates the base model: the run's checkpoints, tracker and logs
    stay, and a plain start afterwards resumes at step 2 (they went to earlier_<time>/ and training began again).
    Validated twice, step 0 has one row, the last validation's (it had two: a step-0 row was appended each time)."""
    save_steps(tmp_path, [1, 2])
    for score in (0.25, 0.5):
        run = fake_run(tmp_path, make_cfg(val_only=True, find_last_checkpoint=False))
        run.validate = lambda: {"val/reward_score": score}
        run.fit()
        run.logger.close()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("earlier_")] and folders(tmp_path) == [1, 2]
    rows = [json.loads(line) for line in open(tmp_path / "experiment_log.jsonl")]
    assert [(r["step"], r.get("val/reward_score")) for r in rows] == [(1, None), (2, None), (0, 0.5)]
    assert fake_run(tmp_path, make_cfg()).step == 2


def test_a_row_cut_short_is_dropped_by_a_resume_and_skipped_by_an_amend(tmp_path):
    """A run killed while writing leaves a last row without its newline: a resume cuts it off (appends would
    continue inside it), and an amend of step 1 leaves the file readable row by row."""
    log = tmp_path / "experiment_log.jsonl"
    log.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a"')
    logger = run_folder.Logger(str(tmp_path), ["file"], make_cfg())
    logger.log({"b": 2.0}, 1, amend=True)
    logger.rewind(2)
    logger.log({"a": 3.0}, 2)
    logger.close()
    assert [json.loads(line) for line in open(log)] == [{"step": 1, "a": 1.0, "b": 2.0}, {"step": 2, "a": 3.0}]


def test_an_amend_of_a_step_without_a_row_replaces_a_row_cut_short(tmp_path):
    """val_only of a step the log has no row of (the base model, another run's checkpoint) after a run killed while
    writing: the new row takes the cut row's place, not appended inside it (one unreadable line)."""
    log = tmp_path / "experiment_log.jsonl"
    log.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a"')
    logger = run_folder.Logger(str(tmp_path), ["file"], make_cfg())
    logger.log({"val/x": 0.5}, 0, amend=True)
    logger.log({"a": 4.0}, 3)
    logger.close()
    assert [json.loads(line) for line in open(log)] == [{"step": 1, "a": 1.0}, {"step": 0, "val/x": 0.5},
                                                        {"step": 3, "a": 4.0}]


def test_resuming_the_newest_checkpoint_by_path_warns_of_nothing_later(tmp_path, monkeypatch, capsys):
    """load_checkpoint_path naming the newest complete one of steps 1 and 2 (3: a save cut short): no warning of a
    later checkpoint; naming step 1: the warning names step 2."""
    for step in (1, 2, 3):
        os.makedirs(tmp_path / f"global_step_{step}")
    monkeypatch.setattr(run_folder, "checkpoint_problem", lambda path: "cut short" if path.endswith("_3") else None)
    run_folder.find_checkpoint(str(tmp_path), str(tmp_path / "global_step_2"), find_last=True)
    assert "later" not in capsys.readouterr().out
    run_folder.find_checkpoint(str(tmp_path), str(tmp_path / "global_step_1"), find_last=True)
    assert "holds global_step_2, a complete checkpoint later" in capsys.readouterr().out


def test_a_tracker_naming_a_missing_step_is_said_and_the_newest_complete_one_taken(tmp_path, monkeypatch, capsys):
    for step in (1, 2):
        os.makedirs(tmp_path / f"global_step_{step}")
    (tmp_path / run_folder.TRACKER).write_text(json.dumps({"last_global_step": 5}))
    monkeypatch.setattr(run_folder, "checkpoint_problem", lambda path: None)
    assert run_folder.find_checkpoint(str(tmp_path), None, find_last=True) == str(tmp_path / "global_step_2")
    assert "global_step_5 (named by the tracker) does not exist" in capsys.readouterr().out


def test_a_fresh_start_moves_the_earlier_runs_config_aside_with_its_logs(tmp_path):
    """find_last_checkpoint=false over an earlier run: its config, logs and checkpoints go to one earlier_<time>/
    (the new run writes its own experiment_config.json; the old one is kept there)."""
    for name in ("experiment_config.json", "experiment_log.jsonl", "notes.txt"):
        (tmp_path / name).write_text("{}")
    os.makedirs(tmp_path / "global_step_3")
    assert run_folder.find_checkpoint(str(tmp_path), None, find_last=False) is None
    (aside,) = [name for name in os.listdir(tmp_path) if name.startswith("earlier_")]
    assert sorted(os.listdir(tmp_path / aside)) == ["experiment_config.json", "experiment_log.jsonl", "global_step_3"]
    assert (tmp_path / "notes.txt").exists()  # not a run's file: stays


def test_removing_a_checkpoint_takes_its_huggingface_copy_and_keeps_a_merged_model(tmp_path):
    """remove_checkpoint removes the files a save wrote, actor/huggingface and a temporary file of write_atomic's
    included; merge.py's actor/merged stays."""
    for folder in ("actor/model", "actor/huggingface", "actor/merged"):
        os.makedirs(tmp_path / "global_step_1" / folder)
    (tmp_path / "global_step_1" / "trainer_state.json").write_text("{}")
    (tmp_path / "global_step_1" / "trainer_state.json.tmp.4242").write_text("{")  # a save killed in write_atomic
    run_folder.remove_checkpoint(str(tmp_path / "global_step_1"))
    assert os.listdir(tmp_path / "global_step_1") == ["actor"]
    assert os.listdir(tmp_path / "global_step_1" / "actor") == ["merged"]
    os.rmdir(tmp_path / "global_step_1" / "actor" / "merged")
    run_folder.remove_checkpoint(str(tmp_path / "global_step_1"))  # nothing else left: the folder goes
    assert not (tmp_path / "global_step_1").exists()


def test_a_checkpoint_keeps_the_chat_template_it_trained_with(tmp_path, toy, monkeypatch):
    """With data.override_chat_template (a base model must set one) the checkpoint's huggingface/ files, which
    merge.py copies beside the weights, held the model's own template (or none): the merged model was served with
    prompts laid out otherwise than in training."""
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    (tmp_path / "chat.jinja").write_text(template)
    cfg = make_cfg()
    cfg.data.override_chat_template = str(tmp_path / "chat.jinja")
    os.makedirs(tmp_path / "run")  # the actor writes the model's own processor files, as actor.save_hf_files
    monkeypatch.setattr(actor, "save_hf_files", lambda model_cfg, path, peft_model=None: AutoProcessor.from_pretrained(
        toy["vl_model"]).save_pretrained(path))
    run = fake_run(tmp_path / "run", cfg)
    run.processor = data.load_processor(toy["vl_model"], cfg.data)[0]
    run.step = 1
    run.save_checkpoint({})
    saved = tmp_path / "run" / "global_step_1" / "actor" / "huggingface"
    assert AutoProcessor.from_pretrained(saved).chat_template == AutoTokenizer.from_pretrained(saved).chat_template \
        == template


def test_a_step_saved_again_sets_merge_outputs_of_its_earlier_weights_aside(tmp_path, capsys):
    """Step 2 merged (actor/merged), rotated away (its merge output kept), then a resume from step 1 saves step 2
    again: the old merged weights sat beside the new checkpoint, silently (merge.py then said 'already exists')."""
    save_steps(tmp_path, [1, 2])
    os.makedirs(tmp_path / "global_step_2" / "actor" / "merged")
    run_folder.remove_checkpoint(str(tmp_path / "global_step_2"))  # as save_limit's rotation does
    run = fake_run(tmp_path, make_cfg(load_checkpoint_path=str(tmp_path / "global_step_1")))
    run.step = 2
    run.save_checkpoint({})
    assert not (tmp_path / "global_step_2" / "actor" / "merged").exists() and not run_folder.checkpoint_problem(
        str(tmp_path / "global_step_2"))
    (aside,) = [n for n in os.listdir(tmp_path) if n.startswith("earlier_")]
    assert os.listdir(tmp_path / aside / "global_step_2" / "actor") == ["merged"]
    out = capsys.readouterr().out
    assert f"step 2 is saved again: global_step_2 moved from {tmp_path} to {tmp_path / aside}" in out


def test_a_resumes_first_validation_counts_toward_the_best_checkpoint(tmp_path):
    """Steps 1 and 2 saved unvalidated; the resume validates step 2 first (0.9), then steps 3 and 4 score 0.9 and
    0.5: step 2 is the best (it was step 3, the first save with a score, and rotation could remove step 2)."""
    save_steps(tmp_path, [1, 2])
    run = fake_run(tmp_path, make_cfg(val_before_train=True, val_freq=1))
    scores = iter([0.9, 0.9, 0.5])
    run.validate = lambda: {"val/reward_score": next(scores)}
    run.train_step = lambda: {"reward/overall": 0.0}
    run.fit()
    run.logger.close()
    assert json.loads((tmp_path / run_folder.TRACKER).read_text()) == {
        "last_global_step": 4, "best_global_step": 2, "best_val_reward_score": 0.9}


def test_a_fresh_starts_validation_of_the_base_model_does_not_count_toward_the_best_checkpoint(tmp_path):
    """A fresh start validates the base model (0.9), then steps 1 and 2 score 0.5 and 0.7: the best is step 2, a
    saved checkpoint. Step 0 has no global_step_0 to keep or merge, so it cannot be the best."""
    run = fake_run(tmp_path, make_cfg(val_before_train=True, val_freq=1), training_steps=2)
    scores = iter([0.9, 0.5, 0.7])
    run.validate = lambda: {"val/reward_score": next(scores)}
    run.train_step = lambda: {"reward/overall": 0.0}
    run.fit()
    run.logger.close()
    assert json.loads((tmp_path / run_folder.TRACKER).read_text()) == {
        "last_global_step": 2, "best_global_step": 2, "best_val_reward_score": 0.7}
    assert folders(tmp_path) == [1, 2]


def test_a_tracker_without_folders_a_missing_shard_a_mis_named_path_and_save_limit_one(tmp_path):
    """A tracker without any global_step_N folder is an error (a fresh start would write over that run); val_only over
    an incomplete folder without a tracker moves nothing; a shard that is missing, not only cut short, makes the
    checkpoint incomplete, a trainer_state.json of older versions (no "resumable") does not; a load_checkpoint_path
    not named global_step_N is refused; save_limit 1 with the best at an
    earlier step keeps the best and the current step, nothing between."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / run_folder.TRACKER).write_text(json.dumps({"last_global_step": 3}))
    with pytest.raises(run_folder.CheckpointError, match="has a checkpoint tracker but no complete checkpoint"):
        run_folder.find_checkpoint(str(tmp_path / "a"), None, True)
    (tmp_path / "b" / "global_step_1").mkdir(parents=True)
    (tmp_path / "b" / "experiment_log.jsonl").write_text("")
    assert run_folder.find_checkpoint(str(tmp_path / "b"), None, True, val_only=True) is None
    assert sorted(os.listdir(tmp_path / "b")) == ["experiment_log.jsonl", "global_step_1"]
    (tmp_path / "c").mkdir()
    save_steps(tmp_path / "c", [1, 2])
    os.remove(tmp_path / "c" / "global_step_1" / "actor" / "model" / "__0_0.distcp")
    assert run_folder.checkpoint_problem(str(tmp_path / "c" / "global_step_1")) == \
        "actor/model/__0_0.distcp is missing or truncated"
    state = tmp_path / "c" / "global_step_2" / "trainer_state.json"  # an older checkpoint's, without "resumable"
    state.write_text(json.dumps({k: v for k, v in json.loads(state.read_text()).items() if k != "resumable"}))
    assert run_folder.checkpoint_problem(str(tmp_path / "c" / "global_step_2")) is None
    os.rename(tmp_path / "c" / "global_step_2", tmp_path / "c" / "best")
    with pytest.raises(run_folder.CheckpointError, match="must be an existing global_step_N folder"):
        run_folder.find_checkpoint(str(tmp_path / "c"), str(tmp_path / "c" / "best"), True)
    for step in (1, 2, 3, 4, 5):  # finished saves (trainer_state.json), which rotation counts toward save_limit
        saved_folder(tmp_path / "d" / f"global_step_{step}")
    run_folder.remove_old_checkpoints(str(tmp_path / "d"), 5, 2, 1)
    assert folders(tmp_path / "d") == [2, 5]


def test_a_run_whose_steps_all_skipped_their_update_says_so_at_the_end(tmp_path, capsys):
    """Every optimizer step of steps 2 and 3 skipped for a NaN gradient (actor/grad_norm NaN, the mean of no finite
    norm): the run still ends, but its last line says those steps changed no weight, not a plain "done"."""
    run = fake_run(tmp_path, make_cfg(), training_steps=3)
    norms = iter([1.5, float("nan"), float("nan")])
    run.validate = lambda: {}
    run.train_step = lambda: {"actor/grad_norm": next(norms)}
    run.fit()
    run.logger.close()
    assert "; but 2 of the 3 steps changed no weight: every optimizer step was skipped" in capsys.readouterr().out


def test_a_checkpoint_the_rotation_cannot_remove_is_said_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    """save_limit's rotation removed old checkpoints with rmtree(ignore_errors=True): one it could not remove (its
    files immutable, chattr +i end to end on the toy; another user's) stayed without a word, holding its disk.
    Now it is named; a folder that is not there is no error (a step saved for the first time)."""
    import errno

    for step in (1, 2, 3):
        (tmp_path / f"global_step_{step}" / "actor").mkdir(parents=True)
        (tmp_path / f"global_step_{step}" / "trainer_state.json").write_text("{}")
    rmtree = run_folder.shutil.rmtree

    def stuck(path, *args, **kwargs):  # as rmtree on immutable files: it raises, or with ignore_errors leaves them
        if path.endswith("global_step_1"):
            if kwargs.get("ignore_errors"):
                return None
            raise PermissionError(errno.EPERM, "Operation not permitted", f"{path}/trainer_state.json")
        return rmtree(path, *args, **kwargs)
    monkeypatch.setattr(run_folder.shutil, "rmtree", stuck)
    run_folder.remove_old_checkpoints(str(tmp_path), 3, None, 1)
    assert sorted(os.listdir(tmp_path)) == ["global_step_1", "global_step_3"]
    assert (f"{tmp_path}/global_step_1: not removed (Operation not permitted: {tmp_path}/global_step_1/trainer_state"
            ".json); remove by hand") in capsys.readouterr().out
    run_folder.remove_checkpoint(str(tmp_path / "global_step_9"))  # not there: nothing to say
    assert capsys.readouterr().out == ""
    (tmp_path / "elsewhere").mkdir()  # a checkpoint linked in from another disk: rmtree's OSError has no errno
    (tmp_path / "global_step_0").symlink_to(tmp_path / "elsewhere")  # or file (it printed '(None: None)')
    run_folder.remove_checkpoint(str(tmp_path / "global_step_0"))
    assert capsys.readouterr().out == (f"{tmp_path}/global_step_0: not removed (Cannot call rmtree on a symbolic "
                                       f"link: {tmp_path}/global_step_0); remove by hand\n")


def test_a_best_checkpoint_rotated_away_before_a_resume_does_not_count_toward_save_limit(tmp_path):
    """Scores 0.5, 0.1, 0.9 at steps 1-3 with save_limit 2: step 3 became the best and step 1 was rotated away. A
    resume from step 2 (load_checkpoint_path) brings back step 2's best, step 1, whose folder is gone: it counted
    toward save_limit, so step 3's save removed step 2 and left one checkpoint."""
    run = fake_run(tmp_path, make_cfg(save_limit=2))
    for step, score in zip(range(1, 4), (0.5, 0.1, 0.9)):
        run.step = step
        run.save_checkpoint({"val/reward_score": score})
    run.logger.close()
    assert folders(tmp_path) == [2, 3]
    run = fake_run(tmp_path, make_cfg(save_limit=2, load_checkpoint_path=str(tmp_path / "global_step_2")))
    assert run.best["best_global_step"] == 1
    run.step = 3
    run.save_checkpoint({"val/reward_score": 0.2})
    run.logger.close()
    assert folders(tmp_path) == [2, 3]


def test_an_earlier_incomplete_folder_does_not_count_toward_save_limit(tmp_path, monkeypatch):
    """Killed while saving step 4, resumed from step 2 with save_freq 3 and save_limit 2: step 4 is passed unsaved,
    and step 6's rotation counted its incomplete folder as one of the two newest, removing the complete step 3 (one
    checkpoint left to resume from). Now only finished saves count (save_model_only ones too); the cut one goes."""
    with monkeypatch.context() as patch:
        kill_at(patch, "before trainer_state.json", 4)
        with pytest.raises(Kill):
            run_loop(tmp_path, run_id=1, save_limit=2)
    assert folders(tmp_path) == [2, 4]
    run_loop(tmp_path, run_id=2, save_freq=3, save_limit=2)
    assert folders(tmp_path) == [3, 6]
    os.makedirs(tmp_path / "model_only")
    save_steps(tmp_path / "model_only", [1, 2, 3], save_model_only=True, save_limit=2)  # saved, though not resumable
    assert folders(tmp_path / "model_only") == [2, 3]


def test_the_later_checkpoints_set_aside_keep_their_rows_of_the_log(tmp_path, capsys):
    """load_checkpoint_path=global_step_2 of a run of 4 steps: checkpoints 3 and 4 moved aside, and the log was cut
    to step 2, so their rows (rewards, validation scores) were gone from every file. Now the logs as they were go
    with them, copied."""
    run_loop(tmp_path, run_id=1, training_steps=4, save_freq=1)
    run_loop(tmp_path, run_id=2, training_steps=4, save_freq=1, load_checkpoint_path=str(tmp_path / "global_step_2"))
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("earlier_")]
    assert folders(aside) == [3, 4]
    rows = [json.loads(line) for line in open(aside / "experiment_log.jsonl")]
    assert [(r["step"], r["run"]) for r in rows] == [(1, 1), (2, 1), (3, 1), (4, 1)]
    rows = [json.loads(line) for line in open(tmp_path / "experiment_log.jsonl")]
    assert [(r["step"], r["run"]) for r in rows] == [(1, 1), (2, 1), (3, 2), (4, 2)]
    assert f"to {aside}; a copy of experiment_log.jsonl, generations.log, experiment_config.json with them" \
           in capsys.readouterr().out


def test_a_fresh_start_without_validation_first_keeps_a_val_only_rows_of_step_0(tmp_path, capsys):
    """val_only on the base model in a new folder, then training there with val_before_train=false: the fresh start
    cut the log back to nothing, dropping the base model's validation ("dropped 1 lines of the steps that run again"),
    though step 0 does not run again. With val_before_train, it does, and its row is written again."""
    for val_before_train, kept in ((False, [(0, 0.25), (1, None), (2, 0.0)]), (True, [(0, 0.0), (1, None), (2, 0.0)])):
        root = tmp_path / str(val_before_train)
        os.makedirs(root)
        run = fake_run(root, make_cfg(val_only=True))
        run.validate = lambda: {"val/reward_score": 0.25}
        run.fit()
        run.logger.close()
        run_loop(root, run_id=1, training_steps=2, val_before_train=val_before_train)
        rows = [json.loads(line) for line in open(root / "experiment_log.jsonl")]
        assert [(r["step"], r.get("val/reward_score")) for r in rows] == kept
    assert capsys.readouterr().out.count("dropped 1 lines of the steps that run again") == 1


def test_a_checkpoint_beside_merge_outputs_that_the_rotation_cannot_remove_is_said_too(tmp_path, monkeypatch, capsys):
    """Step 1 holds merge.py's actor/merged, so rotation removes its own files one by one; one it could not remove
    (immutable) stopped the run with a PermissionError traceback after step 3's checkpoint was complete, where a
    folder without merge outputs is said and the run goes on."""
    import errno

    for step in (1, 2, 3):
        (tmp_path / f"global_step_{step}" / "actor" / "merged").mkdir(parents=True)
        (tmp_path / f"global_step_{step}" / "trainer_state.json").write_text("{}")
    remove = os.remove

    def stuck(path, *args, **kwargs):
        if "global_step_1" in str(path):
            raise PermissionError(errno.EPERM, "Operation not permitted", str(path))
        return remove(path, *args, **kwargs)
    monkeypatch.setattr(run_folder.os, "remove", stuck)
    run_folder.remove_old_checkpoints(str(tmp_path), 3, None, 1)
    assert (tmp_path / "global_step_1" / "trainer_state.json").exists()
    assert sorted(os.listdir(tmp_path / "global_step_2")) == ["actor"]  # its own file gone, actor/merged kept
    assert (f"{tmp_path}/global_step_1: not removed (Operation not permitted: {tmp_path}/global_step_1/trainer_state"
            ".json); remove by hand") in capsys.readouterr().out


def test_a_fresh_start_moves_an_earlier_runs_logs_aside_though_it_saved_no_checkpoint(tmp_path, monkeypatch, capsys):
    """find_last_checkpoint=false where an earlier run stopped before its first checkpoint: its rows were cut to
    nothing ("dropped 3 lines of the steps that run again"), not moved aside as where it had saved one."""
    with monkeypatch.context() as patch:
        kill_at(patch, "after the row", 3)
        with pytest.raises(Kill):
            run_loop(tmp_path, run_id=1, save_freq=5)
    old_rows = (tmp_path / "experiment_log.jsonl").read_text()
    assert old_rows.count('"step"') == 3 and not folders(tmp_path)
    run_loop(tmp_path, run_id=2, training_steps=1, find_last_checkpoint=False)
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("earlier_")]
    assert (aside / "experiment_log.jsonl").read_text() == old_rows
    assert [json.loads(line)["run"] for line in open(tmp_path / "experiment_log.jsonl")] == [2]
    assert "dropped" not in capsys.readouterr().out


def test_validating_a_checkpoint_under_another_data_config_reads_no_loader_position(tmp_path, toy, monkeypatch):
    """val_only trains nothing, yet the train loader's saved position was loaded: a checkpoint saved with another
    data.rollout_batch_size was refused ("cannot resume ...: the loader state was saved with batch_size=8")."""
    save_steps(tmp_path, [1])
    torch.save({"epoch": 0, "batch": 1, "batch_size": 8}, tmp_path / "global_step_1" / "dataloader.pt")

    class Started(Exception):
        pass

    def workers(*args):
        raise Started
    monkeypatch.setattr(trainer, "WorkerGroup", workers)
    cfg = load_config(None, [f"data.train_files={toy['colors']}@train", f"data.val_files={toy['colors']}@test",
                             f"worker.actor.model.model_path={toy['vl_model']}", "trainer.logger=[file]",
                             f"trainer.save_checkpoint_path={tmp_path}", "trainer.val_only=true"])
    with pytest.raises(Started):  # on to the workers, which validate the checkpoint
        trainer.Run(cfg)
    cfg.trainer.val_only = False
    with pytest.raises(run_folder.CheckpointError, match="saved with batch_size=8, now it is 512"):  # a resume: refused
        trainer.Run(cfg)


def test_validating_another_folders_checkpoint_does_not_write_into_this_runs_row(tmp_path):
    """val_only with load_checkpoint_path=b/global_step_2 and save_checkpoint_path=a (run a's folder, as when both
    runs share a config): run a's row of step 2 took b's val/reward_score beside a's own training metrics, and a's
    own score was gone. Now refused, naming the row; into a new folder it validates."""
    for name in ("a", "b"):
        os.makedirs(tmp_path / name)
        run_loop(tmp_path / name, run_id=1, training_steps=2, save_freq=1)
    before = (tmp_path / "a" / "experiment_log.jsonl").read_text()
    cfg = make_cfg(val_only=True, load_checkpoint_path=str(tmp_path / "b" / "global_step_2"))
    with pytest.raises(run_folder.CheckpointError, match=f"as step 2's into {tmp_path / 'a'}/experiment_log"):
        fake_run(tmp_path / "a", cfg, 2)
    assert (tmp_path / "a" / "experiment_log.jsonl").read_text() == before
    os.makedirs(tmp_path / "c")
    for _ in range(2):  # the same validation run again there: its own row, amended
        run = fake_run(tmp_path / "c", cfg, 2)
        run.validate = lambda: {"val/reward_score": 0.75}
        run.fit()
        run.logger.close()
    assert [json.loads(line) for line in open(tmp_path / "c" / "experiment_log.jsonl")] == [
        {"step": 2, "val/reward_score": 0.75}]


def test_an_easyr1_run_folder_is_named_as_such_not_as_missing_files(tmp_path):
    """EasyR1's checkpoints sit in the same default folder (checkpoints/<project>/<experiment>), with its tracker: a
    run of the same config stopped with "global_step_5: trainer_state.json is missing. Restore the missing files",
    though nothing was missing. Now the checkpoint is named an EasyR1 one, and what to do."""
    (tmp_path / "global_step_5" / "actor").mkdir(parents=True)
    for name in ("model", "optim", "extra_state"):
        (tmp_path / "global_step_5" / "actor" / f"{name}_world_size_8_rank_0.pt").write_bytes(b"")
    (tmp_path / "global_step_5" / "dataloader.pt").write_bytes(b"")
    (tmp_path / run_folder.TRACKER).write_text(json.dumps({"last_global_step": 5, "last_actor_path": "x"}))
    easyr1 = "global_step_5: an EasyR1 checkpoint (actor/model_world_size_*_rank_*.pt), which this trainer does not"
    with pytest.raises(run_folder.CheckpointError, match=re.escape(easyr1)):
        run_folder.find_checkpoint(str(tmp_path), None, True)
    with pytest.raises(run_folder.CheckpointError, match="scripts/model_merger.py"):
        run_folder.find_checkpoint(str(tmp_path), str(tmp_path / "global_step_5"), True)


def test_the_checkpoints_set_aside_keep_the_settings_that_trained_them(tmp_path):
    """A resume from an earlier step, or from another folder's checkpoint, moved this folder's checkpoints aside with
    a copy of the logs but not experiment_config.json: the resume's first save wrote its own settings there, and the
    settings that trained the checkpoints set aside were in no file. Now a copy goes with them."""
    os.makedirs(tmp_path / "a")
    save_steps(tmp_path / "a", [2])
    for root, load in ((tmp_path / "b", "b/global_step_2"), (tmp_path / "c", "a/global_step_2")):  # its own, another's
        os.makedirs(root)
        run_loop(root, run_id=1, training_steps=4, save_freq=1, experiment_name="first")
        run_loop(root, run_id=2, training_steps=4, save_freq=1, experiment_name="second",
                 load_checkpoint_path=str(tmp_path / load))
        (aside,) = [p for p in root.iterdir() if p.name.startswith("earlier_")]
        assert json.load(open(aside / "experiment_config.json"))["trainer"]["experiment_name"] == "first"
        assert json.load(open(root / "experiment_config.json"))["trainer"]["experiment_name"] == "second"


def test_a_resume_from_another_folders_checkpoint_sets_aside_a_log_without_checkpoints_too(tmp_path, capsys):
    """A folder holding only logs (here a validation of b's step 2, val_only; or a run stopped before it saved)
    resumed into from b/global_step_2: no checkpoint or tracker to move, so nothing went aside, and the resume cut
    the log to nothing ("dropped 1 lines of the steps that run again"), the validation's row in no file. Now a copy
    of the logs goes aside, as where this folder's run had saved."""
    os.makedirs(tmp_path / "b")
    save_steps(tmp_path / "b", [2])
    cfg = make_cfg(val_only=True, load_checkpoint_path=str(tmp_path / "b" / "global_step_2"))
    os.makedirs(tmp_path / "c")
    run = fake_run(tmp_path / "c", cfg, 2)
    run.validate = lambda: {"val/reward_score": 0.75}
    run.fit()
    run.logger.close()
    run_loop(tmp_path / "c", run_id=1, training_steps=3, load_checkpoint_path=str(tmp_path / "b" / "global_step_2"))
    (aside,) = [p for p in (tmp_path / "c").iterdir() if p.name.startswith("earlier_")]
    assert [json.loads(line) for line in open(aside / "experiment_log.jsonl")] == [{"step": 2,
                                                                                    "val/reward_score": 0.75}]
    assert [json.loads(line)["step"] for line in open(tmp_path / "c" / "experiment_log.jsonl")] == [3]


def test_validating_another_folders_later_checkpoint_does_not_add_a_row_to_this_runs_log(tmp_path, capsys):
    """val_only of b/global_step_3 into run a's folder, a stopped after step 2 of 4: a's log held no row of step 3,
    so b's score was appended as a's row of step 3 (its metrics.png showed it), and a's resume then cut it ("dropped
    1 lines of the steps that run again"): b's validation was in no file. Refused now, as for a step a has a row of."""
    for name, steps in (("a", 2), ("b", 3)):
        os.makedirs(tmp_path / name)
        run_loop(tmp_path / name, run_id=1, training_steps=steps, save_freq=1)
    before = (tmp_path / "a" / "experiment_log.jsonl").read_text()
    cfg = make_cfg(val_only=True, load_checkpoint_path=str(tmp_path / "b" / "global_step_3"))
    with pytest.raises(run_folder.CheckpointError, match="set trainer.save_checkpoint_path to a new folder"):
        fake_run(tmp_path / "a", cfg, 4)
    assert (tmp_path / "a" / "experiment_log.jsonl").read_text() == before
    os.remove(tmp_path / "a" / run_folder.TRACKER)  # a run stopped before its first save: rows, no tracker
    for step in (1, 2):  # (its next start cuts its rows, and b's score would go with them)
        shutil.rmtree(tmp_path / "a" / f"global_step_{step}")
    with pytest.raises(run_folder.CheckpointError, match="set trainer.save_checkpoint_path to a new folder"):
        fake_run(tmp_path / "a", cfg, 4)
    assert (tmp_path / "a" / "experiment_log.jsonl").read_text() == before


def test_a_resume_from_another_folders_checkpoint_sets_this_runs_plot_and_tensorboard_events_aside(tmp_path):
    """This folder's run goes aside, but its tensorboard/ and metrics.png stayed: the resumed run's writer, opened with
    purge_step 0 (its rows start over), hid every event of the run set aside in TensorBoard, and its plot was
    overwritten at the end. Now they go with that run's checkpoints and tracker."""
    os.makedirs(tmp_path / "a")
    save_steps(tmp_path / "a", [2])
    os.makedirs(tmp_path / "b")
    run_loop(tmp_path / "b", run_id=1, training_steps=2, save_freq=1)
    (tmp_path / "b" / "tensorboard").mkdir()
    (tmp_path / "b" / "tensorboard" / "events.out.tfevents.1").write_text("run 1's")
    (tmp_path / "b" / "metrics.png").write_text("run 1's plot")
    run_loop(tmp_path / "b", run_id=2, training_steps=3, load_checkpoint_path=str(tmp_path / "a" / "global_step_2"))
    (aside,) = [p for p in (tmp_path / "b").iterdir() if p.name.startswith("earlier_")]
    assert (aside / "tensorboard" / "events.out.tfevents.1").read_text() == "run 1's"
    assert (aside / "metrics.png").read_text() == "run 1's plot"
    assert not (tmp_path / "b" / "tensorboard").exists()


def test_a_checkpoint_path_with_a_trailing_slash_is_this_folders_own(tmp_path, capsys):
    """load_checkpoint_path=<run>/global_step_2/ (a shell completes a folder with a slash) is this folder's own
    checkpoint: val_only of it validates here, and a resume from it sets aside steps 3 and 4 alone. Taken for
    another folder's (the parent of the path as written is global_step_2 itself), val_only would be refused and the
    resume would set the whole run aside, global_step_2 with it, and cut the log to nothing."""
    run_loop(tmp_path, run_id=1, training_steps=4, save_freq=1)
    load = f"{tmp_path}/global_step_2/"
    run = fake_run(tmp_path, make_cfg(val_only=True, load_checkpoint_path=load), 4)
    run.validate = lambda: {"val/reward_score": 0.5}
    run.fit()
    run.logger.close()
    run_loop(tmp_path, run_id=2, training_steps=4, save_freq=1, load_checkpoint_path=load)
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("earlier_")]
    assert folders(aside) == [3, 4] and folders(tmp_path) == [1, 2, 3, 4]
    rows = [json.loads(line) for line in open(tmp_path / "experiment_log.jsonl")]
    assert [(r["step"], r["run"], r.get("val/reward_score")) for r in rows] == [(1, 1, None), (2, 1, 0.5), (3, 2, None),
                                                                                (4, 2, 0.0)]


def test_a_resume_from_another_folders_checkpoint_keeps_no_row_of_this_folders_step_0(tmp_path):
    """b's run validated the base model first (a row of step 0), then b resumed from a/global_step_2: every row
    of b's run is another run's, step 0's too, and goes aside with it; kept, the earlier run's base-model score
    would stand in b's log (and metrics.png) as the resumed run's step 0."""
    os.makedirs(tmp_path / "a")
    save_steps(tmp_path / "a", [2])
    os.makedirs(tmp_path / "b")
    run_loop(tmp_path / "b", run_id=1, training_steps=2, save_freq=1, val_before_train=True)
    run_loop(tmp_path / "b", run_id=2, training_steps=3, load_checkpoint_path=str(tmp_path / "a" / "global_step_2"))
    (aside,) = [p for p in (tmp_path / "b").iterdir() if p.name.startswith("earlier_")]
    assert [json.loads(line)["step"] for line in open(aside / "experiment_log.jsonl")] == [0, 1, 2]
    assert [json.loads(line)["step"] for line in open(tmp_path / "b" / "experiment_log.jsonl")] == [3]


def test_a_resume_from_another_folders_checkpoint_into_a_new_folder_sets_nothing_aside(tmp_path, capsys):
    """A new folder's logs, opened empty before the resume, hold no run: no earlier_<time>/ of empty copies (one
    more at every such start) and nothing said of a run going aside."""
    os.makedirs(tmp_path / "a")
    save_steps(tmp_path / "a", [2])
    os.makedirs(tmp_path / "b")
    run_loop(tmp_path / "b", run_id=1, training_steps=3, load_checkpoint_path=str(tmp_path / "a" / "global_step_2"))
    assert not [p for p in (tmp_path / "b").iterdir() if p.name.startswith("earlier_")]
    assert "goes aside" not in capsys.readouterr().out
