"""Fast tests of the driver's loop (trainer.Run) with fake workers, loaders and loggers: no Ray, no model.
Every expected number is worked out by hand in the test."""

import importlib.machinery
import importlib.util
import json
import math
import re
import sys
import types

import pytest
import torch
import transformers

import run_folder
import trainer
import workers
from config import ActorConfig, ConfigError, OptimConfig, load_config


class FakeLoader:
    def __init__(self, files, cfg, processor, model, *, batch_size, shuffle, drop_last, trust_remote_code=False,
                 prefetch=False, pixel_dtype=None):
        self.rows, self.model, self.pixel_dtype = 2048 if "train" in files else 601, model, pixel_dtype
        self.batch_size, self.drop_last, self.trust_remote_code = batch_size, drop_last, trust_remote_code
        self.batches_per_epoch = self.rows // batch_size
        self.videos_per_prompt = self.images_per_prompt = 0

    def __iter__(self):
        return iter([])


class FakeWorkers:
    def __init__(self, cfg, training_steps):
        self.training_steps = training_steps


@pytest.fixture
def fake_stages(monkeypatch):
    """Run.__init__ with the data loader, processor, reward function and workers replaced; records the calls."""
    calls = {}

    def load_processor(path, cfg, trust_remote_code=False):
        calls["processor"] = trust_remote_code
        return None, None

    monkeypatch.setattr(trainer.data, "load_processor", load_processor)
    monkeypatch.setattr(trainer.data, "PromptLoader", FakeLoader)
    monkeypatch.setattr(trainer.reward, "load_reward_function", lambda name, **kw: None)
    monkeypatch.setattr(trainer, "WorkerGroup", FakeWorkers)
    monkeypatch.setattr(trainer, "AutoConfig", types.SimpleNamespace(from_pretrained=lambda *a, **k: None))  # a hub id
    monkeypatch.setattr(trainer, "check_packable", lambda *a: None)  # of that (absent) config
    return calls


def make_run(tmp_path, *overrides):
    cfg = load_config(None, [f"trainer.save_checkpoint_path={tmp_path}", "trainer.logger=[file]", *overrides])
    return trainer.Run(cfg)


def test_training_steps_count_rollout_batches_not_generation_rounds(tmp_path, fake_stages):
    """2048 rows, EasyR1's formula: len(loader) x mini_rollout_batch_size // rollout_batch_size x total_epochs.
    With rounds of 128 prompts and steps of 512: 16 x 128 // 512 x 15 = 60 steps (not 16 x 15 = 240)."""
    run = make_run(tmp_path, "data.mini_rollout_batch_size=128")
    assert run.train_loader.batch_size == 128 and run.train_loader.batches_per_epoch == 16
    assert run.training_steps == 60 and run.workers.training_steps == 60
    assert make_run(tmp_path).training_steps == 4 * 15  # 2048 // 512 batches a epoch
    assert make_run(tmp_path, "data.mini_rollout_batch_size=128", "trainer.max_steps=7").training_steps == 7
    assert make_run(tmp_path, "data.mini_rollout_batch_size=384", "data.rollout_batch_size=1024",
                    "trainer.total_epochs=1").training_steps == 5 * 384 // 1024  # = 1
    with pytest.raises(ConfigError, match="make no step of data.rollout_batch_size=4096"):
        make_run(tmp_path, "data.mini_rollout_batch_size=512", "data.rollout_batch_size=4096")


@pytest.mark.parametrize("overrides, dtype", [
    ([], torch.bfloat16), (["worker.actor.fsdp.mp_param_dtype=fp32"], None),
    (["worker.ref.fsdp.mp_param_dtype=fp32"], None), (["worker.rollout.name=hf", "worker.rollout.dtype=fp32"], None),
    (["worker.rollout.name=hf"], torch.bfloat16),
    (["worker.rollout.dtype=fp32"], torch.bfloat16),  # vLLM reads the images, not the processor's pixel values
    (["worker.actor.fsdp.torch_dtype=bf16"], torch.bfloat16), (["worker.actor.fsdp.torch_dtype=fp16"], None)])
def test_pixel_values_go_as_bf16_only_where_every_pass_computes_in_bf16(tmp_path, fake_stages, overrides, dtype):
    run = make_run(tmp_path, *overrides)
    assert run.train_loader.pixel_dtype == run.val_loader.pixel_dtype == dtype


def test_trust_remote_code_reaches_processor_loaders_and_rollout(tmp_path, fake_stages, monkeypatch):
    run = make_run(tmp_path, "worker.actor.model.trust_remote_code=true")
    assert fake_stages["processor"] is True
    assert run.train_loader.trust_remote_code is True and run.val_loader.trust_remote_code is True
    # The worker hands the model's setting to the rollout engine (vLLM's LLM(trust_remote_code=...)).
    seen = {}
    monkeypatch.setattr(trainer.actor, "Actor",
                        lambda cfg, role, **kw: seen.setdefault(role, cfg.model.trust_remote_code))
    monkeypatch.setattr(trainer.rollout, "make_rollout", lambda cfg, path, **kw: seen.setdefault("rollout", cfg))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # setup sets them; restored after
        monkeypatch.setenv(key, "0")
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    workers.Worker().setup(run.cfg, 0, 1, ("127.0.0.1", 0), "cpu", 10)
    assert seen["actor"] is True and seen["ref"] is True and seen["rollout"].trust_remote_code is True
    assert run.cfg.worker.rollout.name == "vllm" and not hasattr(run.cfg.worker.rollout, "trust_remote_code")


def test_the_loaders_position_tokens_under_override_config(tmp_path, fake_stages, monkeypatch, toy):
    """data.py's mrope rows come from the config the loaders get: the model's with model.override_config applied,
    as vLLM positions its tokens (tokens_per_second sets Qwen2.5-VL's video times; the toy's is 4)."""
    monkeypatch.setattr(trainer, "AutoConfig", transformers.AutoConfig)
    run = make_run(tmp_path, f"worker.actor.model.model_path={toy['vl_model']}",
                   "worker.actor.model.override_config={vision_config: {tokens_per_second: 8}}")
    assert run.train_loader.model.vision_config.tokens_per_second == 8
    assert run.val_loader.model.vision_config.tokens_per_second == 8


# --- loggers -------------------------------------------------------------------------------------

def fake_module(name, calls):
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for fn in ("start_run", "log_params", "log_metrics", "end_run", "login", "init", "log", "finish"):
        setattr(module, fn, lambda *a, _fn=fn, **kw: calls.append((name, _fn, a, kw)))
    return module


def test_mlflow_and_swanlab_loggers_log_every_step(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "mlflow", fake_module("mlflow", calls))
    monkeypatch.setitem(sys.modules, "swanlab", fake_module("swanlab", calls))
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    cfg = load_config(None, ["trainer.logger=[file,mlflow,swanlab]", "trainer.experiment_name=exp"])
    logger = run_folder.Logger(str(tmp_path), cfg.trainer.logger, cfg)
    logger.log({"reward/overall": 0.5}, step=3)
    logger.close()
    names = [(m, f) for m, f, _, _ in calls]
    assert names == [("mlflow", "start_run"), ("mlflow", "log_params"), ("swanlab", "init"),
                     ("mlflow", "log_metrics"), ("swanlab", "log"), ("mlflow", "end_run"), ("swanlab", "finish")]
    assert calls[0][3] == {"run_name": "exp"}
    assert calls[1][2][0]["worker/rollout/n"] == 5  # the flat config, one parameter per key, named as in EasyR1
    assert calls[2][3]["mode"] == "offline" and calls[2][3]["experiment_name"] == "exp"
    assert calls[3][2] == ({"reward/overall": 0.5},) and calls[3][3] == {"step": 3}
    assert calls[4][2] == ({"reward/overall": 0.5},) and calls[4][3] == {"step": 3}


def test_a_run_made_from_python_checks_the_stages_values_too(tmp_path):
    """trainer.Run(cfg) without main: a value no stage accepts is an error at once, not at the first update (and
    fsdp.mp_buffer_dtype, which FSDP2 would ignore, is refused)."""
    with pytest.raises(ConfigError, match=r"worker.actor.loss_type='ppo' is not one of \['default'"):
        make_run(tmp_path / "run", "worker.actor.loss_type=ppo")
    with pytest.raises(ConfigError, match="worker.actor.fsdp.mp_buffer_dtype=bf16: buffers stay fp32 in FSDP2"):
        make_run(tmp_path / "run", "worker.actor.fsdp.mp_buffer_dtype=bf16")
    assert not (tmp_path / "run").exists()


def test_a_key_the_models_config_lacks_in_override_config_stops_the_run_before_any_file(tmp_path, toy):
    """transformers drops such a key without a word; the run stops at start-up, naming it, before Ray or a file."""
    with pytest.raises(ConfigError, match=r"worker\.actor\.model\.override_config\.rms_norm_epz: no such key in "
                                          r"Qwen2_5_VLConfig or its text_config"):
        make_run(tmp_path / "run", f"worker.actor.model.model_path={toy['vl_model']}",
                 "worker.actor.model.override_config.rms_norm_epz=0.1")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name, folder", [("mlflow", False), ("swanlab", False), ("wandb", False),
                                          ("tensorboard", False), ("wandb", True)])
def test_missing_logger_package_is_a_one_line_error_before_anything_is_written(tmp_path, monkeypatch, name, folder):
    """folder: wandb leaves its run folder ./wandb/, which Python imported as a namespace package when wandb is not
    installed: a traceback (module 'wandb' has no attribute 'init'), not the one-line error."""
    if folder:
        if importlib.util.find_spec(name) is not None:
            pytest.skip(f"{name} is installed")
        (tmp_path / name).mkdir()
        monkeypatch.syspath_prepend(str(tmp_path))
    else:
        monkeypatch.setitem(sys.modules, name, None)  # find_spec then says: not installed
    cfg = load_config(None, [f"trainer.logger=[file,{name}]", f"trainer.save_checkpoint_path={tmp_path}"])
    with pytest.raises(ConfigError, match=f"trainer.logger has {name}, but the {name} package is not installed: "
                                          f"pip install {name}"):
        trainer.Run(cfg)
    assert list(tmp_path.iterdir()) == ([tmp_path / name] if folder else [])


# --- the loop: when it validates ----------------------------------------------------------------

class FakeLogger:
    jsonl_path = "experiment_log.jsonl"

    def __init__(self):
        self.rows = []

    def log(self, metrics, step, amend=False):
        if amend and self.rows and self.rows[-1][0] == step:  # as Logger: into the last row when it is this step's
            self.rows[-1] = (step, sorted(set(self.rows[-1][1]) | {k for k in metrics if k.startswith("val/")}))
        else:
            self.rows.append((step, sorted(k for k in metrics if k.startswith("val/"))))

    def plot(self):
        return None


def bare_run(*overrides, step=0, training_steps=3):
    """A Run without __init__: config, counters and a fake logger; methods are patched per test."""
    run = trainer.Run.__new__(trainer.Run)
    run.cfg = load_config(None, ["trainer.logger=[file]", *overrides])
    run.step, run.training_steps, run.ckpt_root, run.logger = step, training_steps, "ckpt", FakeLogger()
    run.best = {"best_global_step": None, "best_val_reward_score": None}
    return run


def two_round_run(*overrides, score):
    """bare_run generating rounds [x, y] then [z, w], n = 2; response j of prompt p carries p's name and j, and
    scores score(name, j) -> its reward dict."""
    run = bare_run("worker.rollout.n=2", "trainer.n_gpus_per_node=1", "worker.rollout.name=hf", *overrides)
    run.train_iter = iter([[{"name": "x"}, {"name": "y"}], [{"name": "z"}, {"name": "w"}]])
    run.workers = types.SimpleNamespace(sleep=lambda: None, generate=lambda prompts, sampling: [
        {"prompt_index": i, "uid": p["uid"], "response_ids": [1], "name": p["name"], "j": j}
        for i, p in enumerate(prompts) for j in range(2)])
    run.sampling = lambda key, override=None: {"n": 2, "seed": 0}
    run.score = lambda prompts, responses: [score(r["name"], r["j"]) for r in responses]
    return run


def scripted_fit(run):
    """fit() with train_step, validate and save_checkpoint replaced by recorders; -> (validated at, saved at)."""
    validated, saved = [], []
    run.train_step = lambda: {"reward/overall": 0.0}
    run.validate = lambda: validated.append(run.step) or {"val/reward_score": 1.0}
    run.save_checkpoint = lambda metrics: saved.append(run.step) or run.logger.log(metrics, run.step)  # logs the row
    run.fit()
    return validated, saved


@pytest.mark.parametrize("overrides, step, validated, logged", [
    # val_freq <= 0: before training and once at the end (EasyR1's final validation)
    (["trainer.val_freq=-1"], 0, [0, 3], [(0, ["val/reward_score"]), (1, []), (2, []), (3, ["val/reward_score"])]),
    (["trainer.val_freq=0", "trainer.val_before_train=false"], 0, [3], [(1, []), (2, []), (3, ["val/reward_score"])]),
    # val_freq 2 over 3 steps: 0, 2 and the last
    (["trainer.val_freq=2"], 0, [0, 2, 3], [(0, ["val/reward_score"]), (1, []), (2, ["val/reward_score"]),
                                            (3, ["val/reward_score"])]),
    # resumed at step 2 of 3: val_before_train validates the resumed weights too, as EasyR1 (merged into row 2)
    (["trainer.val_freq=-1"], 2, [2, 3], [(2, ["val/reward_score"]), (3, ["val/reward_score"])]),
])
def test_validation_before_training_on_resume_and_at_the_end(overrides, step, validated, logged):
    run = bare_run(*overrides, step=step)
    run.logger.rows = [(step, [])] if step else []  # a resume's own step row, which the log keeps: amended, not doubled
    assert scripted_fit(run)[0] == validated
    assert run.logger.rows == logged


def test_val_only_validates_once_and_trains_nothing():
    run = bare_run("trainer.val_only=true", "trainer.val_before_train=false", step=2)
    assert scripted_fit(run) == ([2], [])
    assert run.step == 2


# --- one step: KL in the reward, metrics --------------------------------------------------------

OLD = {1: [-1.0, -2.0], 2: [-0.5], 3: [-1.0], 4: [-1.0, -1.0]}  # response -> old log-probs (policy)
REF = {1: [-1.5, -1.0], 2: [-0.5], 3: [-2.0], 4: [-1.0, -3.0]}  # response -> reference log-probs


class StepWorkers:
    """Log-probs by response id (the first response token); the update records the samples it was given."""

    def __init__(self):
        self.updated = None

    def sync_weights(self):
        pass

    def sleep(self):
        pass

    def log_probs(self, samples, kind):
        table = OLD if kind == "old" else REF
        return [torch.tensor(table[s["response_ids"][0]]) for s in samples]

    def update(self, samples):
        self.updated = samples
        return {"actor/pg_loss": 0.0}


def step_run(*overrides):
    """Two prompts (uids a, b; prompt lengths 3 and 4) x two responses: ids 1, 2 for a, 3, 4 for b, with
    response lengths 2, 1, 1, 2 and scores 1, 0, 1, 1 (group b has no spread in its raw scores)."""
    run = bare_run("data.rollout_batch_size=2", "worker.actor.global_batch_size=2", "worker.rollout.n=2",
                   "worker.rollout.name=hf", "trainer.n_gpus_per_node=1", "data.max_prompt_length=4", *overrides)
    prompts = [{"uid": u, "prompt_ids": [7] * length, "position_ids": None, "multi_modal_inputs": {}}
               for u, length in (("a", 3), ("b", 4))]
    responses = [{"prompt_index": i // 2, "uid": "ab"[i // 2], "response_ids": [r] * len(OLD[r]),
                  "logprobs": OLD[r], "finish_reason": "stop"} for i, r in enumerate((1, 2, 3, 4))]
    scores = [{"overall": x} for x in (1.0, 0.0, 1.0, 1.0)]
    run.make_batch = lambda metrics: (prompts, responses, scores, {"reward/overall": 0.75})
    run.workers = StepWorkers()
    a = run.cfg.algorithm
    run.kl_ctrl = (trainer.advantage.AdaptiveKLController(a.kl_coef, a.kl_target, a.kl_horizon)
                   if a.kl_type == "adaptive" else trainer.advantage.FixedKLController(a.kl_coef))
    return run


@pytest.mark.parametrize("kl_type, next_beta", [
    ("fixed", 0.1),
    # adaptive: e = clip(0.4375 / 0.1 - 1, -0.2, 0.2) = 0.2; beta <- 0.1 x (1 + 0.2 x 4 / 10000)
    ("adaptive", 0.1 * (1 + 0.2 * 4 / 10000)),
])
def test_kl_in_the_reward_wiring(kl_type, next_beta):
    """k1 between OLD and REF (old - ref, in that order) per token: sums -0.5, 0, 1, 2 for responses 1..4;
    rewards = scores - 0.1 x sums = 1.05, 0, 0.9, 0.8; GRPO over (1.05, 0) and (0.9, 0.8)."""
    run = step_run("algorithm.use_kl_loss=false", "algorithm.kl_penalty=kl", "algorithm.kl_coef=0.1",
                   f"algorithm.kl_type={kl_type}", "algorithm.kl_target=0.1", "algorithm.kl_horizon=10000")
    metrics = run.train_step()
    a = 0.525 / (1.05 / math.sqrt(2) + 1e-6)  # (1.05 - 0.525) / (std + eps), std = 1.05 / sqrt(2) (unbiased)
    b = 0.05 / (0.1 / math.sqrt(2) + 1e-6)
    assert [s["advantage"] for s in run.workers.updated] == pytest.approx([a, -a, b, -b], abs=1e-6)
    assert [s["uid"] for s in run.workers.updated] == ["a", "a", "b", "b"]
    # current KL: mean over responses of each one's token-mean KL = (-0.25 + 0 + 1 + 1) / 4
    assert metrics["actor/kl_penalty"] == pytest.approx(0.4375)
    assert metrics["actor/kl_coef"] == pytest.approx(0.1)  # the beta this step used
    assert run.kl_ctrl.value == pytest.approx(next_beta, rel=1e-12)
    # raw scores vs KL-penalised rewards vs returns (= the GRPO advantages)
    assert (metrics["critic/score/mean"], metrics["critic/score/max"], metrics["critic/score/min"]) == (0.75, 1.0, 0.0)
    assert metrics["critic/rewards/mean"] == pytest.approx(2.75 / 4)
    assert (metrics["critic/rewards/max"], metrics["critic/rewards/min"]) == pytest.approx((1.05, 0.0))
    assert (metrics["critic/returns/max"], metrics["critic/returns/min"]) == pytest.approx((a, -a), abs=1e-6)
    assert metrics["adv/zero_std_group_frac"] == 0.5  # group b's raw scores (1, 1) have no spread


def test_kl_loss_mode_logs_its_coefficient_as_easyr1s_actor_does():
    """use_kl_loss: EasyR1's actor logs actor/kl_coef = algorithm.kl_coef (dp_actor.py); no KL in the reward, so no
    actor/kl_penalty. disable_kl: neither."""
    m = step_run("algorithm.use_kl_loss=true", "algorithm.kl_coef=0.05").train_step()
    assert m["actor/kl_coef"] == 0.05 and "actor/kl_penalty" not in m
    m = step_run("algorithm.use_kl_loss=true", "algorithm.disable_kl=true").train_step()
    assert "actor/kl_coef" not in m and "actor/kl_penalty" not in m


def test_step_metrics_lengths_and_timing_per_token():
    run = step_run("algorithm.disable_kl=true")
    m = run.train_step()
    assert "actor/kl_penalty" not in m and m["critic/rewards/mean"] == m["critic/score/mean"] == 0.75
    assert m["prompt_length/clip_ratio"] == 0.5  # prompt b has max_prompt_length = 4 tokens
    assert m["response_length/clip_ratio"] == 0.0 and m["response_length/mean"] == 1.5
    assert m["perf/total_num_tokens"] == 3 + 2 + 3 + 1 + 4 + 1 + 4 + 2
    for stage, tokens in (("gen", 6), ("old", 20), ("adv", 20), ("update_actor", 20)):  # reward: in make_batch
        assert m[f"timing_per_token_ms/{stage}"] == pytest.approx(1000 * m[f"timing_s/{stage}"] / tokens), stage
    # ReMax's returns are the rewards themselves (one per response), not the advantages r - b
    run = step_run("algorithm.disable_kl=true", "algorithm.adv_estimator=remax")
    run.greedy_rewards = lambda prompts: {"a": 0.5, "b": 0.5}
    m = run.train_step()
    assert (m["critic/returns/mean"], m["critic/returns/max"], m["critic/returns/min"]) == (0.75, 1.0, 0.0)
    assert (m["critic/advantages/mean"], m["critic/advantages/max"], m["critic/advantages/min"]) == (0.25, 0.5, -0.5)


# --- the update: schedule, clipping, loss values (the toy text model, fp32, one process) ---------

def text_actor(toy, training_steps=4, **overrides):
    """A tiny fp32 policy; mini-batches of global_batch_size x 2 responses; no clipping unless asked."""
    cfg = ActorConfig()
    cfg.model.model_path, cfg.model.enable_gradient_checkpointing = toy["text_model"], False
    cfg.fsdp.torch_dtype = cfg.fsdp.mp_param_dtype = "fp32"
    cfg.optim.lr, cfg.max_grad_norm, cfg.global_batch_size = 1e-3, 1e9, 2
    cfg.dynamic_batching, cfg.micro_batch_size_per_device_for_update = False, 1
    for key, value in overrides.items():
        obj, (*path, leaf) = cfg, key.split(".")
        for part in path:
            obj = getattr(obj, part)
        setattr(obj, leaf, value)
    return trainer.actor.Actor(cfg, role="actor", device="cpu", max_prompt_length=16, max_response_length=8,
                               n_per_prompt=2, training_steps=training_steps)


def on_policy(policy, lengths=(1, 2, 3, 4), advantages=(1.0, -1.0, 0.5, 2.0)):
    """Text samples (prompt of 5 tokens) with old log-probs = the policy's own: every ratio is exactly 1."""
    samples = [{"prompt_ids": [11 + i, 12, 13, 14, 15], "response_ids": [20 + i + t for t in range(n)], "advantage": a}
               for i, (n, a) in enumerate(zip(lengths, advantages))]
    for s, logp in zip(samples, policy.compute_log_probs(samples)):
        s["old_logprobs"] = logp
    return samples


def applied_lrs(policy):
    """Records the learning rate of every optimizer step."""
    lrs, step = [], policy.optimizer.step
    policy.optimizer.step = lambda *a, **k: lrs.append(policy.optimizer.param_groups[0]["lr"]) or step(*a, **k)
    return lrs


@pytest.mark.parametrize("mode, expected", [
    # on policy the per-token loss is -A; lengths 1, 2, 3, 4 and advantages 1, -1, 0.5, 2
    ("token", -(1 * 1 - 1 * 2 + 0.5 * 3 + 2 * 4) / 10),       # sum_i A_i |o_i| / tokens = -0.85
    ("seq", -(1 - 1 + 0.5 + 2) / 4),                           # mean of sequence means = -0.625
    ("seq_sum_norm", -(1 * 1 - 1 * 2 + 0.5 * 3 + 2 * 4) / (4 * 8)),  # / (sequences x max_response_length)
])
def test_loss_values_of_the_aggregation_modes(toy, mode, expected):
    policy = text_actor(toy, loss_avg_mode=mode)  # 4 micro-batches of one sample: the global counts matter
    metrics = policy.update(on_policy(policy))
    assert metrics["actor/pg_loss"] == pytest.approx(expected, rel=1e-6)


def test_gradient_clipping_to_max_grad_norm_logs_the_norm_before(toy):
    grads = {}

    def norm_at_step(max_grad_norm):
        policy = text_actor(toy, max_grad_norm=max_grad_norm)
        step = policy.optimizer.step

        def spy(*a, **k):
            grads[max_grad_norm] = [p.grad.clone() for p in policy.module.parameters() if p.grad is not None]
            return step(*a, **k)

        policy.optimizer.step = spy
        metrics = policy.update(on_policy(policy))
        return metrics["actor/grad_norm"], torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g) for g in grads[max_grad_norm]])).item()

    logged, applied = norm_at_step(1e9)  # no clipping: the norm of the gradient applied is the one logged
    assert logged == pytest.approx(applied, rel=1e-6) and logged > 1e-3
    small = logged / 10
    logged_clipped, applied_clipped = norm_at_step(small)
    assert logged_clipped == pytest.approx(logged, rel=1e-6)  # logged: before clipping
    assert applied_clipped == pytest.approx(small, rel=1e-5)  # applied: clipped to max_grad_norm
    for g, g_clipped in zip(grads[1e9], grads[small]):  # same direction, scaled by small / norm
        torch.testing.assert_close(g_clipped, g * small / (logged + 1e-6), rtol=1e-5, atol=1e-12)


def test_constant_schedule_warms_up_over_training_steps_and_logs_actor_lr(toy, tmp_path):
    """lr 1e-3, lr_warmup_steps 2, two mini-batches (optimizer steps) per training step: the schedule steps once
    per training step, from 0 (EasyR1): 0, 5e-4, 1e-3, 1e-3; both optimizer steps of an update share it.
    A checkpoint restores the schedule's position."""
    policy = text_actor(toy, global_batch_size=1, **{"optim.lr_warmup_steps": 2})
    lrs = applied_lrs(policy)
    logged = [policy.update(on_policy(policy))["actor/lr"] for _ in range(2)]
    assert logged == pytest.approx([0.0, 5e-4]) and lrs == pytest.approx([0.0, 0.0, 5e-4, 5e-4])
    policy.save_checkpoint(str(tmp_path / "actor"))
    resumed = text_actor(toy, global_batch_size=1, **{"optim.lr_warmup_steps": 2})
    resumed.load_checkpoint(str(tmp_path / "actor"))
    assert [resumed.update(on_policy(resumed))["actor/lr"] for _ in range(2)] == pytest.approx([1e-3, 1e-3])
    # the warm-up as a ratio of the training steps: int(0.7 x 4) = 2 steps (rounded down, as EasyR1), the same schedule
    policy = text_actor(toy, **{"optim.lr_warmup_ratio": 0.7})
    assert [policy.update(on_policy(policy))["actor/lr"] for _ in range(3)] == pytest.approx([0.0, 5e-4, 1e-3])


def test_cosine_schedule_by_hand():
    """warm-up 1 of 5 training steps, min_lr_ratio 0.1: 0, then 0.1 + 0.9 (1 + cos(pi k / 4)) / 2, k = 0..3."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    o = OptimConfig(lr=2.0, lr_warmup_steps=1, lr_scheduler_type="cosine", min_lr_ratio=0.1)
    schedule = trainer.actor.lr_schedule(optimizer, o, 5)
    lrs = []
    for _ in range(5):
        lrs.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    expected = [0.0] + [2.0 * (0.1 + 0.9 * (1 + math.cos(math.pi * k / 4)) / 2) for k in range(4)]
    assert lrs == pytest.approx(expected)
    assert expected[1:] == pytest.approx([2.0, 2.0 * (0.1 + 0.45 * (1 + 0.5 ** 0.5)), 1.1,
                                          2.0 * (0.1 + 0.45 * (1 - 0.5 ** 0.5))])


def test_reinforce_plus_plus_gets_token_kl_and_token_returns():
    """KL in the reward, k1 per token (OLD - REF), the adaptive controller resumed at beta 0.2 (kl_coef 0.1):
    token rewards r = score on the last token - 0.2 kl_t; returns G_t = sum_{s >= t} r_s: response 1 (score 1,
    kl 0.5, -1): G = (1.1, 1.2); response 2: (0,); response 3 (kl 1): (0.8,); response 4 (kl 0, 2): (0.6, 0.6).
    One advantage per token, whitened over the 6. Then the controller moves for the next step: KL 0.4375 vs
    target 0.1 -> error clipped to 0.2, beta 0.2 x (1 + 0.2 x 4 / 1) = 0.36."""
    run = step_run("algorithm.use_kl_loss=false", "algorithm.kl_penalty=kl", "algorithm.kl_coef=0.1",
                   "algorithm.kl_type=adaptive", "algorithm.kl_target=0.1", "algorithm.kl_horizon=1",
                   "algorithm.adv_estimator=reinforce_plus_plus")
    run.kl_ctrl.value = 0.2
    m = run.train_step()
    returns = torch.tensor([1.1, 1.2, 0.0, 0.8, 0.6, 0.6], dtype=torch.float64)
    whitened = ((returns - returns.mean()) / torch.sqrt(returns.var() + 1e-8)).tolist()
    got = torch.cat([torch.as_tensor(s["advantage"]) for s in run.workers.updated]).tolist()
    assert got == pytest.approx(whitened, abs=1e-6)
    assert m["critic/returns/mean"] == pytest.approx(returns.mean().item())
    assert (m["critic/returns/max"], m["critic/returns/min"]) == pytest.approx((1.2, 0.0))
    assert m["critic/rewards/mean"] == pytest.approx(2.5 / 4) and m["critic/score/mean"] == 0.75
    assert m["actor/kl_coef"] == pytest.approx(0.2) and run.kl_ctrl.value == pytest.approx(0.36)


# --- online filtering in make_batch --------------------------------------------------------------

@pytest.mark.parametrize("estimator, y_overall, kept", [
    ("grpo", (0.5, 0.5), ["x", "z"]),  # y has no spread: its GRPO advantages would all be 0, so it is dropped
    ("reinforce_plus_plus", (0.5, 0.5), ["x", "y"]),  # y still trains REINFORCE++ (batch whitening): kept
    ("remax", (0.5, 0.5), ["x", "y"]),
    ("grpo", (0.4, 0.6), ["x", "y"]),  # y's accuracy is flat, its overall scores (GRPO's input) are not: kept
])
def test_online_filtering_keeps_flat_groups_only_where_their_advantage_is_not_zero(estimator, y_overall, kept, capsys):
    """Two prompts a round, n = 2, filter on accuracy in (0.1, 0.9) exclusive of the ends: round 1 has x
    (scores 0, 1: mean 0.5, spread) and y (0.5, 0.5: mean 0.5, no spread); round 2 z (1, 0) and w (1, 1:
    mean 1, outside). GRPO drops y and needs round 2; REINFORCE++ and ReMax keep x and y in round 1. The
    spread test reads the overall score, what the advantages use, not filter_key's."""
    table = {"x": (0.0, 1.0), "y": (0.5, 0.5), "z": (1.0, 0.0), "w": (1.0, 1.0)}
    run = two_round_run("data.rollout_batch_size=2", "worker.actor.global_batch_size=2",
                        "algorithm.online_filtering=true", "algorithm.filter_key=accuracy", "algorithm.filter_low=0.1",
                        "algorithm.filter_high=0.9", f"algorithm.adv_estimator={estimator}",
                        score=lambda p, j: {"overall": ({**table, "y": y_overall})[p][j], "accuracy": table[p][j]})
    prompts, responses, scores, _ = run.make_batch({})
    assert [p["name"] for p in prompts] == kept
    assert [r["prompt_index"] for r in responses] == [0, 0, 1, 1]
    said = "online filtering kept 1 of 2 groups in round 1, 1 of 2 so far: generating more"  # each short round said
    assert (said in capsys.readouterr().out) == ("z" in kept)  # (max_try_make_batch <= 0 looped without a word)


@pytest.mark.parametrize("filtering", [True, False])
def test_the_round_limit_names_what_to_change(filtering):
    """max_try_make_batch 2 and one prompt a round (of 2 asked) where 4 are wanted: the error after two rounds advises
    on the filter only when online filtering is on; without it the rounds are few because mini_rollout_batch_size is."""
    run = bare_run("data.rollout_batch_size=4", "data.mini_rollout_batch_size=2", "worker.rollout.n=2",
                   "worker.actor.global_batch_size=2", "trainer.n_gpus_per_node=1", "worker.rollout.name=hf",
                   "trainer.max_try_make_batch=2", f"algorithm.online_filtering={str(filtering).lower()}")
    run.train_iter = iter([[{"name": "x"}]] * 3)
    run.workers = types.SimpleNamespace(generate=lambda prompts, sampling: [
        {"prompt_index": 0, "uid": prompts[0]["uid"], "response_ids": [1], "j": j} for j in range(2)])
    run.sampling = lambda key, override=None: {"n": 2, "seed": 0}
    run.score = lambda prompts, responses: [{"overall": float(r["j"])} for r in responses]
    with pytest.raises(RuntimeError, match=r"2 of 4 groups after 2 generation rounds \(trainer.max_try_make_batch\); "
                       + ("widen algorithm.filter_low" if filtering else "raise it or data.mini_rollout_batch_size")):
        run.make_batch({})


def test_a_resumed_validation_joins_the_row_of_its_step(tmp_path):
    """Resumed at step 2 (the log cut back to rows 1 and 2), validation before training amends row 2 in place:
    each step keeps exactly one row; with no row of that step (a fresh log) it is a row of its own."""
    cfg = load_config(None, ["trainer.logger=[file]"])
    logger = run_folder.Logger(str(tmp_path), cfg.trainer.logger, cfg)
    logger.log({"reward/overall": 0.1}, 1)
    logger.log({"reward/overall": 0.2, "val/reward_score": 0.5}, 2)
    logger.log({"val/reward_score": 0.7}, 2, amend=True)
    logger.log({"reward/overall": 0.3}, 3)
    logger.close()
    rows = [json.loads(line) for line in open(tmp_path / "experiment_log.jsonl")]
    assert rows == [{"step": 1, "reward/overall": 0.1}, {"step": 2, "reward/overall": 0.2, "val/reward_score": 0.7},
                    {"step": 3, "reward/overall": 0.3}]
    (tmp_path / "fresh").mkdir()
    logger = run_folder.Logger(str(tmp_path / "fresh"), cfg.trainer.logger, cfg)
    logger.log({"val/reward_score": 0.4}, 5, amend=True)
    logger.close()
    assert [json.loads(line) for line in open(tmp_path / "fresh" / "experiment_log.jsonl")] == \
        [{"step": 5, "val/reward_score": 0.4}]


def test_a_log_resumed_twice_from_one_checkpoint_stays_whole(tmp_path, capsys):
    """Resumed twice from the checkpoint of step 2, each time validating (amending row 2, which grows) and dying
    during step 3: rewind(2) keeps rows up to step 2 whole, whatever their length now, and drops the rest; a line
    cut short by a crash goes too. A rewind by the byte size saved with the checkpoint cut row 2 in half."""
    cfg = load_config(None, ["trainer.logger=[file]"])
    logger = run_folder.Logger(str(tmp_path), cfg.trainer.logger, cfg)
    logger.log({"val/reward_score": 0.1}, 0)
    logger.log({"reward/overall": 0.1}, 1)
    logger.log({"reward/overall": 0.2}, 2)
    logger.flush()  # the checkpoint of step 2
    for score in (0.123456789, 0.5):
        logger.log({"reward/overall": 0.3}, 3)
        logger.jsonl.write('{"step": 4, "rew')  # killed while writing
        logger.jsonl.flush()
        logger.rewind(2)
        logger.log({"val/reward_score": score}, 2, amend=True)
    logger.close()
    rows = [json.loads(line) for line in open(tmp_path / "experiment_log.jsonl")]
    assert rows == [{"step": 0, "val/reward_score": 0.1}, {"step": 1, "reward/overall": 0.1},
                    {"step": 2, "reward/overall": 0.2, "val/reward_score": 0.5}]
    assert "experiment_log.jsonl: dropped 2 lines of the steps that run again" in capsys.readouterr().out
    logger = run_folder.Logger(str(tmp_path), cfg.trainer.logger, cfg)
    logger.rewind(-1)  # a fresh start: every row goes
    logger.close()
    assert (tmp_path / "experiment_log.jsonl").read_text() == ""


def test_a_failing_worker_is_reported_while_another_still_runs(monkeypatch):
    """WorkerGroup._get raises the first failure as soon as it is there: rank 1 fails while rank 0 never returns
    (as when it waits in a collective for rank 1). A plain ray.get of both would wait for rank 0 first."""
    class Failed(Exception):
        cause = None  # RayTaskError's: the worker's own exception

    class FakeRay:
        class exceptions:
            RayActorError = type("RayActorError", (Exception,), {})
            RayTaskError = Failed

        @staticmethod
        def wait(refs, num_returns):
            ready = [r for r in refs if r != "hangs"]
            assert ready, "waited for a worker that never returns"
            return ready[:num_returns], [r for r in refs if r not in ready[:num_returns]]

        @staticmethod
        def get(refs):
            if "hangs" in refs:
                raise AssertionError("ray.get on a worker that never returns")
            if "fails" in refs:
                raise Failed("CUDA out of memory on rank 1")
            return refs

    monkeypatch.setattr(workers, "ray", FakeRay)
    group = workers.WorkerGroup.__new__(workers.WorkerGroup)
    with pytest.raises(RuntimeError, match="a worker failed during actor update:\nCUDA out of memory on rank 1"):
        group._get(["hangs", "fails"], "actor update")
    assert group._get(["a", "b"], "setup") == ["a", "b"]


def test_shard_keeps_a_prompts_responses_on_one_rank_when_groups_divide():
    """8 samples (uids a..d, two each; lengths 10+x) over 2 ranks: whole groups, 4 samples a rank, groups balanced
    by tokens (a 20+21, d 26+27 vs b 22+23, c 24+25: 94 each); 3 groups over 2 ranks fall back to samples."""
    group = workers.WorkerGroup.__new__(workers.WorkerGroup)
    group.world, group.mini_batch = 2, 8
    samples = [{"uid": u, "prompt_ids": [0] * 10, "response_ids": [0] * (10 + k)} for k, u in enumerate("aabbccdd")]
    lists, indices = group.shard(samples)
    assert sorted(map(sorted, indices)) == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert all(len({s["uid"] for s in part}) == 2 for part in lists)
    group.mini_batch = 6
    lists, indices = group.shard(samples[:6])
    assert sorted(len(i) for i in indices) == [3, 3] and sorted(sum(indices, [])) == list(range(6))


def test_without_filtering_reward_metrics_are_over_the_trained_responses():
    """rollout_batch_size 3, rounds of 2 prompts, n = 2, no filtering: round 2's second prompt is generated but not
    trained on. As EasyR1 (reward/* of the truncated batch), reward/overall is over the 6 responses kept: prompts
    x, y, z scored (1, 1), (0, 0), (1, 0) -> 3 / 6, not over w's (1, 1) too (5 / 8). With filtering it is over every
    response generated, dropped ones too (EasyR1)."""
    table = {"x": (1.0, 1.0), "y": (0.0, 0.0), "z": (1.0, 0.0), "w": (1.0, 1.0)}
    run = two_round_run("data.rollout_batch_size=3", "data.mini_rollout_batch_size=2",
                        "worker.actor.global_batch_size=3", score=lambda p, j: {"overall": table[p][j]})
    metrics = {}
    prompts, responses, scores, rewards = run.make_batch(metrics)
    assert [p["name"] for p in prompts] == ["x", "y", "z"] and metrics["filter/rounds"] == 2
    assert rewards == {"reward/overall": 0.5}


def test_a_filter_key_the_reward_does_not_return_names_the_key_and_the_scores():
    """algorithm.filter_key=accuracy_normalized (the dapo reward's) with a reward that returns overall and accuracy:
    an error naming the key and the keys there are (was a bare KeyError: 'accuracy_normalized')."""
    run = bare_run("data.rollout_batch_size=2", "worker.rollout.n=2", "worker.actor.global_batch_size=2",
                   "trainer.n_gpus_per_node=1", "worker.rollout.name=hf", "algorithm.online_filtering=true",
                   "algorithm.filter_key=accuracy_normalized")
    run.train_iter = iter([[{"name": "x"}, {"name": "y"}]])
    run.workers = types.SimpleNamespace(generate=lambda prompts, sampling: [
        {"prompt_index": i, "uid": p["uid"], "response_ids": [1]} for i, p in enumerate(prompts) for _ in range(2)])
    run.sampling = lambda key, override=None: {"n": 2, "seed": 0}
    run.score = lambda prompts, responses: [{"overall": 1.0, "accuracy": 1.0} for _ in responses]
    with pytest.raises(ConfigError, match=re.escape("algorithm.filter_key='accuracy_normalized': the reward returns "
                                                    "['overall', 'accuracy']")):
        run.make_batch({})


def test_batch_metrics_by_hand():
    """Prompts of 4 and 2 tokens (limit 4); responses 3 (no EOS), 1 of prompt 0 and 2 of prompt 1: 6 response and
    4+3 + 4+1 + 2+2 = 16 batch tokens on 2 GPUs. |rollout - old| per token: 0.5, 0, 0.5 | 0.75 | 0, 0."""
    cfg = load_config(None, ["trainer.n_gpus_per_node=2", "data.max_prompt_length=4"])
    prompts = [{"prompt_ids": [7] * 4}, {"prompt_ids": [7] * 2}]
    responses = [{"prompt_index": i, "response_ids": [5] * k, "finish_reason": f}
                 for i, k, f in ((0, 3, "length"), (0, 1, "stop"), (1, 2, "stop"))]
    pairs = [([-1.0, -2.0, -3.0], [-1.5, -2.0, -2.5]), ([-1.0], [-0.25]), ([-0.5, -0.5], [-0.5, -0.5])]
    samples = [{"prompt_ids": prompts[r["prompt_index"]]["prompt_ids"], "response_ids": r["response_ids"],
                "rollout_logprobs": torch.tensor(a), "old_logprobs": torch.tensor(b)}
               for r, (a, b) in zip(responses, pairs)]
    timing = {"step": 4.0, "gen": 0.3, "reward": 0.06, "old": 0.8, "ref": 1.6, "adv": 0.08, "update_actor": 2.4}
    out = trainer._batch_metrics(prompts, responses, samples, cfg, {f"timing_s/{k}": v for k, v in timing.items()})
    assert out == pytest.approx({
        "response_length/mean": 2.0, "response_length/max": 3, "response_length/min": 1,
        "response_length/clip_ratio": 1 / 3, "prompt_length/mean": 10 / 3, "prompt_length/max": 4,  # once a response
        "prompt_length/min": 2, "prompt_length/clip_ratio": 2 / 3,
        "rollout/logp_diff_mean": 1.75 / 6, "rollout/logp_diff_max": 0.75,
        "perf/total_num_tokens": 16, "perf/time_per_step": 4.0, "perf/throughput": 16 / 4.0 / 2,  # per GPU
        # ms per token: gen and reward over the 6 response tokens, the passes over the batch over all 16
        "timing_per_token_ms/gen": 50.0, "timing_per_token_ms/reward": 10.0, "timing_per_token_ms/old": 50.0,
        "timing_per_token_ms/ref": 100.0, "timing_per_token_ms/adv": 5.0, "timing_per_token_ms/update_actor": 150.0})


def test_with_filtering_reward_metrics_are_over_every_response_generated():
    """rollout_batch_size 2, rounds of x (0, 1), y (1, 1) then z (1, 0), w (1, 1): y and w (mean 1) are dropped.
    EasyR1: reward/overall over all 8 responses generated = 6 / 8 (over the 4 kept: 2 / 4); every key averaged."""
    table = {"x": (0.0, 1.0), "y": (1.0, 1.0), "z": (1.0, 0.0), "w": (1.0, 1.0)}
    run = two_round_run("data.rollout_batch_size=2", "worker.actor.global_batch_size=2",
                        "algorithm.online_filtering=true", score=lambda p, j: {"overall": table[p][j], "format": 0.5})
    prompts, _, _, rewards = run.make_batch({})
    assert [p["name"] for p in prompts] == ["x", "z"]
    assert rewards == {"reward/overall": 0.75, "reward/format": 0.5}
