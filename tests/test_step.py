"""Fast tests of what one training step passes between its stages (trainer.Run's make_batch, score, greedy_rewards,
train_step and fit) with fake workers, as tests/test_loop.py: the uids, seeds and scores of filtered rounds, the
settings each call gets, the passes a setting skips. Every expected number is worked out by hand in the test."""

import os
import types

import pytest
import torch

import advantage
import reward
import rollout
import trainer
from config import ConfigError, load_config
from test_loop import (FakeLoader, bare_run, fake_stages, make_run, scripted_fit, step_run,  # noqa: F401 (fixture)
                       two_round_run)


def test_filtered_rounds_keep_distinct_uids_aligned_scores_and_new_seeds():
    """Filtering keeps x (0, 1) from round 1 and z (1, 0) from round 2 (y and w, mean 1, are dropped). GRPO groups
    by uid, so x and z (index 0 of their rounds) need distinct uids, else they are one group of 4; the scores follow
    the responses: 0, 1 (x) then 1, 0 (z); round 2 samples with another seed than round 1."""
    table = {"x": (0.0, 1.0), "y": (1.0, 1.0), "z": (1.0, 0.0), "w": (1.0, 1.0)}
    run = two_round_run("data.rollout_batch_size=2", "worker.actor.global_batch_size=2",
                        "algorithm.online_filtering=true", score=lambda p, j: {"overall": table[p][j]})
    del run.sampling  # the real one: a seed per round
    seeds, generate = [], run.workers.generate
    run.workers.generate = lambda prompts, sampling: seeds.append(sampling["seed"]) or generate(prompts, sampling)
    prompts, responses, scores, _ = run.make_batch({})
    assert [p["name"] for p in prompts] == ["x", "z"] and prompts[0]["uid"] != prompts[1]["uid"]
    assert [r["uid"] for r in responses] == [prompts[0]["uid"]] * 2 + [prompts[1]["uid"]] * 2
    assert [s["overall"] for s in scores] == [0.0, 1.0, 1.0, 0.0]
    assert len(seeds) == 2 and seeds[0] != seeds[1]


def test_online_filtering_drops_a_group_whose_mean_is_above_filter_high():
    """filter (0.1, 0.7): x (0, 1) mean 0.5 kept; y (0.5, 1) mean 0.75 > 0.7 dropped (it has spread: only filter_high
    drops it); z (1, 0) kept."""
    table = {"x": (0.0, 1.0), "y": (0.5, 1.0), "z": (1.0, 0.0), "w": (1.0, 1.0)}
    run = two_round_run("data.rollout_batch_size=2", "worker.actor.global_batch_size=2",
                        "algorithm.online_filtering=true", "algorithm.filter_low=0.1", "algorithm.filter_high=0.7",
                        score=lambda p, j: {"overall": table[p][j]})
    assert [p["name"] for p in run.make_batch({})[0]] == ["x", "z"]


def test_max_try_make_batch_zero_is_unlimited():
    """trainer.max_try_make_batch <= 0 is no limit (EasyR1): 4 rounds of one prompt fill rollout_batch_size 4."""
    run = bare_run("data.rollout_batch_size=4", "data.mini_rollout_batch_size=1", "worker.rollout.n=2",
                   "worker.actor.global_batch_size=2", "trainer.n_gpus_per_node=1", "worker.rollout.name=hf",
                   "trainer.max_try_make_batch=0")
    run.train_iter = iter([[{"name": "x"}]] * 4)
    run.workers = types.SimpleNamespace(generate=lambda prompts, sampling: [
        {"prompt_index": 0, "uid": prompts[0]["uid"], "response_ids": [1], "j": j} for j in range(2)])
    run.sampling = lambda key, override=None: {"n": 2, "seed": 0}
    run.score = lambda prompts, responses: [{"overall": float(r["j"])} for r in responses]
    metrics = {}
    assert len(run.make_batch(metrics)[0]) == 4 and metrics["filter/rounds"] == 4


def test_remax_baseline_is_one_greedy_response_per_prompt_keyed_by_its_uid():
    """Temperature 0 and n 1 whatever the rollout's (0.8, 5); prompt a's greedy reward 0.25, b's 0.5, c's 1."""
    run = bare_run("algorithm.adv_estimator=remax", "worker.rollout.temperature=0.8")
    asked, value = [], {"a": 0.25, "b": 0.5, "c": 1.0}
    run.workers = types.SimpleNamespace(generate=lambda prompts, sampling: asked.append(sampling) or [
        {"prompt_index": i, "response_ids": [1]} for i, _ in enumerate(prompts)])
    run.score = lambda prompts, responses: [{"overall": value[prompts[r["prompt_index"]]["uid"]]} for r in responses]
    assert run.greedy_rewards([{"uid": u} for u in "abc"]) == value
    assert (asked[0]["temperature"], asked[0]["n"]) == (0.0, 1)


def test_score_hands_each_response_its_own_prompts_ground_truth_and_skip_special_tokens():
    """Responses of prompts 1 then 0: the reward function sees g1 then g0, decoded with skip_special_tokens false,
    and whether each was cut at max_response_length (a cut response can decode as a finished one)."""
    run = bare_run("worker.reward.skip_special_tokens=false")
    run.tokenizer = types.SimpleNamespace(decode=lambda ids, skip_special_tokens: f"{ids}|{skip_special_tokens}")
    run.reward_fn = lambda rows: rows
    prompts = [{"ground_truth": "g0", "prompt_text": "p0"}, {"ground_truth": "g1", "prompt_text": "p1"}]
    rows = run.score(prompts, [{"prompt_index": 1, "response_ids": [5, 6], "finish_reason": "length"},
                               {"prompt_index": 0, "response_ids": [7], "finish_reason": "stop"}])
    assert [(r["ground_truth"], r["prompt"], r["response"], r["response_length"], r["finish_reason"])
            for r in rows] == [("g1", "p1", "[5, 6]|False", 2, "length"), ("g0", "p0", "[7]|False", 1, "stop")]


def test_score_hands_the_reward_each_prompts_extra_columns():
    """A row's extra columns (data.py's prompt["extra"]) reach the reward function with each response of that
    prompt; a prompt without them gives {}."""
    run = bare_run()
    run.tokenizer = types.SimpleNamespace(decode=lambda ids, skip_special_tokens: "r")
    run.reward_fn = lambda rows: rows
    prompts = [{"ground_truth": "g0", "prompt_text": "p0", "extra": {"id": "q7", "difficulty": 2}},
               {"ground_truth": "g1", "prompt_text": "p1"}]
    rows = run.score(prompts, [{"prompt_index": i, "response_ids": [5], "finish_reason": "stop"} for i in (1, 0, 0)])
    assert [r["extra"] for r in rows] == [{}, {"id": "q7", "difficulty": 2}, {"id": "q7", "difficulty": 2}]


def test_generation_is_capped_at_max_response_length_under_training_and_validation_settings():
    """Run.sampling: worker.rollout's n, temperature, top_p and top_k (val_override_config's on top for validation)
    and max_tokens = data.max_response_length (7 here), not max_prompt_length (5); the seed derive_seed(seed, *key)
    of worker.rollout.seed (3) and the round: (step 2, round 1), or (validation, batch 0)."""
    run = bare_run("data.max_prompt_length=5", "data.max_response_length=7", "worker.rollout.n=4",
                   "worker.rollout.temperature=0.9", "worker.rollout.seed=3")
    train, val = run.sampling((2, 1)), run.sampling(("validation", 0), {"temperature": 0.0, "n": 1})
    assert train == {"n": 4, "temperature": 0.9, "top_p": 1.0, "top_k": -1, "max_tokens": 7,
                     "seed": rollout.derive_seed(3, 2, 1)}
    assert val == {"n": 1, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 7,
                   "seed": rollout.derive_seed(3, "validation", 0)}


def test_the_closing_line_counts_the_steps_that_changed_no_weight(capsys):
    """actor/grad_norm is NaN when every optimizer step of a training step was skipped (non-finite gradients).
    Resumed at step 1 of 4, steps 2 and 4 have NaN norms, step 3 a finite one: 2 of the 3 steps run changed no
    weight. A run whose norms are finite, or that logs none, says nothing of it."""
    for norms, said in (((float("nan"), 0.5, float("nan")), "but 2 of the 3 steps changed no weight"),
                        ((0.5, 1.0, 2.0), None), ((None, None, None), None)):
        run = bare_run("trainer.val_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=-1", step=1,
                       training_steps=4)
        it = iter(norms)
        run.train_step = lambda: {} if (norm := next(it)) is None else {"actor/grad_norm": norm}
        run.validate, run.save_checkpoint = (lambda: {}), (lambda metrics: run.logger.log(metrics, run.step))
        run.fit()
        out = capsys.readouterr().out
        assert (said in out) if said else "changed no weight" not in out, out


def test_dr_grpo_advantages_are_not_divided_by_the_std_and_disable_kl_skips_the_reference_pass():
    """norm_adv_by_std_in_grpo false: A = score - group mean: (1, 0) -> 0.5, -0.5; (1, 1) -> 0, 0. With
    algorithm.disable_kl only the old log-probs are computed (the reference pass is a forward over the batch)."""
    run = step_run("algorithm.disable_kl=true", "algorithm.norm_adv_by_std_in_grpo=false")
    kinds, log_probs = [], run.workers.log_probs
    run.workers.log_probs = lambda samples, kind: kinds.append(kind) or log_probs(samples, kind)
    run.train_step()
    assert [s["advantage"] for s in run.workers.updated] == pytest.approx([0.5, -0.5, 0.0, 0.0], abs=1e-9)
    assert kinds == ["old"]


def test_throughput_is_per_gpu_over_all_nodes():
    """2 nodes x 1 GPU, one sample of 3 + 1 tokens in a 2 s step: 4 tokens / 2 s / 2 GPUs = 1 token/s a GPU; in a
    0.25 s step (the toy's are under a second) 8. A statistic's minimum may be its first value."""
    cfg = load_config(None, ["trainer.nnodes=2", "trainer.n_gpus_per_node=1"])
    responses = [{"prompt_index": 0, "response_ids": [5], "finish_reason": "stop"}]
    samples = [{"prompt_ids": [7] * 3, "response_ids": [5], "rollout_logprobs": torch.tensor([-1.0]),
                "old_logprobs": torch.tensor([-1.0])}]
    out = trainer._batch_metrics([{"prompt_ids": [7] * 3}], responses, samples, cfg, {"timing_s/step": 2.0})
    assert out["perf/throughput"] == pytest.approx(1.0)
    out = trainer._batch_metrics([{"prompt_ids": [7] * 3}], responses, samples, cfg, {"timing_s/step": 0.25})
    assert out["perf/throughput"] == pytest.approx(8.0)
    assert trainer._stats("x", [0, 1, 2]) == {"x/mean": 1.0, "x/max": 2, "x/min": 0}


def test_a_rollout_that_sampled_another_distribution_is_warned_of(capsys):
    """rollout/logp_diff_mean above 0.5 nats (a healthy bf16 run: ~0.01) means the engine sampled another model or
    prompt than the actor trains on: said at that step, not left in a metric; 0.4 is not."""
    cfg, responses = load_config(None), [{"prompt_index": 0, "response_ids": [5, 6], "finish_reason": "stop"}]
    for gap, warned in ((0.4, False), (0.6, True)):
        samples = [{"prompt_ids": [7] * 3, "response_ids": [5, 6], "rollout_logprobs": torch.tensor([-1.0, -2.0]),
                    "old_logprobs": torch.tensor([-1.0 - gap, -2.0 + gap])}]
        trainer._batch_metrics([{"prompt_ids": [7] * 3}], responses, samples, cfg, {"timing_s/step": 1.0})
        assert ("differ from the rollout engine's by 0.60 on average" in capsys.readouterr().out) == warned
    samples[0]["old_logprobs"] = torch.tensor([-1.9, -2.0])  # one token 0.9 off, the mean 0.45: a bf16 outlier
    trainer._batch_metrics([{"prompt_ids": [7] * 3}], responses, samples, cfg, {"timing_s/step": 1.0})
    assert "differ from the rollout engine's" not in capsys.readouterr().out
    samples[0]["old_logprobs"] = torch.tensor([-1.5, -1.5])  # 0.5 on each token: the mean at the limit, not above
    trainer._batch_metrics([{"prompt_ids": [7] * 3}], responses, samples, cfg, {"timing_s/step": 1.0})
    assert "differ from the rollout engine's" not in capsys.readouterr().out


@pytest.mark.parametrize("kl_type, beta_after", [("adaptive", 0.05 * (1 + 0.2 * 1000 / 5000)), ("fixed", 0.05)])
def test_kl_type_picks_the_controller_run_builds(tmp_path, fake_stages, kl_type, beta_after):
    """Run.__init__ builds the controller algorithm.kl_type names, from kl_coef 0.05 (target 0.2, horizon 5000). A step
    of KL 1.0 over 1000 responses: the adaptive beta moves by the error 1.0 / 0.2 - 1 = 4, clipped to 0.2, times
    1000 / 5000 (0.052); the fixed one stays at kl_coef."""
    run = make_run(tmp_path, f"algorithm.kl_type={kl_type}", "algorithm.use_kl_loss=false", "algorithm.kl_coef=0.05",
                   "algorithm.kl_target=0.2", "algorithm.kl_horizon=5000")
    kind = {"adaptive": advantage.AdaptiveKLController, "fixed": advantage.FixedKLController}[kl_type]
    assert type(run.kl_ctrl) is kind and run.kl_ctrl.value == 0.05
    if kl_type == "adaptive":
        assert (run.kl_ctrl.target, run.kl_ctrl.horizon) == (0.2, 5000)
    run.kl_ctrl.update(1.0, n_steps=1000)
    assert run.kl_ctrl.value == pytest.approx(beta_after)
    run.logger.close()


@pytest.mark.parametrize("train, val", [(2, 3), (3, 2)])
def test_vllms_video_limit_is_the_most_videos_in_a_row_of_either_loader(tmp_path, fake_stages, monkeypatch, train, val):
    """worker.rollout.limit_videos, vLLM's limit_mm_per_prompt for videos, is the most videos in one row of the
    train or the val data: 3 whichever holds it (0 reserves no room, and vLLM refuses every video prompt)."""
    class VideoLoader(FakeLoader):
        def __init__(self, files, *args, **kwargs):
            super().__init__(files, *args, **kwargs)
            self.videos_per_prompt = train if "train" in files else val

    monkeypatch.setattr(trainer.data, "PromptLoader", VideoLoader)
    run = make_run(tmp_path)
    assert (run.train_loader.videos_per_prompt, run.val_loader.videos_per_prompt) == (train, val)
    assert run.cfg.worker.rollout.limit_videos == 3
    run.logger.close()


def test_the_last_step_is_saved_whatever_save_freq():
    """save_freq 2 over 3 steps: checkpoints at 2 and at the last step, 3 (EasyR1 saves the final weights)."""
    run = bare_run("trainer.val_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=2", training_steps=3)
    assert scripted_fit(run)[1] == [2, 3]


@pytest.mark.parametrize("overrides, steps, saved, rows", [
    (["trainer.val_freq=-1", "trainer.save_freq=-1"], 2, [2], [1, 2]),  # the last step: validated, then saved
    (["trainer.val_freq=1", "trainer.save_freq=5"], 3, [], [1]),         # no save due at step 1: its row only
])
def test_a_reward_that_fails_in_validation_keeps_the_trained_step(overrides, steps, saved, rows):
    """The reward raised on a validation response: fit raised before the step's row and due checkpoint were written,
    so the run lost every step since its last checkpoint. Now they are written (the engine put to sleep first), then
    the run stops naming the step."""
    run = bare_run("trainer.val_before_train=false", *overrides, training_steps=steps)
    run.train_step, done = (lambda: {"reward/overall": 0.0}), []
    run.validate = lambda: (_ for _ in ()).throw(reward.RewardError("reward function 'r.py:fn' raised ValueError"))
    run.save_checkpoint = lambda metrics: done.append(run.step) or run.logger.log(metrics, run.step)
    run.workers = types.SimpleNamespace(sleep=lambda: done.append("sleep"))  # the engine, awake after generating
    with pytest.raises(RuntimeError, match=rf"validation at step {rows[-1]} failed \(the step is logged"
                       rf"{' and saved' if saved else ''}\): reward function 'r.py:fn' raised"):
        run.fit()
    assert done == ["sleep", *saved] and [step for step, _ in run.logger.rows] == rows


@pytest.mark.parametrize("error, raised", [
    (RuntimeError("worker 0 failed: CUDA error"), RuntimeError),
    (trainer.data.DataError("val.parquet row 3: image gone"), trainer.data.DataError),
    (KeyboardInterrupt(), KeyboardInterrupt)])
def test_a_worker_or_data_failure_in_validation_keeps_the_trained_step_row(error, raised):
    """A worker failing in validation (or a validation row gone bad, or Ctrl-C) lost the trained step's row; it is
    logged first, and a worker's error names the step. The workers may be gone: no checkpoint, though one is due."""
    run = bare_run("trainer.val_before_train=false", "trainer.val_freq=1", "trainer.save_freq=1", training_steps=3)
    run.train_step = lambda: {"reward/overall": 0.0}
    run.save_checkpoint = lambda metrics: pytest.fail("a checkpoint saved from workers that may be gone")
    run.validate = lambda: (_ for _ in ()).throw(error)
    with pytest.raises(raised) as caught:
        run.fit()
    assert [step for step, _ in run.logger.rows] == [1]
    assert raised is not RuntimeError or "at step 1 failed (the step is logged): worker 0" in str(caught.value)


def test_a_reward_key_of_some_responses_is_their_mean_over_rounds():
    """Rounds of one prompt: x's responses return acc_x (1, 0.5), y's acc_y (0.25, 0.25) beside overall (1, 1, 0,
    0): as EasyR1, each key is the mean over the responses that return it (a KeyError after the second round
    before)."""
    table = {"x": ({"acc_x": 1.0}, {"acc_x": 0.5}), "y": ({"acc_y": 0.25}, {"acc_y": 0.25})}
    run = two_round_run("data.rollout_batch_size=2", "data.mini_rollout_batch_size=1",
                        "worker.actor.global_batch_size=2",
                        score=lambda p, j: {"overall": float(p == "x"), **table[p][j]})
    run.train_iter = iter([[{"name": "x"}], [{"name": "y"}]])
    assert run.make_batch({})[3] == {"reward/overall": 0.5, "reward/acc_x": 0.75, "reward/acc_y": 0.25}


def test_pass_at_k_filtering_drops_groups_whose_top_is_shared():
    """grpo_passk with online filtering, n = 3: x scores 1, 1, 0 (top shared: all-zero advantages), y 1, 0, 0;
    only y is kept, round 2 (z, w, as y) fills the batch (both kept before: x trained on nothing)."""
    run = bare_run("data.rollout_batch_size=2", "worker.rollout.n=3", "worker.actor.global_batch_size=2",
                   "trainer.n_gpus_per_node=1", "worker.rollout.name=hf", "algorithm.online_filtering=true",
                   "algorithm.adv_estimator=grpo_passk")
    run.train_iter = iter([[{"name": "x"}, {"name": "y"}], [{"name": "z"}, {"name": "w"}]])
    run.workers = types.SimpleNamespace(generate=lambda prompts, sampling: [
        {"prompt_index": i, "uid": p["uid"], "response_ids": [1], "name": p["name"], "j": j}
        for i, p in enumerate(prompts) for j in range(3)])
    run.sampling = lambda key, override=None: {"n": 3, "seed": 0}
    run.score = lambda prompts, responses: [{"overall": float(r["j"] < (2 if r["name"] == "x" else 1))}
                                            for r in responses]
    assert [p["name"] for p in run.make_batch({})[0]] == ["y", "z"]


def test_a_model_the_actor_refuses_at_setup_is_a_one_line_config_error(tmp_path, fake_stages, monkeypatch):
    """A worker's setup that refuses the model as configured (LoRA on a mixture's experts, a sliding window shorter
    than a sample: this project's ValueError) ends the start-up as a config error with the actor's message, not a
    traceback through Ray; any other failure of a worker, another library's ValueError too (a bug), stays a
    RuntimeError that holds the worker's traceback."""
    def workers(cause, where):
        def start(*args):
            raise RuntimeError(f'a worker failed during setup:\nTraceback ...\n  File "{where}", line 9, in f') \
                from cause
        return start

    ours, library = os.path.join(trainer.HERE, "modeling.py"), "/venv/site-packages/transformers/modeling_utils.py"
    refusal = ValueError("worker.actor.model.lora.target_modules=x: no")
    monkeypatch.setattr(trainer, "WorkerGroup", workers(refusal, ours))
    with pytest.raises(ConfigError, match=r"^worker.actor.model.lora.target_modules=x: no$"):
        make_run(tmp_path)
    for cause, where in ((OSError("disk"), ours), (ValueError("shapes differ"), library)):
        monkeypatch.setattr(trainer, "WorkerGroup", workers(cause, where))
        with pytest.raises(RuntimeError, match="a worker failed during setup:\nTraceback") as caught:
            make_run(tmp_path)
        assert not isinstance(caught.value, ConfigError)


def test_a_resume_the_actor_refuses_is_a_one_line_checkpoint_error_naming_the_cause(tmp_path, monkeypatch):
    """A changed LoRA or optimizer setting (the actor's ValueError, the cause of the worker group's error): the
    trainer raised a RuntimeError holding the worker's traceback; now the refusal's own line. Any other failure (a
    damaged shard, another model) is one line too, naming the innermost error and what to change, with the
    advice for a folder holding another run when the tracker chose the checkpoint."""
    import test_checkpoint
    from run_folder import CheckpointError

    monkeypatch.setattr(test_checkpoint.actor, "save_hf_files", lambda *args, **kwargs: None)
    test_checkpoint.save_steps(tmp_path, [1])
    refusal = ValueError("it holds the state of model.lora.rank=8, this run has model.lora.rank=4: resume with ...")
    ours, library = os.path.join(trainer.HERE, "actor.py"), "/venv/site-packages/torch/distributed/checkpoint/api.py"
    for cause, where in ((refusal, ours), (KeyError("size mismatch"), ours), (ValueError("size mismatch"), library)):
        def load(self, path, cause=cause, where=where):
            raise RuntimeError(f'a worker failed during checkpoint load:\n(pid=1) Traceback ...\n  File "{where}", '
                               f'line 9, in f\n{type(cause).__name__}: {cause}') from cause
        monkeypatch.setattr(test_checkpoint.FakeWorkers, "load", load)
        with pytest.raises(CheckpointError) as caught:
            test_checkpoint.fake_run(tmp_path, test_checkpoint.make_cfg())
        text = str(caught.value)
        assert text.startswith(f"could not resume from {tmp_path / 'global_step_1'}: ") and "\n" not in text, text
        assert ("find_last_checkpoint=false" in text) == (cause is not refusal), text
        assert text.endswith(str(refusal)) if cause is refusal else f"did not load ({type(cause).__name__}: " in text
    died = RuntimeError("a worker died during checkpoint load: The actor died unexpectedly (out of memory)")
    monkeypatch.setattr(test_checkpoint.FakeWorkers, "load", lambda self, path: (_ for _ in ()).throw(died))
    with pytest.raises(RuntimeError, match="a worker died during checkpoint load") as caught:  # as it is: the
        test_checkpoint.fake_run(tmp_path, test_checkpoint.make_cfg())  # checkpoint is not said to be damaged
    assert not isinstance(caught.value, CheckpointError)


def test_a_damaged_shard_of_a_complete_looking_checkpoint_is_one_line_naming_it(tmp_path, monkeypatch):
    """A model shard overwritten in place (its size kept, so find_checkpoint finds it complete) ended the start with a
    64-line traceback through torch.distributed.checkpoint and torch.load's advice to load with weights_only=False,
    exit 1 (end to end on the toy). Now a checkpoint error naming the folder and the innermost error."""
    import traceback

    import test_checkpoint
    from run_folder import CheckpointError

    monkeypatch.setattr(test_checkpoint.actor, "save_hf_files", lambda *args, **kwargs: None)
    test_checkpoint.save_steps(tmp_path, [1])
    shard = tmp_path / "global_step_1" / "actor" / "model" / "__0_0.distcp"
    shard.write_bytes(b"\xff" * shard.stat().st_size)

    def load(self, path):  # as workers.WorkerGroup._get raises a worker's failure: its traceback in the message
        try:
            test_checkpoint.actor.Actor.load_checkpoint(self.actor, path)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            raise RuntimeError(f"a worker failed during checkpoint load:\n{traceback.format_exc()}") from e
    monkeypatch.setattr(test_checkpoint.FakeWorkers, "load", load)
    with pytest.raises(CheckpointError, match=r"^could not resume from .*global_step_1: its actor/ did not load "
                                              r"\(\S*UnpicklingError: Weights only load failed\)\. Restore damaged"):
        test_checkpoint.fake_run(tmp_path, test_checkpoint.make_cfg())
