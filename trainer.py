"""trainer.py: the command line, the GRPO loop, metrics, validation, saving and resuming. With workers.py (the Ray
plumbing, which a first reading can skip) the only module that imports the stages; the config is config.py, the
run folder's files (logs, trackers, finding and rotating checkpoints) run_folder.py.

    python trainer.py                                                 # the offline toy (configs/toy.yaml)
    python trainer.py --config configs/geo3k.yaml worker.rollout.n=8  # Qwen2.5-VL-7B on Geometry3K, a key overridden
    python trainer.py --config configs/geo3k.yaml --print-config      # the resolved config, then exit

Run.train_step is the README's loop, a short block per stage; self.workers runs each call on every worker."""

import argparse
import contextlib
import importlib.util
import json
import math
import os
import re
import shutil
import statistics
import sys
import time

import pandas
import torch
import yaml
from tqdm import tqdm
from transformers import AutoConfig

import actor
import advantage
import data
import reward
import rollout
from config import ConfigError, config_to_dict, load_config
from modeling import apply_overrides, check_packable
from run_folder import (LOGGERS, TRACKER, CheckpointError, Logger, find_checkpoint, move_aside, remove_checkpoint,
                        remove_old_checkpoints, set_aside_later, write_atomic)
from workers import WorkerGroup, show_logs

HERE = os.path.dirname(os.path.abspath(__file__))
LOGP_DIFF_ALARM = 0.5  # nats: a mean |rollout - actor| log-prob gap above this is warned of at every step

# --- The loop ---------------------------------------------------------------------------------

class Run:
    """Driver state: config, data, workers, loggers. Workers get the config once, then lists of dicts (no DataProto)."""

    def __init__(self, cfg):
        self.cfg, t, d, a = cfg, cfg.trainer, cfg.data, cfg.algorithm
        check_choices(cfg)  # main checked them too; here also for a Run made from Python
        for name in t.logger:  # (a folder named like the package, e.g. wandb's run folder, is no package)
            if LOGGERS[name] and getattr(importlib.util.find_spec(LOGGERS[name]), "origin", None) is None:
                raise ConfigError(f"trainer.logger has {name}, but the {LOGGERS[name]} package is not installed: "
                                  f"pip install {LOGGERS[name]}, or remove {name} from trainer.logger")
        _ensure_toy_world(cfg)
        rw = cfg.worker.reward  # loaded before the data's checks and any thread: a wrong path fails in seconds
        timeout = {"timeout": rw.timeout} if rw.reward_function in ("math", "r1v") else {}  # they compare answers
        try:
            self.reward_fn = reward.load_reward_function(rw.reward_function, call_timeout=rw.call_timeout,
                                                         **{**timeout, **rw.reward_function_kwargs})
        except reward.RewardError as e:  # a wrong path, name or keyword: one line, like a config error
            raise ConfigError(str(e)) from None
        model, remote = cfg.worker.actor.model, cfg.worker.actor.model.trust_remote_code
        try:  # a mistyped folder or an unreachable hub id: one line now, not a traceback from each worker
            hf_config = AutoConfig.from_pretrained(model.model_path, trust_remote_code=remote)
        except (OSError, ValueError) as e:
            where = "" if os.path.isdir(model.model_path) else " (no such folder, and no hub model id that loads)"
            raise ConfigError(f"worker.actor.model.model_path={model.model_path!r}{where}: its config does not load: "
                              f"{(str(e).splitlines() or [repr(e)])[0]}") from None
        try:  # override_config's keys, and a model the packed pass cannot compute: now, not in each worker's setup
            if model.override_config:
                apply_overrides(hf_config, model.override_config)
            check_packable(hf_config, d.max_prompt_length + d.max_response_length, model.model_path)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.processor, self.tokenizer = data.load_processor(model.tokenizer_path or model.model_path, d,
                                                             trust_remote_code=remote)
        batch = d.mini_rollout_batch_size or d.rollout_batch_size  # prompts a generation round
        common = {"trust_remote_code": remote, "pixel_dtype": _pixel_dtype(cfg)}
        self.train_loader = data.PromptLoader(d.train_files, d, self.processor, hf_config, batch_size=batch,
                                              shuffle=d.shuffle, drop_last=True, prefetch=True, **common)
        self.val_loader = data.PromptLoader(d.val_files, d, self.processor, hf_config, batch_size=d.val_batch_size,
                                            shuffle=False, drop_last=False, **common)
        # vLLM's limit_mm_per_prompt for videos: the most in one row (0 reserves no memory for video)
        cfg.worker.rollout.limit_videos = max(self.train_loader.videos_per_prompt, self.val_loader.videos_per_prompt)
        most = max(self.train_loader.images_per_prompt, self.val_loader.images_per_prompt)
        if 0 < (limit := cfg.worker.rollout.limit_images) < most:
            raise ConfigError(f"worker.rollout.limit_images={limit}, but a row holds {most} images: raise it (or 0)")
        self.kl_ctrl = (advantage.AdaptiveKLController(a.kl_coef, a.kl_target, a.kl_horizon) if a.kl_type == "adaptive"
                        else advantage.FixedKLController(a.kl_coef))
        batches = self.train_loader.batches_per_epoch
        self.training_steps = t.max_steps or batches * batch // d.rollout_batch_size * t.total_epochs  # as EasyR1
        if self.training_steps < 1:
            raise ConfigError(f"{batches} batches of {batch} prompts per epoch make no step of data.rollout_batch_size="
                              f"{d.rollout_batch_size} prompts; lower it or set trainer.max_steps")
        self.ckpt_root = os.path.abspath(os.path.expanduser(t.save_checkpoint_path or
                                                            f"checkpoints/{t.project_name}/{t.experiment_name}"))
        if marker := next((m for m in ("trainer_state.json", "extra_state.pt") if os.path.isfile(
                os.path.join(self.ckpt_root, m))), None):  # a fresh run nested in a checkpoint, not a resume from it
            raise ConfigError(f"trainer.save_checkpoint_path={self.ckpt_root} is a checkpoint (it holds {marker}), not "
                              f"a run folder: to resume from it, set trainer.load_checkpoint_path to its global_step_N "
                              f"folder and trainer.save_checkpoint_path to the folder holding it")
        try:  # after the data's checks: a bad row moves no earlier run aside
            os.makedirs(self.ckpt_root, exist_ok=True)
            load = t.load_checkpoint_path and os.path.expanduser(t.load_checkpoint_path)
            checkpoint = find_checkpoint(self.ckpt_root, load, t.find_last_checkpoint, t.val_only)
            self.logger = Logger(self.ckpt_root, t.logger, cfg)  # starts W&B/MLflow/SwanLab: after the data's checks
        except OSError as e:  # a file in the way, no permission, a read-only run folder (its logs are opened)
            if e.filename is None:  # not the run folder's: a tracker's network error, as it is
                raise
            raise ConfigError(f"trainer.save_checkpoint_path={self.ckpt_root}: {e.strerror}"
                              + (f" ({e.filename})" if e.filename != self.ckpt_root else "")) from None
        if checkpoint and not t.val_only:  # before Ray starts: another batch size, seed or data is an error in
            self._load_data_position(checkpoint)  # seconds, not minutes (val_only trains nothing: no position read)
        try:
            self.workers = WorkerGroup(cfg, self.training_steps)
        except RuntimeError as e:  # the actor refuses the model as configured (LoRA, a window): its message alone
            if not _refused_here(e):
                raise
            raise ConfigError(str(e.__cause__)) from None
        self.step, self.best = 0, {"best_global_step": None, "best_val_reward_score": None}
        self._resume(checkpoint)
        if not t.val_only and checkpoint is None:  # a resume's settings: with its first checkpoint (save_checkpoint),
            config = json.dumps(config_to_dict(cfg), indent=2)  # so a resume stopped before it keeps those that trained
            write_atomic(os.path.join(self.ckpt_root, "experiment_config.json"), config)
        self.train_iter = iter(self.train_loader)

    def fit(self):
        """Train: validate every val_freq steps, save every save_freq, both at the last step; -> the last metrics."""
        t, metrics = self.cfg.trainer, {}
        if self.step >= self.training_steps and not t.val_only:
            print(f"step {self.step} of {self.training_steps} done: nothing left to train (raise trainer.max_steps)")
        if t.val_before_train or t.val_only:  # also when resuming, as EasyR1
            metrics = self.validate()
            self.logger.log(metrics, self.step, amend=self.step > 0 or t.val_only)  # into that step's row, if any
            if t.val_only:
                return metrics
            if self.step > 0:  # the checkpoint resumed from: its score counts toward the best, as at a save
                self._keep_best(metrics)
        first, frozen = self.step, 0  # frozen: steps whose every optimizer step was skipped (non-finite gradients)
        with tqdm(total=self.training_steps, initial=self.step, desc="steps", disable="console" not in t.logger) as bar:
            while self.step < self.training_steps:
                self.step += 1
                try:
                    metrics = self.train_step()
                except RuntimeError as error:  # a worker or the reward function failed: say where, then stop
                    raise RuntimeError(f"training stopped at step {self.step}: {error}") from error.__cause__
                frozen += math.isnan(metrics.get("actor/grad_norm", 0.0))  # NaN: no optimizer step was taken
                last = self.step == self.training_steps
                save = (t.save_freq > 0 and self.step % t.save_freq == 0) or last
                if last or (t.val_freq > 0 and self.step % t.val_freq == 0):  # the last step always validates
                    try:
                        with timer(metrics, "validation"):
                            metrics.update(self.validate())
                    except BaseException as error:  # the step has trained: its row, and its checkpoint if due
                        if isinstance(error, reward.RewardError):  # the workers are sound: the engine, left awake
                            self.workers.sleep()  # by the validation, frees the save's memory
                        else:
                            save = False  # a worker may be gone: no checkpoint
                        self.save_checkpoint(metrics) if save else self.logger.log(metrics, self.step)
                        if not isinstance(error, RuntimeError):  # a validation row gone bad, Ctrl-C: as it is
                            raise
                        raise RuntimeError(f"validation at step {self.step} failed (the step is logged"
                                           f"{' and saved' if save else ''}): {error}") from error.__cause__
                if save:
                    self.save_checkpoint(metrics)  # logs this step's row before the checkpoint is complete
                else:
                    self.logger.log(metrics, self.step)
                bar.update(1)
                bar.set_postfix({k.split("/")[-1]: f"{metrics[k]:.3f}" for k in ("reward/overall", "val/reward_score")
                                 if k in metrics})
        plot = self.logger.plot()
        print(f"done: metrics in {self.logger.jsonl_path}" + (f", plot in {plot}" if plot else "")
              + f", checkpoints in {self.ckpt_root}" + (f"; but {frozen} of the {self.step - first} steps changed no "
              "weight: every optimizer step was skipped for a non-finite gradient (actor/skipped_steps)" if frozen
              else ""), flush=True)
        return metrics

    def train_step(self):
        """One step, as the README's loop: sync, generate (score, filter), log-probs, KL, advantages, update."""
        cfg, metrics = self.cfg, {}
        with timer(metrics, "step"):
            with timer(metrics, "sync"):
                self.workers.sync_weights()
            with timer(metrics, "gen"):
                prompts, responses, scores, reward_metrics = self.make_batch(metrics)  # generate, score, filter
                greedy = self.greedy_rewards(prompts) if cfg.algorithm.adv_estimator == "remax" else None
                self.workers.sleep()
            samples = [_sample(prompts[r["prompt_index"]], r) for r in responses]
            with timer(metrics, "old"):
                _attach(samples, "old_logprobs", self.workers.log_probs(samples, kind="old"))
            if not cfg.algorithm.disable_kl:
                with timer(metrics, "ref"):
                    _attach(samples, "ref_logprobs", self.workers.log_probs(samples, kind="ref"))
            with timer(metrics, "adv"):
                token_kl, beta = self.reward_kl(samples, metrics)
                _attach(samples, "advantage", self.advantages(samples, scores, token_kl, beta, greedy, metrics))
            with timer(metrics, "update_actor"):
                metrics.update(self.workers.update(samples))
        metrics.update({**reward_metrics, **_batch_metrics(prompts, responses, samples, cfg, metrics)})
        return metrics

    def make_batch(self, metrics):
        """Generate and score rounds of prompts until `rollout_batch_size` groups are kept (online filtering drops
        some). -> (prompts, responses, scores, reward/* means: over the responses kept; with filtering all rounds')."""
        a, want, tries = self.cfg.algorithm, self.cfg.data.rollout_batch_size, self.cfg.trainer.max_try_make_batch
        prompts, responses, scores, all_scores, rounds = [], [], [], [], 0
        while len(prompts) < want:
            rounds += 1
            if 0 < tries < rounds:
                advice = ("widen algorithm.filter_low/filter_high, raise it, or disable algorithm.online_filtering"
                          if a.online_filtering else "raise it or data.mini_rollout_batch_size")
                raise RuntimeError(f"{len(prompts)} of {want} groups after {rounds - 1} generation rounds "
                                   f"(trainer.max_try_make_batch); {advice}")
            batch = [{**p, "uid": f"{self.step}-{rounds}-{i}"} for i, p in enumerate(next(self.train_iter))]
            outs = self.workers.generate(batch, self.sampling((self.step, rounds)))
            with timer(metrics, "reward"):
                batch_scores = self.score(batch, outs)
            all_scores += batch_scores
            if a.online_filtering:  # flat groups go only where their advantages would be 0 (or the KL's alone)
                if lack := [s for s in batch_scores if a.filter_key not in s]:
                    raise ConfigError(f"algorithm.filter_key={a.filter_key!r}: the reward returns {[*lack[0]]}")
                flat_is_zero = a.adv_estimator in advantage.ZERO_WHEN_FLAT  # spread: of the raw overall scores
                keep = advantage.groups_to_keep([s[a.filter_key] for s in batch_scores], [r["uid"] for r in outs],
                                                low=a.filter_low, high=a.filter_high,
                                                spread=[s["overall"] for s in batch_scores] if flat_is_zero else None,
                                                unique_top=a.adv_estimator == "grpo_passk")
            kept = [i for i, p in enumerate(batch) if not a.online_filtering or p["uid"] in keep][:want - len(prompts)]
            index = {i: len(prompts) + j for j, i in enumerate(kept)}  # prompt index: in this round -> kept
            prompts += [batch[i] for i in kept]
            taken = [(r, s) for r, s in zip(outs, batch_scores) if r["prompt_index"] in index]
            responses += [{**r, "prompt_index": index[r["prompt_index"]]} for r, _ in taken]
            scores += [s for _, s in taken]
            if a.online_filtering and len(prompts) < want:  # said, so that a filter that keeps little is seen
                tqdm.write(f"step {self.step}: online filtering kept {len(kept)} of {len(batch)} groups in round "
                           f"{rounds}, {len(prompts)} of {want} so far: generating more")
        metrics["filter/rounds"] = rounds
        assert len(responses) == want * self.cfg.worker.rollout.n
        over = all_scores if a.online_filtering else scores  # as EasyR1: dropped groups count only when filtering
        return prompts, responses, scores, {f"reward/{k}": v for k, v in _mean_by_key(over).items()}

    def greedy_rewards(self, prompts):
        """ReMax's baseline: {uid: the reward of the prompt's greedy response} (temperature 0, one response each)."""
        greedy = self.workers.generate(prompts, {**self.sampling((self.step, "greedy")), "temperature": 0.0, "n": 1})
        return {p["uid"]: s["overall"] for p, s in zip(prompts, self.score(prompts, greedy))}

    def reward_kl(self, samples, metrics):
        """KL in the reward (use_kl_loss false) -> (token_kl, beta): kl_t = kl_penalty(old_t, ref_t) per response
        token (N x [L_i]; None without KL in the reward) and this step's weight; the controller then moves beta by
        the step's KL, the mean over responses of sum_t kl_t / L_i (actor/kl_penalty)."""
        a, beta = self.cfg.algorithm, self.kl_ctrl.value
        if a.disable_kl or a.use_kl_loss:
            metrics.update({} if a.disable_kl else {"actor/kl_coef": a.kl_coef})  # the KL loss's weight, as EasyR1's
            return None, beta
        token_kl = [actor.kl_penalty(s["old_logprobs"], s["ref_logprobs"], a.kl_penalty) for s in samples]
        current_kl = sum(float(k.sum()) / max(len(k), 1) for k in token_kl) / len(samples)
        metrics.update({"actor/kl_penalty": current_kl, "actor/kl_coef": beta})
        self.kl_ctrl.update(current_kl, n_steps=len(samples))
        return token_kl, beta

    def advantages(self, samples, scores, token_kl, beta, greedy, metrics):
        """algorithm.adv_estimator's advantages: a float per response, an [L_i] tensor for TOKEN_LEVEL estimators;
        greedy: ReMax's baselines by uid. Logs advantage.advantage_metrics (raw scores; over tokens when TOKEN_LEVEL,
        as EasyR1), critic/rewards/* (after the KL) and critic/returns/* (rewards-to-go for remax and REINFORCE++)."""
        a, uids, lengths = self.cfg.algorithm, [s["uid"] for s in samples], [len(s["response_ids"]) for s in samples]
        raw = torch.tensor([s["overall"] for s in scores], dtype=torch.float64)                    # [N]
        rewards = raw if token_kl is None else advantage.kl_in_reward(raw, [float(k.sum()) for k in token_kl], beta)
        baselines = None if greedy is None else torch.tensor([greedy[u] for u in uids], dtype=torch.float64)
        adv = advantage.compute_advantages(a.adv_estimator, raw, uids, baselines=baselines, lengths=lengths,
                                           token_kl=token_kl, kl_coef=beta, norm_by_std=a.norm_adv_by_std_in_grpo)
        token_level = a.adv_estimator in advantage.TOKEN_LEVEL  # adv: N tensors [L_i], else [N]
        returns = rewards if a.adv_estimator == "remax" else adv
        if token_level:  # G_{i,t} = sum_{s >= t} r_{i,s}, over every token
            token_rewards = advantage.token_rewards(raw, lengths, token_kl, beta)                 # N x [L_i]
            returns = torch.cat([r.flip(0).cumsum(0).flip(0) for r in token_rewards])
        metrics.update({**advantage.advantage_metrics(raw, adv, uids), **_stats("critic/rewards", rewards.tolist()),
                        **_stats("critic/returns", returns.tolist())})
        return adv if token_level else adv.tolist()

    def sampling(self, key, override=None):
        """rollout.sampling_settings, max_tokens and the seed derive_seed(worker.rollout.seed, *key): new each round."""
        r = self.cfg.worker.rollout
        return {**rollout.sampling_settings(r, override), "max_tokens": self.cfg.data.max_response_length,
                "seed": rollout.derive_seed(r.seed, *key)}

    def score(self, prompts, responses):
        """Decode and score every response on the driver (strings in, dicts of floats out)."""
        skip, pairs = self.cfg.worker.reward.skip_special_tokens, [(r, prompts[r["prompt_index"]]) for r in responses]
        return self.reward_fn([{"response": self.tokenizer.decode(r["response_ids"], skip_special_tokens=skip),
                                "response_length": len(r["response_ids"]), "finish_reason": r["finish_reason"],
                                "ground_truth": p["ground_truth"], "prompt": p["prompt_text"],
                                "extra": p.get("extra", {})} for r, p in pairs])

    def validate(self):
        self.workers.sync_weights()
        scores, pairs, override = [], [], {"n": 1, **self.cfg.worker.rollout.val_override_config}  # EasyR1's n
        for b, prompts in enumerate(self.val_loader.epoch()):  # a seed a batch: prompt i's sample j draws (seed, i, j)
            responses = self.workers.generate(prompts, self.sampling(("validation", b), override))
            scores += self.score(prompts, responses)
            slim = [{k: p[k] for k in ("prompt_ids", "prompt_text", "ground_truth")} for p in prompts]  # no pixels kept
            pairs += [(slim[r["prompt_index"]], r) for r in responses]
        self.workers.sleep()
        metrics = {f"val/{k}_reward": v for k, v in _mean_by_key(scores).items()}
        metrics["val/reward_score"] = metrics["val/overall_reward"]
        metrics.update(_length_metrics(pairs, self.cfg.data.max_prompt_length, prefix="val_"))
        logged = [{"prompt": p["prompt_text"], "response": self.tokenizer.decode(r["response_ids"]),
                   "ground_truth": p["ground_truth"], "score": s["overall"]}
                  for (p, r), s in zip(pairs[:max(self.cfg.trainer.val_generations_to_log, 0)], scores)]  # file order
        self.logger.log_generations(logged, self.step)
        return metrics

    def save_checkpoint(self, metrics):
        """Write global_step_N/ (actor/, dataloader.pt), log the step's row, then trainer_state.json, the run folder's
        experiment_config.json and the tracker naming N, each atomically; then remove old checkpoints. A checkpoint
        counts once the tracker names it; a resume cuts the log back to its steps (Logger.rewind): one row a step."""
        t = self.cfg.trainer
        path = os.path.join(self.ckpt_root, f"global_step_{self.step}")
        try:
            with timer(metrics, "save_checkpoint"):
                remove_checkpoint(path)  # left by a run that stopped while saving this step, or one resumed earlier
                if os.path.exists(path):  # merge.py's output of those weights, kept: not beside the new ones
                    move_aside(self.ckpt_root, f"step {self.step} is saved again", [os.path.basename(path)])
                self.workers.save(os.path.join(path, "actor"), model_only=t.save_model_only)
                if self.cfg.data.override_chat_template:  # the template trained with, for merge.py's model
                    self.processor.save_pretrained(os.path.join(path, "actor", "huggingface"))
                torch.save(self.train_loader.state_dict(), os.path.join(path, "dataloader.pt"))
            self._keep_best(metrics)
            self.logger.log(metrics, self.step)
            self.logger.flush()  # the step's rows on disk before its checkpoint counts
            state = {"global_step": self.step, "kl_coef": self.kl_ctrl.value, "kl_type": self.cfg.algorithm.kl_type,
                     "resumable": not t.save_model_only, **self.best}
            write_atomic(os.path.join(path, "trainer_state.json"), json.dumps(state, indent=2))
            config = json.dumps(config_to_dict(self.cfg), indent=2)  # the settings that trained this checkpoint
            write_atomic(os.path.join(self.ckpt_root, "experiment_config.json"), config)
            tracker = json.dumps({"last_global_step": self.step, **self.best})
            write_atomic(os.path.join(self.ckpt_root, TRACKER), tracker)  # the checkpoint counts from here
        except (RuntimeError, OSError) as e:  # a full disk (torch.save's "unexpected pos", a log row, the tracker)
            raise RuntimeError(f"saving the checkpoint of step {self.step} to {path} failed with "
                               f"{shutil.disk_usage(self.ckpt_root).free / 2**30:.1f} GiB free on its disk; "
                               f"the last complete checkpoint is still there: {e}") from None
        remove_old_checkpoints(self.ckpt_root, self.step, self.best["best_global_step"], t.save_limit)

    def _keep_best(self, metrics):
        """self.best: the step whose checkpoint scored the highest val/reward_score (rotation never removes it)."""
        val_score, best = metrics.get("val/reward_score"), self.best["best_val_reward_score"]
        if val_score is not None and (best is None or val_score > best):
            self.best = {"best_global_step": self.step, "best_val_reward_score": val_score}

    def _load_data_position(self, path):
        try:  # the train loader's position, which must have been saved with this data config
            self.train_loader.load_state_dict(torch.load(os.path.join(path, "dataloader.pt"), weights_only=True))
        except ValueError as e:  # the loader's: another batch size, seed, shuffle or data
            raise CheckpointError(f"cannot resume from {path}: {e}. Keep data.rollout_batch_size (mini_rollout_batch_"
                                  f"size), seed, shuffle and train_files as saved, or start a new run from its merged "
                                  f"model (merge.py) with trainer.find_last_checkpoint=false") from None

    def _resume(self, path):
        """Load the checkpoint folder `path` (checked complete by find_checkpoint), or start fresh when None."""
        t = self.cfg.trainer
        if path is None:  # an earlier attempt's rows run again; step 0's (a val_only's) only with val_before_train
            return None if t.val_only else self.logger.rewind(-1 if t.val_before_train else 0)
        state = json.load(open(os.path.join(path, "trainer_state.json")))
        saved = os.path.join(os.path.dirname(os.path.abspath(path)), "experiment_config.json")
        old = new = {}
        try:  # allowed (more steps, another learning rate), but said: before a load that fails
            if os.path.exists(saved):
                old, new = (pandas.json_normalize(tree).to_dict("records")[0]  # {"a.b": 1}
                            for tree in (json.load(open(saved)), json.loads(json.dumps(config_to_dict(self.cfg)))))
        except Exception as e:  # cut short or edited by hand: written again with the next checkpoint
            print(f"{saved} cannot be read ({type(e).__name__}: {e}): the settings are not compared", flush=True)
        if changed := [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(old | new) if old.get(k) != new.get(k)]:
            print(f"resuming {path} under other settings than {saved}'s: {'; '.join(changed)}", flush=True)
        try:
            self.workers.load(os.path.join(path, "actor"))
        except RuntimeError as e:
            if e.__cause__ is None:  # a worker died (killed, out of host memory): not the checkpoint's doing
                raise
            if _refused_here(e):  # the actor refuses another LoRA or optimizer setting: it says why
                raise CheckpointError(f"could not resume from {path}: {e.__cause__}") from None
            why = (re.findall(r"^\S*(?:Error|Exception): .*", str(e), re.M) or str(e).splitlines())[-1]  # innermost
            hint = ("; if trainer.save_checkpoint_path holds another run, pick a new folder, or set trainer.find_last_"
                    "checkpoint=false (its files are moved aside)" if self.cfg.trainer.load_checkpoint_path is None
                    else "")  # a damaged shard, another model: one line, not a traceback through DCP
            raise CheckpointError(f"could not resume from {path}: its actor/ did not load ({why.split('. ')[0]}). "
                                  f"Restore damaged files, or pick an earlier global_step_N: trainer.load_checkpoint_"
                                  f"path; set worker.actor.model.model_path back if it changed{hint}") from None
        if self.cfg.algorithm.kl_type == state.get("kl_type", "adaptive") == "adaptive":  # a fixed beta: the config's
            self.kl_ctrl.value = state["kl_coef"]
        self.best = {k: state.get(k) for k in self.best}
        self.step = int(state["global_step"])
        if not self.cfg.trainer.val_only:  # the later steps run again (val_only: nothing does, its row is amended)
            kept = set_aside_later(self.ckpt_root, path, self.step, self.best)  # -1: another folder's checkpoint
            self.logger.rewind(kept, kept - 1 if self.cfg.trainer.val_before_train else None)
        print(f"resumed from {path} (step {self.step})", flush=True)

    def close(self):
        self.logger.close()
        self.workers.shutdown()


# --- Metrics: helpers of the loop ---------------------------------------------------------------

def _sample(prompt, response):
    """One training sample (keys documented in actor.py) from a prompt and one of its responses."""
    return {"uid": prompt["uid"], "prompt_ids": prompt["prompt_ids"], "position_ids": prompt["position_ids"],
            "multi_modal_inputs": prompt["multi_modal_inputs"], "response_ids": response["response_ids"],
            "rollout_logprobs": torch.tensor(response["logprobs"], dtype=torch.float32)}


def _refused_here(error):
    """A worker's failure (workers.WorkerGroup's RuntimeError, the worker's traceback in its message) that is this
    project's ValueError, a refusal naming what to change; another library's ValueError is a bug, shown whole."""
    frames = re.findall(r'File "([^"]+)", line \d+', str(error))
    return isinstance(error.__cause__, ValueError) and bool(frames) and os.path.dirname(frames[-1]) == HERE


def _pixel_dtype(cfg):
    """bf16 when every pass that reads pixel values computes in bf16 (the policy, the reference and a transformers
    rollout; vLLM reads the images) from fp32 or bf16 weights: a vision tower casts them to its weights' dtype before
    any arithmetic (autocast to bf16 too), so bf16 ones give the same log-probs at half the bytes that Ray sends to
    the workers at each pass (3.2 GB of fp32 for 512 prompts of a 512 x 512 image); else None (fp32). fp16 weights
    under autocast would round fp32 pixels twice (fp16, then bf16), bf16 ones once."""
    w = cfg.worker
    used = [w.actor.fsdp.mp_param_dtype, w.ref.fsdp.mp_param_dtype] + [w.rollout.dtype] * (w.rollout.name == "hf")
    weights = actor.DTYPES[w.actor.fsdp.torch_dtype or "fp32"] in (torch.float32, torch.bfloat16)
    return torch.bfloat16 if weights and all(actor.DTYPES[d] == torch.bfloat16 for d in used) else None


def _mean_by_key(scores):
    """{key: the mean over the scores that have it}: a reward may return a key for some responses only (EasyR1)."""
    return {k: statistics.fmean(s[k] for s in scores if k in s) for k in dict.fromkeys(k for s in scores for k in s)}


def _batch_metrics(prompts, responses, samples, cfg, metrics):
    """Lengths, rollout-vs-actor log-prob gap, throughput and timing per token (EasyR1's metrics.py: gen and
    reward per response token, the passes over the batch per prompt + response token)."""
    out = _length_metrics([(prompts[r["prompt_index"]], r) for r in responses], cfg.data.max_prompt_length)
    diffs = torch.cat([(s["rollout_logprobs"] - s["old_logprobs"].float()).abs() for s in samples])
    if len(diffs):  # a broken weight sync shows up here first
        out.update({"rollout/logp_diff_mean": diffs.mean().item(), "rollout/logp_diff_max": diffs.max().item()})
        if out["rollout/logp_diff_mean"] > LOGP_DIFF_ALARM:
            tqdm.write(f"warning: the actor's log-probs of the sampled tokens differ from the rollout engine's by "
                       f"{out['rollout/logp_diff_mean']:.2f} on average (rollout/logp_diff_mean; ~0.01 in a healthy "
                       f"bf16 run): the engine sampled another model or prompt than the actor trains on (a weight sync "
                       f"that did not take; a template, image or family's logits done otherwise): PPO ratios are off")
    tokens = sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples)
    step_time = metrics.get("timing_s/step", 0.0)
    out.update({"perf/total_num_tokens": tokens, "perf/time_per_step": step_time,
                "perf/throughput": tokens / max(step_time, 1e-9) / (cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node)})
    for stage in [k for k in ("gen", "reward", "old", "ref", "adv", "update_actor") if f"timing_s/{k}" in metrics]:
        count = sum(len(s["response_ids"]) for s in samples) if stage in ("gen", "reward") else tokens
        out[f"timing_per_token_ms/{stage}"] = 1000 * metrics[f"timing_s/{stage}"] / max(count, 1)
    return out


def _length_metrics(pairs, max_prompt_length, prefix=""):
    """{prefix}response_length/* and {prefix}prompt_length/* over (prompt, response) pairs, a prompt once per response,
    as EasyR1's compute_length_metrics; clip_ratio: the share of responses without an EOS, of prompts at the limit."""
    plens, n = [len(p["prompt_ids"]) for p, _ in pairs], len(pairs)
    return {**_stats(f"{prefix}response_length", [len(r["response_ids"]) for _, r in pairs]),
            f"{prefix}response_length/clip_ratio": sum(r["finish_reason"] == "length" for _, r in pairs) / n,
            **_stats(f"{prefix}prompt_length", plens),
            f"{prefix}prompt_length/clip_ratio": sum(k >= max_prompt_length for k in plens) / n}


def _attach(samples, key, values):
    for sample, value in zip(samples, values):
        sample[key] = value


def _stats(prefix, values):
    return {f"{prefix}/mean": sum(values) / len(values), f"{prefix}/max": max(values), f"{prefix}/min": min(values)}


@contextlib.contextmanager
def timer(metrics, name):
    """with timer(metrics, "gen"): ... adds to metrics["timing_s/gen"] the wall seconds of the block."""
    start = time.perf_counter()
    yield
    metrics[f"timing_s/{name}"] = metrics.get(f"timing_s/{name}", 0.0) + time.perf_counter() - start


def _ensure_toy_world(cfg):
    """Build the offline toy world on first use when the config points into .toy/, and make relative paths absolute:
    each is looked up in the working directory, then in this folder (so the toy configs run from any directory)."""
    m, d, rw = cfg.worker.actor.model, cfg.data, cfg.worker.reward
    if any(str(p).startswith(".toy/") for p in (m.model_path, d.train_files, d.val_files)):
        import toy
        toy.ensure_toy(os.path.abspath(".toy") if os.path.isdir(".toy") else os.path.join(HERE, ".toy"))
    for obj, key in ((m, "model_path"), (m, "tokenizer_path"), (d, "format_prompt"), (d, "override_chat_template"),
                     (d, "image_dir"), (d, "train_files"), (d, "val_files"), (rw, "reward_function")):
        path, at, rest = (getattr(obj, key) or "").partition(":" if obj is rw else "@")  # path@split; file.py:fn
        path = os.path.expanduser(path)  # ~/data (the shell leaves a key=~/... as it is)
        found = next((p for p in (path, os.path.join(HERE, path)) if path and os.path.exists(p)), None)
        if found and (key != "reward_function" or path.endswith(".py")):  # not a folder named like a built-in
            setattr(obj, key, os.path.abspath(found) + at + rest)


# --- Command line ------------------------------------------------------------------------------

def check_choices(cfg):
    """The values each stage accepts, checked against the stage's own table before any worker starts."""
    a, fsdps = cfg.worker.actor, {"worker.actor.fsdp": cfg.worker.actor.fsdp, "worker.ref.fsdp": cfg.worker.ref.fsdp}
    choices = {"algorithm.adv_estimator": (cfg.algorithm.adv_estimator, advantage.ESTIMATORS),
               "worker.actor.loss_type": (a.loss_type, actor.POLICY_LOSS_TYPES),
               "worker.actor.loss_avg_mode": (a.loss_avg_mode, actor.AGGREGATION_MODES),
               "worker.rollout.name": (cfg.worker.rollout.name, rollout.ENGINES),
               "worker.rollout.dtype": (cfg.worker.rollout.dtype, rollout.DTYPES),
               **{f"{section}.{key}": (getattr(fsdp, key), actor.DTYPES) for section, fsdp in fsdps.items()
                  for key in ("torch_dtype", "mp_param_dtype", "mp_reduce_dtype", "mp_buffer_dtype")
                  if getattr(fsdp, key) is not None}}
    for key, (value, allowed) in choices.items():
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {list(allowed)}")
    if unknown := [name for name in cfg.trainer.logger if not isinstance(name, str) or name not in LOGGERS]:
        raise ConfigError(f"trainer.logger has {unknown}; choose from {list(LOGGERS)}")
    if unknown := sorted(set(cfg.worker.rollout.val_override_config) - set(rollout.SAMPLING_KEYS)):  # at start-up
        raise ConfigError(f"worker.rollout.val_override_config has {unknown}; choose from {[*rollout.SAMPLING_KEYS]}")
    for section, fsdp in fsdps.items():
        if actor.DTYPES[fsdp.mp_buffer_dtype] != torch.float32:
            raise ConfigError(f"{section}.mp_buffer_dtype={fsdp.mp_buffer_dtype}: buffers stay fp32 in FSDP2; set fp32")
    ref = cfg.worker.ref.fsdp
    if ref.torch_dtype is not None and actor.DTYPES[ref.torch_dtype] != actor.DTYPES[ref.mp_param_dtype]:
        raise ConfigError(f"worker.ref.fsdp.torch_dtype={ref.torch_dtype}: the reference stores its weights in its "
                          f"compute dtype (mp_param_dtype); set it to null or to {ref.mp_param_dtype}")


def main(argv=None):
    parser = argparse.ArgumentParser(description="GRPO and relatives for vision-language models. Overrides: "
                                     "a.b.c=value.", epilog="Every key is documented in configs/geo3k.yaml.")
    parser.add_argument("--config", action="append",
                        help="YAML config (default: configs/toy.yaml; EasyR1's form config=path too)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("overrides", nargs="*", help="a.b.c=value")
    args = parser.parse_intermixed_args(argv)  # overrides before and after --config
    show_logs()
    easyr1 = [o for o in args.overrides if o.startswith("config=")]  # its scripts: main config=examples/config.yaml
    if len(files := (args.config or []) + [o.partition("=")[2] for o in easyr1]) > 1:  # --config given twice too
        parser.exit(2, f"config error: one config file, got {files} (--config path, or config=path)\n")
    try:
        cfg = load_config(files[0] if files else os.path.join(HERE, "configs", "toy.yaml"),
                          [o for o in args.overrides if o not in easyr1])
        check_choices(cfg)
    except ConfigError as e:
        parser.exit(2, f"config error: {e}\n")
    if args.print_config:
        print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
        return 0
    if cfg.worker.rollout.name == "vllm" and importlib.util.find_spec("vllm") is None:  # else each worker fails late
        print("config error: worker.rollout.name=vllm, but vLLM is not installed: pip install -r requirements-gpu.txt, "
              "or set worker.rollout.name=hf (transformers' generate; slow)", file=sys.stderr)
        return 2
    try:
        run = Run(cfg)  # found at start-up: a logger's package, too few batches, no complete checkpoint to resume from
    except (ConfigError, CheckpointError, data.DataError) as e:  # what to change in one line, not a traceback
        kind = "config" if isinstance(e, ConfigError) else "checkpoint" if isinstance(e, CheckpointError) else "data"
        print(f"{kind} error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ray's exit hook stops any worker started
        print("\ninterrupted during start-up: nothing was trained", file=sys.stderr, flush=True)
        raise SystemExit(130)
    try:
        run.fit()
    except (data.DataError, ConfigError) as e:  # a row gone bad since the start-up check; a score the reward lacks
        kind = "config" if isinstance(e, ConfigError) else "data"
        print(f"{kind} error at step {run.step} (earlier steps' rows and checkpoints are kept): {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        saved = os.path.exists(os.path.join(run.ckpt_root, TRACKER))
        print(f"\ninterrupted at step {run.step}; " + (f"the last complete checkpoint is in {run.ckpt_root}" if saved
                                                      else f"no checkpoint in {run.ckpt_root} yet"), flush=True)
        raise SystemExit(130)
    finally:
        run.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
