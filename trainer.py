"""trainer.py: the command line, the Ray workers and the GRPO loop. The only module that imports the stages.

    python trainer.py                                   # the offline toy default (configs/toy.yaml)
    python trainer.py --config configs/geo3k.yaml       # Qwen2.5-VL-7B on Geometry3K
    python trainer.py --config X.yaml worker.rollout.n=8 algorithm.kl_coef=0.001
    python trainer.py --config X.yaml --print-config    # the resolved config, then exit

The config (EasyR1's sections and keys as dataclasses, YAML and `a.b.c=value` overrides, cross-key
checks) is config.py; check_choices here checks the values each stage accepts against its own table.

Differences from EasyR1 (and why):
- Values are never copied between sections behind the reader's back: a stage that needs a value
  from another section is handed it explicitly here.
- No single-controller RPC layer and no DataProto: plain Ray actors, `ray.get([w.method.remote(shard)])`,
  and lists of dicts that the driver splits (balanced by tokens, per mini-batch) and joins itself.
- Rewards are computed on the driver from decoded strings (no reward actor, no images pickled to it);
  `timing_s/reward` is the real time spent, where EasyR1 timed only the submission of an async call.
- Online filtering also drops groups without spread (their GRPO advantages are all 0); EasyR1 kept an
  all-wrong but well-formatted group whose mean passed the thresholds.
- Rollout seeds mix (seed, step, rank): a fresh, reproducible stream every step.
- Logs are appended on resume (EasyR1 truncated them), cut back to the checkpoint resumed from, so each
  step's row is there once after any crash; the checkpoint tracker is written last and atomically, and a
  resume checks every file of a checkpoint first, falling back to the newest complete one; checkpoints
  resume on any number of workers; `save_model_only` checkpoints refuse to resume with a clear message.
- The adaptive KL coefficient is saved and restored with the checkpoint.
"""

import argparse
import copy
import dataclasses
import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import threading
import time

import torch
import yaml
from tqdm import tqdm

import actor
import advantage
import data
import reward
import rollout
from config import ConfigError, config_to_dict, load_config

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIG = os.path.join(HERE, "configs", "toy.yaml")

# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------

def fit(cfg):
    """Train: steps, validation every val_freq steps, checkpoints every save_freq. Returns the last metrics."""
    check_choices(cfg)
    run = Run(cfg)
    try:
        return run.fit()
    except KeyboardInterrupt:
        print(f"\ninterrupted at step {run.step}; the last complete checkpoint is in {run.ckpt_root}", flush=True)
        raise SystemExit(130)
    finally:
        run.close()


def training_steps(cfg, batches_per_epoch):
    """trainer.max_steps, else the epochs' worth of steps, as EasyR1 counts them:
    batches_per_epoch x mini_rollout_batch_size // rollout_batch_size x total_epochs (the loader's batches are
    generation rounds of mini_rollout_batch_size prompts when that is set), else batches_per_epoch x total_epochs."""
    t, d = cfg.trainer, cfg.data
    if t.max_steps is not None:
        return t.max_steps
    if d.mini_rollout_batch_size is not None:
        steps = batches_per_epoch * d.mini_rollout_batch_size // d.rollout_batch_size * t.total_epochs
    else:
        steps = batches_per_epoch * t.total_epochs
    if steps < 1:
        raise ConfigError(f"{batches_per_epoch} batches of {d.mini_rollout_batch_size or d.rollout_batch_size} prompts "
                          f"per epoch make no step of data.rollout_batch_size={d.rollout_batch_size} prompts; "
                          f"lower it or set trainer.max_steps")
    return steps


class Run:
    """Driver state: config, data, workers, loggers. Only plain lists and dicts cross to the workers."""

    def __init__(self, cfg):
        self.cfg, t = cfg, cfg.trainer
        _ensure_toy_world(cfg)
        self.ckpt_root = os.path.abspath(t.save_checkpoint_path or os.path.join("checkpoints", t.project_name, t.experiment_name))
        os.makedirs(self.ckpt_root, exist_ok=True)
        checkpoint = _find_checkpoint(self.ckpt_root, t.load_checkpoint_path, t.find_last_checkpoint)  # before Ray starts
        self.logger = Logger(self.ckpt_root, t.logger, cfg)
        model_path = cfg.worker.actor.model.model_path
        tokenizer_path = cfg.worker.actor.model.tokenizer_path or model_path
        remote = cfg.worker.actor.model.trust_remote_code
        self.processor, self.tokenizer = data.load_processor(tokenizer_path, cfg.data, trust_remote_code=remote)
        self.train_loader = data.PromptLoader(cfg.data.train_files, cfg.data, self.processor, model_path,
                                              batch_size=cfg.data.mini_rollout_batch_size or cfg.data.rollout_batch_size,
                                              shuffle=cfg.data.shuffle, drop_last=True, trust_remote_code=remote)
        self.val_loader = data.PromptLoader(cfg.data.val_files, cfg.data, self.processor, model_path,
                                            batch_size=cfg.data.val_batch_size, shuffle=False, drop_last=False,
                                            trust_remote_code=remote)
        # vLLM's limit_mm_per_prompt for videos: the most in one row (0 reserves no memory for video)
        cfg.worker.rollout.limit_videos = max(self.train_loader.videos_per_prompt, self.val_loader.videos_per_prompt)
        rw = cfg.worker.reward
        kwargs = dict(rw.reward_function_kwargs)
        if rw.reward_function in ("math", "r1v"):  # the built-ins that compare answers with a timeout
            kwargs.setdefault("timeout", rw.timeout)
        self.reward_fn = reward.load_reward_function(rw.reward_function, call_timeout=rw.call_timeout, **kwargs)
        self.kl_ctrl = (advantage.AdaptiveKLController(cfg.algorithm.kl_coef, cfg.algorithm.kl_target, cfg.algorithm.kl_horizon)
                        if cfg.algorithm.kl_type == "adaptive" else advantage.FixedKLController(cfg.algorithm.kl_coef))
        self.training_steps = training_steps(cfg, self.train_loader.batches_per_epoch)
        self.workers = WorkerGroup(cfg, self.training_steps)
        self.step, self.best = 0, {"best_global_step": None, "best_val_reward_score": None}
        self._resume(checkpoint)

    def fit(self):
        cfg, t = self.cfg, self.cfg.trainer
        metrics = {}
        if t.val_before_train or t.val_only:  # also when resuming, as EasyR1
            metrics = self.validate()
            self.logger.log(metrics, self.step, amend=self.step > 0)  # resumed: into the row of the step it resumes
            if t.val_only:
                return metrics
        bar = tqdm(total=self.training_steps, initial=self.step, desc="steps", disable="console" not in t.logger)
        while self.step < self.training_steps:
            self.step += 1
            try:
                metrics = self.train_step()
            except RuntimeError as error:  # a worker failed or died: say where, then stop
                raise RuntimeError(f"training stopped at step {self.step}: {error}") from None
            last = self.step == self.training_steps
            if last or (t.val_freq > 0 and self.step % t.val_freq == 0):  # the last step always validates
                with timer(metrics, "validation"):
                    metrics.update(self.validate())
            if (t.save_freq > 0 and self.step % t.save_freq == 0) or last:
                self.save_checkpoint(metrics)  # logs this step's row before the checkpoint is complete
            else:
                self.logger.log(metrics, self.step)
            bar.update(1)
            bar.set_postfix({k.split("/")[-1]: f"{metrics[k]:.3f}" for k in ("reward/overall", "val/reward_score") if k in metrics})
        bar.close()
        plot = self.logger.plot()
        print(f"done: metrics in {self.logger.jsonl_path}" + (f", plot in {plot}" if plot else "")
              + f", checkpoints in {self.ckpt_root}", flush=True)
        return metrics

    def train_step(self):
        """One GRPO step: prompts -> sync -> generate -> reward -> filter -> log-probs -> advantages -> update."""
        cfg, metrics = self.cfg, {}
        with timer(metrics, "step"):
            with timer(metrics, "sync"):
                self.workers.sync_weights()
            with timer(metrics, "gen"):
                prompts, responses, scores, reward_metrics = self.make_batch(metrics)
            samples = [_sample(prompts[r["prompt_index"]], r) for r in responses]
            with timer(metrics, "old"):
                old = self.workers.log_probs(samples, kind="old")
            use_ref = not cfg.algorithm.disable_kl
            if use_ref:
                with timer(metrics, "ref"):
                    ref = self.workers.log_probs(samples, kind="ref")
            with timer(metrics, "adv"):
                raw = torch.tensor([s["overall"] for s in scores], dtype=torch.float64)  # [N] the reward function's
                values, token_kl, beta = raw, None, self.kl_ctrl.value  # values: the rewards, minus beta x KL
                lengths = [len(s["response_ids"]) for s in samples]
                for sample, lp in zip(samples, old):
                    sample["old_logprobs"] = lp
                if use_ref:
                    for sample, lp in zip(samples, ref):
                        sample["ref_logprobs"] = lp
                    if not cfg.algorithm.use_kl_loss:  # KL in the reward: kl_t = kl_penalty(old, ref) per token
                        token_kl = [actor.kl_penalty(s["old_logprobs"], s["ref_logprobs"], cfg.algorithm.kl_penalty)
                                    for s in samples]                                        # N x [L_i]
                        kl = torch.tensor([float(k.sum()) for k in token_kl], dtype=torch.float64)  # [N]
                        values = advantage.kl_in_reward(raw, kl, beta)
                        current_kl = float((kl / torch.tensor(lengths).clamp(min=1)).mean())
                        metrics.update({"actor/kl_penalty": current_kl, "actor/kl_coef": beta})
                        self.kl_ctrl.update(current_kl, n_steps=len(samples))
                uids, name = [s["uid"] for s in samples], cfg.algorithm.adv_estimator
                baselines = None
                if name == "remax":
                    baselines = torch.tensor([self.greedy_reward[u] for u in uids], dtype=torch.float64)
                adv = advantage.compute_advantages(name, raw, uids, baselines=baselines, lengths=lengths, token_kl=token_kl,
                                                   kl_coef=beta, norm_by_std=cfg.algorithm.norm_adv_by_std_in_grpo)
                per_token = name in advantage.TOKEN_LEVEL  # adv: N tensors [L_i], else [N]
                for sample, a in zip(samples, adv if per_token else adv.tolist()):
                    sample["advantage"] = a
                # critic/score/* and adv/zero_std_group_frac from the raw scores; EasyR1's returns: the rewards-to-go
                # for remax and REINFORCE++, the advantages themselves for the group estimators
                if per_token:  # statistics over tokens, as EasyR1
                    returns = torch.cat([r.flip(0).cumsum(0).flip(0) for r in advantage.token_rewards(raw, lengths, token_kl, beta)])
                    metrics.update(advantage.advantage_metrics(raw, torch.stack([a.mean() for a in adv]), uids))
                    metrics.update(_stats("critic/advantages", torch.cat(adv).tolist()))
                else:
                    returns = values if name == "remax" else adv
                    metrics.update(advantage.advantage_metrics(raw, adv, uids))
                metrics.update({**_stats("critic/rewards", values.tolist()), **_stats("critic/returns", returns.tolist())})
            with timer(metrics, "update_actor"):
                metrics.update(self.workers.update(samples))
        metrics.update(reward_metrics)
        metrics.update(_batch_metrics(prompts, responses, samples, old, cfg, metrics))
        return metrics

    def make_batch(self, metrics):
        """Generate until `rollout_batch_size` groups are kept (online filtering) or one round without it."""
        cfg, a = self.cfg, self.cfg.algorithm
        want, n = cfg.data.rollout_batch_size, cfg.worker.rollout.n
        kept_prompts, kept_responses, kept_scores, all_scores = [], [], [], []
        self.greedy_reward = {}  # ReMax baselines of this step's prompts
        rounds = 0
        while len(kept_prompts) < want:
            rounds += 1
            if cfg.trainer.max_try_make_batch > 0 and rounds > cfg.trainer.max_try_make_batch:
                raise RuntimeError(
                    f"online filtering kept {len(kept_prompts)} of {want} groups after "
                    f"{rounds - 1} rounds (trainer.max_try_make_batch); widen algorithm.filter_low/filter_high, "
                    f"raise max_try_make_batch, or disable algorithm.online_filtering")
            prompts = next(self.train_iter)
            for i, p in enumerate(prompts):
                p["uid"] = f"{self.step}-{rounds}-{i}"
            responses = self.workers.generate(prompts, self.sampling(), step=self.step * 1000 + rounds)
            with timer(metrics, "reward"):
                scores = self.score(prompts, responses)
            all_scores += scores
            if a.adv_estimator == "remax":
                greedy = self.workers.generate(prompts, {**self.sampling(), "temperature": 0.0, "n": 1}, step=self.step)
                for p, s in zip(prompts, self.score(prompts, greedy)):
                    self.greedy_reward[p["uid"]] = s["overall"]
            if a.online_filtering:
                keep = advantage.groups_to_keep([s[a.filter_key] for s in scores], [r["uid"] for r in responses],
                                                low=a.filter_low, high=a.filter_high,
                                                require_spread=a.adv_estimator in advantage.ZERO_WHEN_FLAT)
            else:
                keep = {p["uid"] for p in prompts}
            index = {}
            for i, p in enumerate(prompts):
                if p["uid"] in keep and len(kept_prompts) < want:
                    index[i] = len(kept_prompts)
                    kept_prompts.append(p)
            for r, s in zip(responses, scores):
                if r["prompt_index"] in index:
                    kept_responses.append({**r, "prompt_index": index[r["prompt_index"]]})
                    kept_scores.append(s)
        self.workers.sleep()
        metrics["filter/rounds"] = rounds
        reward_metrics = {f"reward/{k}": sum(s[k] for s in all_scores) / len(all_scores) for k in all_scores[0]}
        assert len(kept_responses) == want * n
        return kept_prompts, kept_responses, kept_scores, reward_metrics

    def sampling(self, override=None):
        """rollout's sampling settings (val_override_config applied and checked) + max_tokens and base seed."""
        settings = rollout.sampling_settings(self.cfg.worker.rollout, override)
        return {**settings, "max_tokens": self.cfg.data.max_response_length, "seed": self.cfg.worker.rollout.seed}

    def score(self, prompts, responses):
        """Decode and score every response on the driver (strings in, dicts of floats out)."""
        skip = self.cfg.worker.reward.skip_special_tokens
        inputs = []
        for r in responses:
            p = prompts[r["prompt_index"]]
            inputs.append({"response": self.tokenizer.decode(r["response_ids"], skip_special_tokens=skip),
                           "response_length": len(r["response_ids"]), "ground_truth": p["ground_truth"],
                           "prompt": p["prompt_text"], "extra": p.get("extra", {})})
        return self.reward_fn(inputs)

    def validate(self):
        cfg = self.cfg
        sampling = self.sampling(cfg.worker.rollout.val_override_config)
        self.workers.sync_weights()
        scores, lengths, logged = [], [], []
        for prompts in self.val_loader.epoch():
            responses = self.workers.generate(prompts, sampling, step=-1)
            batch_scores = self.score(prompts, responses)
            scores += batch_scores
            lengths += [len(r["response_ids"]) for r in responses]
            for r, s in zip(responses, batch_scores):
                if len(logged) < cfg.trainer.val_generations_to_log:
                    p = prompts[r["prompt_index"]]
                    logged.append({"prompt": p["prompt_text"], "response": self.tokenizer.decode(r["response_ids"]),
                                   "ground_truth": p["ground_truth"], "score": s["overall"]})
        self.workers.sleep()
        metrics = {f"val/{k}_reward": sum(s[k] for s in scores) / len(scores) for k in scores[0]}
        metrics["val/reward_score"] = metrics["val/overall_reward"]
        metrics.update(_stats("val_response_length", lengths))
        self.logger.log_generations(logged, self.step)
        return metrics

    # --- checkpoints ---------------------------------------------------------------------------

    def save_checkpoint(self, metrics):
        """Write global_step_N/ (actor/, dataloader.pt), then log the step's row (`metrics`), then trainer_state.json
        with the log's size, then the tracker naming N; then remove old checkpoints.

        Why this order: a checkpoint is used only once trainer_state.json is written (see _checkpoint_problem), and
        the tracker, written last and atomically, names it only after that. The log is then an exact record:
        the step's row is on disk before its checkpoint is complete, and a resume cuts the log back to the size
        saved with the checkpoint it resumes from (Logger.rewind), dropping the rows of the steps that run again.
        So after a kill at any point and a resume, the log holds each step's row exactly once, in order.
        """
        t = self.cfg.trainer
        path = os.path.join(self.ckpt_root, f"global_step_{self.step}")
        with timer(metrics, "save_checkpoint"):
            shutil.rmtree(path, ignore_errors=True)  # left by a run that stopped while saving this step
            self.workers.save(os.path.join(path, "actor"), model_only=t.save_model_only)
            torch.save(self.train_loader.state_dict(), os.path.join(path, "dataloader.pt"))
        val_score = metrics.get("val/reward_score")
        if val_score is not None and (self.best["best_val_reward_score"] is None or val_score > self.best["best_val_reward_score"]):
            self.best = {"best_global_step": self.step, "best_val_reward_score": val_score}
        self.logger.log(metrics, self.step)
        state = {"global_step": self.step, "kl_coef": self.kl_ctrl.value, "resumable": not t.save_model_only, **self.best,
                 "log_sizes": self.logger.sizes()}
        _write_json_atomic(os.path.join(path, "trainer_state.json"), state)
        _write_json_atomic(os.path.join(self.ckpt_root, TRACKER), {"last_global_step": self.step, **self.best})
        _remove_old_checkpoints(self.ckpt_root, self.step, self.best["best_global_step"], t.save_limit)

    def _resume(self, path):
        """Load the checkpoint folder `path` (checked complete by _find_checkpoint), or start fresh when None."""
        t = self.cfg.trainer
        self.greedy_reward = {}
        if path is None:
            self.logger.rewind(dict.fromkeys(LOG_FILES, 0))  # rows of an earlier attempt: those steps run again
            self.train_iter = iter(self.train_loader)
            return
        state = json.load(open(os.path.join(path, "trainer_state.json")))
        try:
            self.workers.load(os.path.join(path, "actor"))
        except RuntimeError as e:
            hint = (" It was found through the tracker in trainer.save_checkpoint_path: if that folder holds another "
                    "run (a different model or config), pick a new folder or set trainer.find_last_checkpoint=false."
                    if t.load_checkpoint_path is None else "")
            raise RuntimeError(f"could not resume from {path}: {e}.{hint}") from None
        self.train_loader.load_state_dict(torch.load(os.path.join(path, "dataloader.pt"), weights_only=True))
        self.train_iter = iter(self.train_loader)
        self.kl_ctrl.value = state["kl_coef"]
        self.best = {k: state.get(k) for k in self.best}
        self.step = int(state["global_step"])
        if os.path.dirname(os.path.abspath(path)) == self.ckpt_root:  # this run's own log: back to the checkpoint
            self.logger.rewind(state.get("log_sizes", {}))
        print(f"resumed from {path} (step {self.step})", flush=True)

    def close(self):
        self.logger.close()
        self.workers.shutdown()


# ----------------------------------------------------------------------------------------------
# Workers: one Ray actor per GPU (per process on CPU), each hosting actor + reference + rollout
# ----------------------------------------------------------------------------------------------

try:  # Ray is needed to train, not to read or check a config
    import ray
except ImportError:  # pragma: no cover
    ray = None


class Worker:
    """Lives in its own process. Holds the policy (FSDP2), the reference and the rollout engine."""

    def setup(self, cfg, rank, world_size, master, device, training_steps):
        import torch.distributed as dist

        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0",
                           "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1])})
        if device == "cpu":
            torch.set_num_threads(max(1, _usable_cpus() // world_size))
        self.memory = {}  # phase -> peak GiB in use on the device, reported with the update
        if world_size > 1 and not dist.is_initialized():
            offload = device == "cuda" and cfg.worker.actor.fsdp.enable_cpu_offload  # CPU gradients: gloo reduces
            backend = "cuda:nccl,cpu:gloo" if offload else "nccl" if device == "cuda" else "gloo"  # their norm
            dist.init_process_group(backend, rank=rank, world_size=world_size)
        a, d, r = cfg.worker.actor, cfg.data, cfg.worker.rollout
        common = dict(temperature=r.temperature, device=device, max_prompt_length=d.max_prompt_length,
                      max_response_length=d.max_response_length, n_per_prompt=r.n, training_steps=training_steps,
                      use_kl_loss=cfg.algorithm.use_kl_loss and not cfg.algorithm.disable_kl,
                      kl_coef=cfg.algorithm.kl_coef, kl_penalty=cfg.algorithm.kl_penalty)
        self.actor = actor.Actor(a, role="actor", **common)
        needs_ref = not cfg.algorithm.disable_kl
        ref_cfg = dataclasses.replace(a, fsdp=cfg.worker.ref.fsdp, offload=cfg.worker.ref.offload)
        self.ref = actor.Actor(ref_cfg, role="ref", **common) if needs_ref and a.model.lora.rank == 0 else None
        r = copy.copy(r)
        r.trust_remote_code = a.model.trust_remote_code  # the model's setting, handed to vLLM
        self.rollout = rollout.make_rollout(r, a.model.model_path, max_prompt_length=d.max_prompt_length,
                                            max_response_length=d.max_response_length, device=device,
                                            tokenizer_path=a.model.tokenizer_path)
        self.rank = rank
        return True

    def sync_weights(self):
        with device_peak(self.memory, "sync"):
            self.rollout.load_weights(self.actor.named_tensors())  # vLLM wakes only its weights for this
            self.rollout.wake_up()  # then the KV cache

    def generate(self, prompts, sampling, step):  # also with no prompts: a TP peer may be waiting to gather
        seed = _mix_seed(sampling["seed"], step, self.rank)  # a fresh stream per step and rank, reproducible
        with device_peak(self.memory, "gen"):
            return self.rollout.generate(prompts, **{**sampling, "seed": seed})

    def sleep(self):
        self.rollout.sleep()

    def log_probs(self, samples, kind):
        with device_peak(self.memory, kind):
            if kind == "ref":
                return self.ref.compute_log_probs(samples) if self.ref else self.actor.compute_log_probs(samples, disable_adapter=True)
            return self.actor.compute_log_probs(samples)

    def update(self, samples):
        with device_peak(self.memory, "update"):
            metrics = self.actor.update(samples)
        metrics.update({f"perf/peak_device_memory_gb/{phase}": gib for phase, gib in self.memory.items()})
        self.memory.clear()
        return metrics

    def save(self, path, model_only):
        self.actor.onload(optimizer=True)  # offloaded state is saved and loaded on the device, as in EasyR1
        self.actor.save_checkpoint(path, model_only=model_only)
        self.actor.offload()

    def load(self, path):
        self.actor.onload(optimizer=True)
        self.actor.load_checkpoint(path)
        self.actor.offload()

    def address(self):
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]


class WorkerGroup:
    """The driver's handle on the workers: splits lists, calls every worker, joins the results."""

    def __init__(self, cfg, training_steps):
        t = cfg.trainer
        self.device = "cuda" if t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available()) else "cpu"
        self.world = t.nnodes * t.n_gpus_per_node
        self.tp = cfg.worker.rollout.tensor_parallel_size if cfg.worker.rollout.name == "vllm" else 1
        self.mini_batch = cfg.worker.actor.global_batch_size * cfg.worker.rollout.n  # divisible: check_config
        if not ray.is_initialized():
            kwargs = dict(include_dashboard=False, log_to_driver=True, runtime_env={"env_vars": _worker_env()})
            if "RAY_ADDRESS" in os.environ or _ray_cluster_running():
                ray.init(**kwargs)  # the user's cluster
            else:
                _start_local_ray(num_cpus=max(_usable_cpus(), self.world), **kwargs)
        gpu = 1 if self.device == "cuda" else 0
        self.pg = ray.util.placement_group([{"CPU": 1, "GPU": gpu} if gpu else {"CPU": 1}] * self.world, strategy="PACK")
        ray.get(self.pg.ready(), timeout=600)
        remote = ray.remote(Worker)
        self.workers = [remote.options(num_cpus=1, num_gpus=gpu, scheduling_strategy=ray.util.scheduling_strategies.
                                       PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i)).remote()
                        for i in range(self.world)]
        master = self._get([self.workers[0].address.remote()], "start")[0]
        self._get([w.setup.remote(cfg, i, self.world, master, self.device, training_steps)
                   for i, w in enumerate(self.workers)], "setup")

    def _get(self, refs, what):
        """ray.get that turns a dead or failing worker into one clear error instead of a hang."""
        try:
            return ray.get(refs)
        except ray.exceptions.RayActorError as e:
            raise RuntimeError(f"a worker died during {what}: {e}") from None
        except ray.exceptions.RayTaskError as e:
            raise RuntimeError(f"a worker failed during {what}:\n{e}") from None

    def sync_weights(self):
        self._get([w.sync_weights.remote() for w in self.workers], "weight sync")

    def sleep(self):
        self._get([w.sleep.remote() for w in self.workers], "rollout sleep")

    def generate(self, prompts, sampling, step):
        """Split prompts over all ranks, each its own share. The ranks of a tensor-parallel group hand their
        shares to one vLLM engine (rollout.py gathers them), which generates each prompt n times, once."""
        refs = [w.generate.remote(prompts[i::self.world], sampling, step) for i, w in enumerate(self.workers)]
        outs = self._get(refs, "generation")
        by_prompt = {}
        for rank, out in enumerate(outs):
            for r in out:
                index = r["prompt_index"] * self.world + rank  # rank i holds prompts i, i + world, ...
                by_prompt.setdefault(index, []).append({**r, "prompt_index": index})
        return [r for i in range(len(prompts)) for r in by_prompt.get(i, [])]

    def shard(self, samples):
        """Per mini-batch, balance samples across ranks by tokens, as many on each; a prompt's responses stay on one
        rank when the groups divide evenly (its image is then encoded once). -> (per-rank lists, per-rank indices)."""
        lists, indices = [[] for _ in range(self.world)], [[] for _ in range(self.world)]
        for start in range(0, len(samples), self.mini_batch):
            chunk = list(range(start, min(start + self.mini_batch, len(samples))))
            groups = {}
            for i in chunk:
                groups.setdefault(samples[i]["uid"], []).append(i)
            units = list(groups.values())
            if len(units) % self.world or len({len(u) for u in units}) > 1:
                units = [[i] for i in chunk]
            lengths = [sum(len(samples[i]["prompt_ids"]) + len(samples[i]["response_ids"]) for i in u) for u in units]
            for rank, part in enumerate(actor.partition_balanced(lengths, self.world, equal_size=True)):
                indices[rank] += [i for j in part for i in units[j]]
                lists[rank] += [samples[i] for j in part for i in units[j]]
        return lists, indices

    def log_probs(self, samples, kind):
        lists, indices = self.shard(samples)
        outs = self._get([w.log_probs.remote(l, kind) for w, l in zip(self.workers, lists)], f"{kind} log-probs")
        result = [None] * len(samples)
        for idx, out in zip(indices, outs):
            for i, lp in zip(idx, out):
                result[i] = lp
        return result

    def update(self, samples):
        lists, _ = self.shard(samples)
        outs = self._get([w.update.remote(l) for w, l in zip(self.workers, lists)], "actor update")
        return {k: sum(o[k] for o in outs) / len(outs) for k in outs[0]}

    def save(self, path, model_only):
        self._get([w.save.remote(path, model_only) for w in self.workers], "checkpoint save")

    def load(self, path):
        self._get([w.load.remote(path) for w in self.workers], "checkpoint load")

    def shutdown(self):
        for w in getattr(self, "workers", []):
            ray.kill(w)
        if getattr(self, "pg", None) is not None:
            ray.util.remove_placement_group(self.pg)


def _worker_env():
    env = {"TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]),
           "VLLM_LOGGING_LEVEL": "WARN", "NCCL_DEBUG": "WARN", "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
           "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
           "VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}
    for key in ("HF_HUB_OFFLINE", "HF_HOME", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def _ray_cluster_running():
    """True when `ray start --head` runs on this machine (ray.init() then joins it, as in EasyR1)."""
    return os.path.exists("/tmp/ray/ray_current_cluster")


def _start_local_ray(**kwargs):
    """ray.init of a one-machine Ray whose processes listen on 127.0.0.1 only. Ray 2.x listens on every interface
    unless the node address is 127.0.0.1, and ray.init replaces a 127.0.0.1 `_node_ip_address` with the machine's
    address unless its single-machine switch (ray_constants.ENABLE_RAY_CLUSTER, what RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
    sets) is off: it is turned off around the call, and the Ray processes get 127.0.0.1 as their address."""
    from ray._private import ray_constants

    saved, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
    try:
        ray.init(_node_ip_address="127.0.0.1", **kwargs)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


# ----------------------------------------------------------------------------------------------
# Metrics, logging, checkpoints: helpers of the loop
# ----------------------------------------------------------------------------------------------

TRACKER = "checkpoint_tracker.json"
LOG_FILES = ("experiment_log.jsonl", "generations.log")  # in the checkpoint root, cut back on resume (Logger.rewind)


def _sample(prompt, response):
    """One training sample (keys documented in actor.py) from a prompt and one of its responses."""
    return {"uid": prompt["uid"], "prompt_ids": prompt["prompt_ids"], "position_ids": prompt["position_ids"],
            "multi_modal_inputs": prompt["multi_modal_inputs"], "response_ids": response["response_ids"],
            "rollout_logprobs": torch.tensor(response["logprobs"], dtype=torch.float32)}


def _batch_metrics(prompts, responses, samples, old, cfg, metrics):
    """Lengths, rollout-vs-actor log-prob gap, throughput and timing per token (EasyR1's metrics.py: gen and
    reward per response token, the passes over the batch per prompt + response token)."""
    lengths = [len(r["response_ids"]) for r in responses]
    out = _stats("response_length", lengths)
    out["response_length/clip_ratio"] = sum(r["finish_reason"] == "length" for r in responses) / len(responses)
    out.update(_stats("prompt_length", [len(p["prompt_ids"]) for p in prompts]))
    out["prompt_length/clip_ratio"] = sum(len(p["prompt_ids"]) >= cfg.data.max_prompt_length for p in prompts) / len(prompts)
    diffs = torch.cat([(s["rollout_logprobs"] - lp.float()).abs() for s, lp in zip(samples, old) if len(lp)])
    if len(diffs):  # a broken weight sync shows up here first
        out.update({"rollout/logp_diff_mean": diffs.mean().item(), "rollout/logp_diff_max": diffs.max().item()})
    tokens = sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples)
    step_time = metrics.get("timing_s/step", 0.0)
    out.update({"perf/total_num_tokens": tokens, "perf/time_per_step": step_time,
                "perf/throughput": tokens / max(step_time, 1e-9) / (cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node)})
    for stage in ("gen", "reward", "old", "ref", "adv", "update_actor"):
        if f"timing_s/{stage}" in metrics:
            count = sum(lengths) if stage in ("gen", "reward") else tokens
            out[f"timing_per_token_ms/{stage}"] = 1000 * metrics[f"timing_s/{stage}"] / max(count, 1)
    return out


def _stats(prefix, values):
    return {f"{prefix}/mean": sum(values) / len(values), f"{prefix}/max": max(values), f"{prefix}/min": min(values)}


class timer:
    """with timer(metrics, "gen"): ... adds metrics["timing_s/gen"] (wall seconds of the real wait)."""

    def __init__(self, metrics, name):
        self.metrics, self.name = metrics, f"timing_s/{name}"

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.metrics[self.name] = self.metrics.get(self.name, 0.0) + time.perf_counter() - self.start


LOGGERS = {"console": None, "file": None, "tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow",
           "swanlab": "swanlab"}  # trainer.logger entries -> the package each needs


class device_peak:
    """with device_peak(memory, "gen"): ... keeps in memory["gen"] the most GiB in use on this process's GPU while
    the block ran, from the device itself (cudaMemGetInfo, polled every 5 ms: every process and allocator, vLLM's
    pool included; torch's max_memory_allocated counts vLLM's pool but not what it frees). No-op on the CPU."""

    def __init__(self, memory, name):
        self.memory, self.name, self.done, self.peak = memory, name, threading.Event(), 0

    def __enter__(self):
        if torch.cuda.is_available():
            device = torch.cuda.current_device()
            self.thread = threading.Thread(target=self._poll, args=(device,), daemon=True)
            self.thread.start()

    def _poll(self, device):
        while True:
            free, total = torch.cuda.mem_get_info(device)
            self.peak = max(self.peak, total - free)
            if self.done.wait(0.005):
                return

    def __exit__(self, *exc):
        if torch.cuda.is_available():
            self.done.set()
            self.thread.join()
            self.memory[self.name] = max(self.memory.get(self.name, 0.0), self.peak / 2**30)


class Logger:
    """Console (progress bar + a line per step), JSONL (always, appended); TensorBoard, W&B, MLflow and SwanLab
    when asked (as EasyR1: mlflow.start_run(experiment_name) + log_params of the flat config; swanlab.init with
    SWANLAB_API_KEY, SWANLAB_DIR and SWANLAB_MODE from the environment)."""

    def __init__(self, root, names, cfg):
        for name in names:  # before anything is written: a missing package is a one-line error
            if LOGGERS[name] and importlib.util.find_spec(LOGGERS[name]) is None:
                raise ConfigError(f"trainer.logger has {name}, but the {LOGGERS[name]} package is not installed: "
                                  f"pip install {LOGGERS[name]}, or remove {name} from trainer.logger")
        self.names, self.root = names, root
        self.jsonl_path = os.path.join(root, "experiment_log.jsonl")
        self.jsonl = open(self.jsonl_path, "a")  # appended on resume; rows after the checkpoint dropped (rewind)
        self.generations = open(os.path.join(root, "generations.log"), "a")
        _write_json_atomic(os.path.join(root, "experiment_config.json"), config_to_dict(cfg))
        self.tb = self.wandb = self.mlflow = self.swanlab = None
        t, config = cfg.trainer, config_to_dict(cfg)
        if "tensorboard" in names:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(root, "tensorboard"))
        if "wandb" in names:
            import wandb

            self.wandb = wandb.init(project=t.project_name, name=t.experiment_name, config=config, resume="allow")
        if "mlflow" in names:
            import mlflow

            self.mlflow = mlflow
            mlflow.start_run(run_name=t.experiment_name)
            mlflow.log_params(dict(_flatten(config)))
        if "swanlab" in names:
            import swanlab

            self.swanlab = swanlab
            if os.environ.get("SWANLAB_API_KEY"):
                swanlab.login(os.environ["SWANLAB_API_KEY"])
            swanlab.init(project=t.project_name, experiment_name=t.experiment_name, config=config,
                         logdir=os.environ.get("SWANLAB_DIR", os.path.join(root, "swanlab")),
                         mode=os.environ.get("SWANLAB_MODE", "cloud"))

    def log(self, metrics, step, amend=False):
        """One row per step in experiment_log.jsonl. amend: merge into the last row when it is `step`'s (a resumed
        run's validation of the step it resumes from), replacing the file atomically, so no step has two rows."""
        metrics = {k: float(v) for k, v in metrics.items()}
        lines = []
        if amend:
            with open(self.jsonl_path) as f:
                lines = f.readlines()
        if lines and lines[-1].endswith("\n") and json.loads(lines[-1]).get("step") == step:
            lines[-1] = json.dumps({**json.loads(lines[-1]), **metrics}) + "\n"
            with open(self.jsonl_path + ".tmp", "w") as f:
                f.writelines(lines)
                f.flush()
                os.fsync(f.fileno())
            self.jsonl.close()
            os.replace(self.jsonl_path + ".tmp", self.jsonl_path)
            self.jsonl = open(self.jsonl_path, "a")
        else:
            self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
            self.jsonl.flush()
        if "console" in self.names:
            keys = [k for k in ("reward/overall", "val/reward_score", "actor/pg_loss", "actor/entropy",
                                "response_length/mean", "timing_s/step") if k in metrics]
            tqdm.write(f"step {step}: " + "  ".join(f"{k}={metrics[k]:.4g}" for k in keys))
        if self.tb:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb:
            self.wandb.log(metrics, step=step)
        if self.mlflow:
            self.mlflow.log_metrics(metrics, step=step)
        if self.swanlab:
            self.swanlab.log(metrics, step=step)

    def sizes(self):
        """{file name: bytes} of the LOG_FILES, flushed to disk: saved with each checkpoint for rewind."""
        out = {}
        for f in (self.jsonl, self.generations):
            f.flush()
            os.fsync(f.fileno())
            out[os.path.basename(f.name)] = os.path.getsize(f.name)
        return out

    def rewind(self, sizes):
        """Cut each of the LOG_FILES back to its size in `sizes` (what sizes() returned when the checkpoint a run
        resumes from was saved; all 0 for a fresh start; a file not named is left alone). What is cut was written
        after that checkpoint, by steps that now run again (or a line cut short by a kill), and it is said."""
        for f in (self.jsonl, self.generations):
            keep, size = sizes.get(os.path.basename(f.name)), os.path.getsize(f.name)
            if keep is not None and size > keep:
                with open(f.name, "rb") as r:
                    r.seek(keep)
                    lines = r.read().count(b"\n")
                os.truncate(f.name, keep)  # appends continue at the new end (the file is open with O_APPEND)
                print(f"{f.name}: dropped the {lines} lines written after the checkpoint this run starts from "
                      f"(those steps run again)", flush=True)

    def log_generations(self, rows, step):
        for row in rows:
            self.generations.write(json.dumps({"step": step, **row}) + "\n")
            if "console" in self.names:
                tqdm.write(f"[prompt] {row['prompt']!r}\n[output] {row['response']!r}\n"
                           f"[ground_truth] {row['ground_truth']!r} [score] {row['score']:.3f}")
        self.generations.flush()

    def plot(self):
        """Reward, accuracy, format score and response length against steps (training batch and validation),
        from the JSONL log. Accuracy and format are the reward function's "accuracy" and "format" keys, if any."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        rows = [json.loads(line) for line in open(self.jsonl_path)]
        panels = {"reward": ("reward/overall", "val/reward_score"), "accuracy": ("reward/accuracy", "val/accuracy_reward"),
                  "format": ("reward/format", "val/format_reward"),
                  "response length": ("response_length/mean", "val_response_length/mean")}
        fig, axes = plt.subplots(1, len(panels), figsize=(17, 3.5))
        for ax, (title, keys) in zip(axes, panels.items()):
            for key, label in zip(keys, ("train", "validation")):
                points = sorted({r["step"]: r[key] for r in rows if key in r}.items())
                if points:
                    ax.plot(*zip(*points), marker="." if len(points) < 30 else None, label=label)
            ax.set_title(title)
            ax.set_xlabel("step")
            if ax.lines:
                ax.legend()
        fig.tight_layout()
        path = os.path.join(self.root, "metrics.png")
        fig.savefig(path, dpi=80)
        plt.close(fig)
        return path

    def close(self):
        self.jsonl.close()
        self.generations.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()
        if self.mlflow:
            self.mlflow.end_run()
        if self.swanlab:
            self.swanlab.finish()


def _write_json_atomic(path, obj):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class CheckpointError(RuntimeError):
    pass


def _find_checkpoint(root, load_path, find_last):
    """The global_step_N folder a run resumes from, or None for a fresh start. Reads files only (no Ray, no model).

    An explicit `load_path` (trainer.load_checkpoint_path) must be complete. Otherwise, with `find_last`, the
    tracker in `root` names the last checkpoint; when that one is incomplete (see _checkpoint_problem), the newest
    complete one before it is used and the run says so. An unreadable tracker is reported and the newest complete
    global_step_N folder is used. No tracker: a fresh start. A tracker but no complete checkpoint: an error.
    """
    if load_path is not None:
        if not re.search(r"global_step_(\d+)/?$", load_path) or not os.path.isdir(load_path):
            raise CheckpointError(f"trainer.load_checkpoint_path={load_path!r} must be an existing global_step_N folder")
        problem = _checkpoint_problem(load_path)
        if problem:
            raise CheckpointError(f"cannot resume from trainer.load_checkpoint_path={load_path}: {problem}")
        return load_path
    tracker = os.path.join(root, TRACKER)
    if not find_last or not os.path.exists(tracker):
        return None
    steps = sorted((int(m.group(1)) for n in os.listdir(root) if (m := re.fullmatch(r"global_step_(\d+)", n))), reverse=True)
    problems = []
    try:
        with open(tracker) as f:
            last = int(json.load(f)["last_global_step"])
        if last not in steps:
            problems.append(f"global_step_{last} (named by the tracker) does not exist")
        steps = [s for s in steps if s <= last]  # later folders were being written when the run stopped
    except (ValueError, KeyError, TypeError) as e:
        print(f"{tracker} cannot be read ({type(e).__name__}: {e}); looking for the newest complete checkpoint "
              f"in {root}", flush=True)
    for step in steps:
        path = os.path.join(root, f"global_step_{step}")
        problem = _checkpoint_problem(path)
        if problem is None:
            if problems:
                print(f"resuming from {path}, the newest complete checkpoint; skipped: {'; '.join(problems)}", flush=True)
            return path
        problems.append(f"global_step_{step}: {problem}")
    raise CheckpointError(f"{root} has a checkpoint tracker but no complete checkpoint to resume from: "
                          f"{'; '.join(problems) or 'no global_step_N folder'}. Restore the missing files, or start "
                          f"afresh with trainer.find_last_checkpoint=false (or another trainer.save_checkpoint_path)")


def _checkpoint_problem(path):
    """None when the folder holds every file a resume reads, else what is wrong, in words. Reads: trainer_state.json
    (resumable), dataloader.pt and actor/extra_state.pt (loaded), and the DCP folders actor/model and actor/optim
    (their .metadata read, every shard file it names present and long enough)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        with open(os.path.join(path, "trainer_state.json")) as f:
            state = json.load(f)
    except FileNotFoundError:
        return "trainer_state.json is missing"
    except ValueError as e:
        return f"trainer_state.json cannot be read ({type(e).__name__}: {e})"
    if not isinstance(state, dict) or not {"global_step", "kl_coef"} <= state.keys():
        return "trainer_state.json lacks global_step or kl_coef"
    if not state.get("resumable", True):
        return ("it was saved with trainer.save_model_only=true and holds no optimizer state, so it cannot be "
                "resumed (merge it with merge.py instead)")
    for name in ("dataloader.pt", os.path.join("actor", "extra_state.pt")):
        try:
            torch.load(os.path.join(path, name), weights_only=True)
        except FileNotFoundError:
            return f"{name} is missing"
        except Exception as e:  # truncated, or not plain tensors and containers
            return f"{name} cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    for name in ("model", "optim"):
        folder = os.path.join(path, "actor", name)
        try:
            metadata = FileSystemReader(folder).read_metadata()
        except FileNotFoundError:
            return f"actor/{name} is missing or incomplete (no .metadata)"
        except Exception as e:
            return f"actor/{name}/.metadata cannot be read ({type(e).__name__})"
        for info in metadata.storage_data.values():
            shard = os.path.join(folder, info.relative_path)
            if not os.path.exists(shard) or os.path.getsize(shard) < info.offset + info.length:
                return f"actor/{name}/{info.relative_path} is missing or truncated"
    return None


def _remove_old_checkpoints(root, step, best_step, limit):
    """Keep the newest `limit` checkpoints (the best by validation counts toward them and is never removed)."""
    if limit <= 0:
        return
    steps = sorted(int(m.group(1)) for n in os.listdir(root) if (m := re.fullmatch(r"global_step_(\d+)", n)))
    keep = {step} | ({best_step} if best_step is not None else set())
    for s in reversed(steps):
        if len(keep) >= limit:
            break
        keep.add(s)
    for s in steps:
        if s not in keep and s < step:
            shutil.rmtree(os.path.join(root, f"global_step_{s}"), ignore_errors=True)


def _mix_seed(seed, step, rank):
    """The rollout seed of one step on one rank (the toy's seeded learning curve is measured with this mix)."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{step}/{rank}".encode()).digest()[:4], "little") & 0x7FFFFFFF


def _usable_cpus():
    """CPU cores this process may run on (taskset and cgroup CPU sets honoured, unlike os.cpu_count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _ensure_toy_world(cfg):
    """Build the offline toy world on first use when the config points into .toy/, and make paths absolute."""
    m, d = cfg.worker.actor.model, cfg.data
    if any(str(p).startswith(".toy/") for p in (m.model_path, d.train_files, d.val_files)):
        import toy

        toy.ensure_toy(os.path.abspath(".toy"))
    for obj, key in ((m, "model_path"), (m, "tokenizer_path"), (d, "format_prompt"), (d, "override_chat_template"),
                     (d, "image_dir")):
        value = getattr(obj, key)
        if value and os.path.exists(value.split("@")[0]):
            setattr(obj, key, os.path.abspath(value))
    for key in ("train_files", "val_files"):
        path, _, split = getattr(d, key).partition("@")
        if os.path.exists(path):
            setattr(d, key, os.path.abspath(path) + (f"@{split}" if split else ""))


# ----------------------------------------------------------------------------------------------
# Command line. The config itself (dataclasses, YAML, overrides, cross-key checks) is in config.py.
# ----------------------------------------------------------------------------------------------

def check_choices(cfg):
    """The values each stage accepts, checked against the stage's own table before any worker starts."""
    a, ref = cfg.worker.actor, cfg.worker.ref.fsdp
    choices = {"algorithm.adv_estimator": (cfg.algorithm.adv_estimator, advantage.ESTIMATORS),
               "worker.actor.loss_type": (a.loss_type, actor.POLICY_LOSS_TYPES),
               "worker.actor.loss_avg_mode": (a.loss_avg_mode, actor.AGGREGATION_MODES),
               "worker.rollout.name": (cfg.worker.rollout.name, rollout.ENGINES)}
    for section, fsdp in (("worker.actor.fsdp", a.fsdp), ("worker.ref.fsdp", ref)):
        for key in ("torch_dtype", "mp_param_dtype", "mp_reduce_dtype", "mp_buffer_dtype"):
            if getattr(fsdp, key) is not None:
                choices[f"{section}.{key}"] = (getattr(fsdp, key), actor.DTYPES)
    for key, (value, allowed) in choices.items():
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {list(allowed)}")
    unknown = sorted(set(cfg.trainer.logger) - set(LOGGERS))
    if unknown:
        raise ConfigError(f"trainer.logger has {unknown}; choose from {list(LOGGERS)}")
    for section, fsdp in (("worker.actor.fsdp", a.fsdp), ("worker.ref.fsdp", ref)):
        if actor.DTYPES[fsdp.mp_buffer_dtype] != torch.float32:
            raise ConfigError(f"{section}.mp_buffer_dtype={fsdp.mp_buffer_dtype}: buffers (rotary frequencies) stay in "
                              f"fp32, as EasyR1's default; FSDP2 has no buffer dtype, so only fp32 is supported")
    if ref.torch_dtype is not None and actor.DTYPES[ref.torch_dtype] != actor.DTYPES[ref.mp_param_dtype]:
        raise ConfigError(f"worker.ref.fsdp.torch_dtype={ref.torch_dtype}: the reference stores its weights in its "
                          f"compute dtype (worker.ref.fsdp.mp_param_dtype={ref.mp_param_dtype}), which gives the same "
                          f"log-probs in less memory; set it to null or to {ref.mp_param_dtype}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="GRPO and relatives for vision-language models. Overrides: a.b.c=value.",
        epilog="Every key is documented in configs/geo3k.yaml.")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="YAML config (default: configs/toy.yaml)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("overrides", nargs="*", help="a.b.c=value")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        check_choices(cfg)
    except ConfigError as e:
        parser.exit(2, f"config error: {e}\n")
    return args, cfg


def main(argv=None):
    args, cfg = parse_args(argv)
    if args.print_config:
        print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
        return 0
    try:
        fit(cfg)
    except ConfigError as e:  # found at start-up (a logger's package, too few batches): one line, not a traceback
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:  # no complete checkpoint to resume from: what to change, not a traceback
        print(f"checkpoint error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
