"""run_folder.py's pieces alone: the log's amended row, the tracker and the checkpoints a resume sets aside, what
makes a checkpoint incomplete, the generations a resume that validates first cuts, the KL coefficient a resume
restores, and val_only leaving the run folder as it is. (The whole resume path, with Run and fake workers, is in
tests/test_checkpoint.py.)"""

import json
import os

import pytest

import run_folder
from test_checkpoint import fake_run, folders, make_cfg, no_hf_files, save_steps  # noqa: F401 (no_hf_files: a fixture)

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
    assert not (tmp_path / "global_step_2").exists()


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


@pytest.mark.parametrize("saved, resumed", [("fixed", "fixed"), ("fixed", "adaptive"), ("adaptive", "fixed")])
def test_only_an_adaptive_controller_resumes_its_beta(tmp_path, saved, resumed):
    """Saved at beta 0.02: a fixed beta is the config's (0.1 here: a changed kl_coef applies after a resume), and an
    adaptive controller that follows a fixed one starts from its kl_coef, not the old fixed value."""
    save_steps(tmp_path, [1, 2], kl_type=saved)
    assert fake_run(tmp_path, make_cfg(kl_type=resumed)).kl_ctrl.value == 0.1


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
