"""config.py against EasyR1: its example config and every key its example scripts set load, its recipes carry over,
and its keys without a counterpart here say so."""

import os
import re

import pytest
import yaml

import config
import trainer
from config import CONFIGS, ConfigError, load_config
from test_config import _flat, load_checked

# EasyR1's examples/config.yaml at hiyouga/EasyR1 b44b311 (its comments left out): an EasyR1 user's config.
EASYR1_EXAMPLE_CONFIG = """\
data:
  train_files: hiyouga/math12k@train
  val_files: hiyouga/math12k@test
  prompt_key: problem
  answer_key: answer
  image_key: images
  video_key: videos
  image_dir: null
  video_fps: 2.0
  max_prompt_length: 2048
  max_response_length: 2048
  rollout_batch_size: 512
  mini_rollout_batch_size: null
  val_batch_size: 1024
  format_prompt: ./examples/format_prompt/math.jinja
  override_chat_template: null
  shuffle: true
  seed: 1
  min_pixels: 262144
  max_pixels: 4194304
  filter_overlong_prompts: true

algorithm:
  adv_estimator: grpo
  disable_kl: false
  use_kl_loss: true
  kl_penalty: low_var_kl
  kl_coef: 1.0e-2
  online_filtering: false
  filter_key: overall
  filter_low: 0.01
  filter_high: 0.99

worker:
  actor:
    global_batch_size: 128
    micro_batch_size_per_device_for_update: 1
    micro_batch_size_per_device_for_experience: 2
    max_grad_norm: 1.0
    padding_free: true
    dynamic_batching: true
    ulysses_size: 1
    model:
      model_path: Qwen/Qwen2.5-7B-Instruct
      enable_gradient_checkpointing: true
      trust_remote_code: false
      freeze_vision_tower: false
      lora:
        rank: 0
        alpha: 64
        target_modules: all-linear
        exclude_modules: .*visual.*
    optim:
      lr: 1.0e-6
      weight_decay: 1.0e-2
      strategy: adamw
      lr_warmup_ratio: 0.0
    fsdp:
      enable_full_shard: true
      enable_cpu_offload: false
      enable_rank0_init: true
    offload:
      offload_params: true
      offload_optimizer: true

  rollout:
    n: 5
    temperature: 1.0
    top_p: 1.0
    limit_images: 0
    gpu_memory_utilization: 0.6
    enforce_eager: false
    enable_chunked_prefill: false
    tensor_parallel_size: 2
    disable_tqdm: false
    val_override_config:
      temperature: 0.6
      top_p: 0.95
      n: 1

  ref:
    fsdp:
      enable_full_shard: true
      enable_cpu_offload: true
      enable_rank0_init: true
    offload:
      offload_params: false

  reward:
    reward_function: ./examples/reward_function/math.py:compute_score

trainer:
  total_epochs: 15
  max_steps: null
  project_name: easy_r1
  experiment_name: qwen2_5_7b_math_grpo
  logger: ["file", "wandb"]
  nnodes: 1
  n_gpus_per_node: 8
  max_try_make_batch: 20
  val_freq: 5
  val_before_train: true
  val_only: false
  val_generations_to_log: 3
  save_freq: 5
  save_limit: 3
  save_model_only: false
  save_checkpoint_path: null
  load_checkpoint_path: null
  find_last_checkpoint: true
"""



def test_easyr1_example_config_loads_unchanged_and_its_values_are_the_defaults_but_those_the_readme_lists(tmp_path):
    """Every key of EasyR1's examples/config.yaml loads with its value; where a default differs, README says why."""
    path = tmp_path / "config.yaml"
    path.write_text(EASYR1_EXAMPLE_CONFIG)
    cfg = load_config(str(path))
    trainer.check_choices(cfg)
    theirs, loaded = _flat(yaml.safe_load(EASYR1_EXAMPLE_CONFIG)), _flat(config.config_to_dict(cfg))
    assert {k: loaded[k] for k in theirs} == theirs
    ours = _flat(config.config_to_dict(load_config()))
    differ = sorted(k for k in theirs if ours[k] != theirs[k])
    assert differ == ["data.format_prompt", "data.train_files", "data.val_files", "trainer.experiment_name",
                      "trainer.logger", "worker.actor.model.model_path", "worker.actor.offload.offload_optimizer",
                      "worker.actor.offload.offload_params", "worker.reward.reward_function"]
    readme = open(os.path.join(os.path.dirname(CONFIGS), "README.md")).read()
    differences = readme.split("## Differences from EasyR1")[1]
    unlisted = [k for k in differ if k not in differences and k.rsplit(".", 1)[0] + ".*" not in differences]
    assert not unlisted, f"defaults that differ from EasyR1's examples/config.yaml, not in the README: {unlisted}"


# Every key EasyR1's examples/*.sh (b44b311) set on the command line, with a value one of them sets.
EASYR1_SCRIPT_OVERRIDES = [
    "data.train_files=hiyouga/geometry3k@train", "data.val_files=hiyouga/geometry3k@test", "data.seed=42",
    "data.max_prompt_length=4096", "data.max_response_length=8192", "data.rollout_batch_size=512",
    "data.mini_rollout_batch_size=256", "data.val_batch_size=512", "data.format_prompt=null",
    "data.filter_overlong_prompts=false", "algorithm.adv_estimator=reinforce_plus_plus", "algorithm.disable_kl=true",
    "algorithm.use_kl_loss=false", "algorithm.kl_penalty=kl", "algorithm.kl_coef=1.0e-3",
    "algorithm.online_filtering=true", "algorithm.filter_key=accuracy", "algorithm.filter_low=0.01",
    "algorithm.filter_high=0.99", "worker.actor.model.model_path=Qwen/Qwen2.5-VL-3B-Instruct",
    "worker.actor.model.trust_remote_code=true", "worker.actor.model.lora.rank=64", "worker.actor.model.lora.alpha=64",
    "worker.actor.optim.lr=1.0e-6", "worker.actor.optim.weight_decay=0.1", "worker.actor.optim.strategy=adamw_bf16",
    "worker.actor.optim.lr_warmup_steps=10", "worker.actor.optim.lr_warmup_ratio=0.0",
    "worker.actor.optim.lr_scheduler_type=cosine", "worker.actor.fsdp.torch_dtype=bf16",
    "worker.actor.global_batch_size=128", "worker.actor.clip_ratio_low=0.2", "worker.actor.clip_ratio_high=0.28",
    "worker.actor.clip_ratio_dual=10.0", "worker.actor.loss_avg_mode=token", "worker.actor.loss_type=gspo_token",
    "worker.actor.max_grad_norm=1.0", "worker.actor.ulysses_size=1", "worker.rollout.n=8",
    "worker.rollout.temperature=1.0", "worker.rollout.top_p=1.0", "worker.rollout.limit_images=2",
    "worker.rollout.gpu_memory_utilization=0.5", "worker.rollout.max_num_batched_tokens=16384",
    "worker.rollout.tensor_parallel_size=1", "worker.rollout.val_override_config={temperature: 1.0, n: 1}",
    "worker.reward.reward_function=math", "worker.reward.reward_function_kwargs={}", "trainer.total_epochs=10",
    "trainer.logger=[console,wandb]", "trainer.project_name=easy_r1", "trainer.experiment_name=qwen3_4b_dapo",
    "trainer.nnodes=1", "trainer.n_gpus_per_node=8", "trainer.max_try_make_batch=10", "trainer.val_freq=10",
    "trainer.save_freq=10", "trainer.val_generations_to_log=1",
]


def test_every_key_easyr1_example_scripts_set_loads():
    cfg = config.config_to_dict(load_checked(*EASYR1_SCRIPT_OVERRIDES))
    for item in EASYR1_SCRIPT_OVERRIDES:
        key, _, value = item.partition("=")
        assert _flat(cfg)[key] == _flat(config.config_to_dict(load_config(None, [item])))[key] == yaml.safe_load(
            value if not value.startswith("[") else value.replace(",", ", ")), item



# What EasyR1's examples/qwen2_5_vl_7b_geo3k_<recipe>.sh (b44b311) set, beyond their data, model and run names.
EASYR1_RECIPES = {
    "dapo": "data.mini_rollout_batch_size=128 worker.actor.clip_ratio_low=0.2 worker.actor.clip_ratio_high=0.28 "
            "algorithm.disable_kl=true algorithm.online_filtering=true",
    "gspo": "worker.actor.loss_type=gspo_token worker.actor.loss_avg_mode=seq worker.actor.clip_ratio_low=3e-4 "
            "worker.actor.clip_ratio_high=4e-4 algorithm.disable_kl=true",
    "cispo": "worker.actor.loss_type=cispo worker.actor.clip_ratio_low=0 worker.actor.clip_ratio_high=4",
    "reinforce_pp": "algorithm.adv_estimator=reinforce_plus_plus algorithm.use_kl_loss=false algorithm.kl_penalty=kl "
                    "algorithm.kl_coef=1e-3",
}


@pytest.mark.parametrize("recipe", EASYR1_RECIPES)
def test_recipes_named_after_easyr1_examples_set_what_they_set(recipe):
    """configs/<recipe>.yaml equals EasyR1's example script but for a difference the README lists (cispo's floor)."""
    ours, theirs = (_flat(config.config_to_dict(c)) for c in (
        load_config(recipe), load_config(None, EASYR1_RECIPES[recipe].split())))
    differ = {k for k in ours if ours[k] != theirs[k] and k != "trainer.experiment_name"}
    assert differ == ({"worker.actor.clip_ratio_low"} if recipe == "cispo" else set()), differ

@pytest.mark.parametrize("override, message", [
    ("worker.critic.ppo_epochs=2", "'worker.critic' (command line). EasyR1's key, not supported here: no critic"),
    ("algorithm.lam=0.95", "'algorithm.lam' (command line). EasyR1's key, not supported here: GAE's"),
    ("trainer.critic_warmup=2", "'trainer.critic_warmup' (command line). EasyR1's key, not supported here: no critic"),
    ("worker.hybrid_engine=true", "'worker.hybrid_engine' (command line). EasyR1's key, not supported here: the"),
    ("worker.reward.num_cpus=4", "'worker.reward.num_cpus' (command line). EasyR1's key, not supported here: rewards"),
    ("trainer.ray_timeline=/tmp/t.json", "'trainer.ray_timeline' (command line). EasyR1's key, not supported here"),
    ("worker.ref.strategy=fsdp", "'worker.ref.strategy' (command line). EasyR1's key, not supported here: always FSDP"),
])
def test_easyr1_keys_without_a_counterpart_say_so_instead_of_naming_a_near_miss(override, message, tmp_path):
    """EasyR1's dataclass keys that neither its examples/config.yaml nor its scripts set, with no counterpart here:
    refused saying why; a near-miss suggestion (num_cpus -> worker.reward.timeout) would mislead."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(yaml.safe_load(EASYR1_EXAMPLE_CONFIG) | {"worker": {"critic": {"ppo_epochs": 1}}}))
    with pytest.raises(ConfigError, match=re.escape("'worker.critic' (" + str(path) + "). EasyR1's key")):
        load_config(str(path))
    with pytest.raises(ConfigError, match="did you mean worker.reward.timeout"):  # a plain typo still gets a hint
        load_config(None, ["worker.reward.timout=3"])
    with pytest.raises(ConfigError, match="'=4' is not of the form a.b.c=value"):  # no key at all
        load_config(None, ["=4"])


@pytest.mark.parametrize("override", ["worker.actor.ulysses_size=2", "worker.actor.padding_free=false"])
def test_easyr1_keys_of_features_not_here_load_only_with_the_value_that_works(override):
    """ulysses_size and padding_free load (EasyR1's configs set them) but only at 1 and true."""
    with pytest.raises(ConfigError, match=re.escape("only 1 and true are supported (no sequence parallelism")):
        load_config(None, [override])
    load_config(None, ["worker.actor.ulysses_size=1", "worker.actor.padding_free=true"])
