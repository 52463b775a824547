"""trainer.py: the config, the Ray workers and the GRPO loop. The only module that imports the stages.

    python trainer.py                                   # the offline toy default (configs/toy.yaml)
    python trainer.py --config configs/geo3k.yaml       # Qwen2.5-VL-7B on Geometry3K
    python trainer.py --config X.yaml worker.rollout.n=8 algorithm.kl_coef=0.001
    python trainer.py --config X.yaml --print-config    # the resolved config, then exit

Config: one dataclass per EasyR1 section (`data`, `algorithm`, `worker.actor`, `worker.rollout`,
`worker.ref`, `worker.reward`, `trainer`) with EasyR1's key names and the defaults of its
`examples/config.yaml`; `configs/geo3k.yaml` documents every key once. Overrides `a.b.c=value` are
coerced to the key's type; an unknown key fails before anything starts and names the closest key.

Differences from EasyR1 (and why):
- Config is plain dataclasses + PyYAML, not OmegaConf: no interpolation, one place per key, and
  typos fail loudly (EasyR1 silently turned a missing `format_prompt` file into None).
- Values are never copied between sections behind the reader's back: a stage that needs a value
  from another section is handed it explicitly here.
"""

import argparse
import dataclasses
import difflib
import os
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIG = os.path.join(HERE, "configs", "toy.yaml")


# ----------------------------------------------------------------------------------------------
# Config. Every key is documented once, with a one-line comment, in configs/geo3k.yaml.
# ----------------------------------------------------------------------------------------------

@dataclass
class DataConfig:
    train_files: str = "hiyouga/geometry3k@train"
    val_files: str = "hiyouga/geometry3k@test"
    prompt_key: str = "problem"
    answer_key: str = "answer"
    image_key: str = "images"
    video_key: str = "videos"
    image_dir: Optional[str] = None
    video_fps: float = 2.0
    max_prompt_length: int = 2048
    max_response_length: int = 2048
    rollout_batch_size: int = 512
    mini_rollout_batch_size: Optional[int] = None
    val_batch_size: int = 1024
    format_prompt: Optional[str] = "configs/format/math.jinja"
    override_chat_template: Optional[str] = None
    system_prompt: Optional[str] = None
    shuffle: bool = True
    seed: int = 1
    min_pixels: int = 262144
    max_pixels: int = 4194304
    filter_overlong_prompts: bool = True
    filter_overlong_prompts_workers: int = 16


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True
    disable_kl: bool = False
    use_kl_loss: bool = True
    kl_penalty: str = "low_var_kl"
    kl_coef: float = 1.0e-2
    kl_type: str = "fixed"
    kl_horizon: float = 10000.0
    kl_target: float = 0.1
    gamma: float = 1.0
    online_filtering: bool = False
    filter_key: str = "overall"
    filter_low: float = 0.01
    filter_high: float = 0.99


@dataclass
class LoraConfig:
    rank: int = 0
    alpha: int = 64
    target_modules: str = "all-linear"
    exclude_modules: Optional[str] = ".*visual.*"


@dataclass
class ModelConfig:
    model_path: Optional[str] = "Qwen/Qwen2.5-VL-7B-Instruct"
    tokenizer_path: Optional[str] = None
    override_config: dict = field(default_factory=dict)
    enable_gradient_checkpointing: bool = True
    trust_remote_code: bool = False
    freeze_vision_tower: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class OptimConfig:
    lr: float = 1.0e-6
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 1.0e-2
    strategy: str = "adamw"
    lr_warmup_ratio: float = 0.0
    lr_warmup_steps: Optional[int] = None
    min_lr_ratio: Optional[float] = None
    lr_scheduler_type: str = "constant"


@dataclass
class FSDPConfig:
    enable_full_shard: bool = True
    enable_cpu_offload: bool = False
    enable_rank0_init: bool = True
    use_orig_params: bool = False
    torch_dtype: Optional[str] = None
    fsdp_size: int = -1
    mp_param_dtype: str = "bf16"
    mp_reduce_dtype: str = "fp32"
    mp_buffer_dtype: str = "fp32"


@dataclass
class OffloadConfig:
    offload_params: bool = False
    offload_optimizer: bool = False


@dataclass
class ActorConfig:
    strategy: str = "fsdp"
    global_batch_size: int = 128
    micro_batch_size_per_device_for_update: int = 1
    micro_batch_size_per_device_for_experience: int = 2
    max_tokens_per_micro_batch: Optional[int] = None
    max_grad_norm: float = 1.0
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.3
    clip_ratio_dual: float = 3.0
    tau_positive: float = 1.0
    tau_negative: float = 1.05
    loss_avg_mode: str = "token"
    loss_type: str = "default"
    tis_cap: Optional[float] = None
    ppo_epochs: int = 1
    padding_free: bool = True
    dynamic_batching: bool = True
    ulysses_size: int = 1
    use_torch_compile: bool = False
    compute_entropy: bool = True
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)


@dataclass
class RefConfig:
    fsdp: FSDPConfig = field(default_factory=lambda: FSDPConfig(enable_cpu_offload=True))
    offload: OffloadConfig = field(default_factory=OffloadConfig)


@dataclass
class RolloutConfig:
    name: str = "vllm"
    n: int = 5
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int = 1
    limit_images: int = 0
    dtype: str = "bf16"
    ignore_eos: bool = False
    gpu_memory_utilization: float = 0.6
    enforce_eager: bool = False
    enable_chunked_prefill: bool = False
    tensor_parallel_size: int = 2
    max_model_len: Optional[int] = None
    max_num_batched_tokens: int = 8192
    disable_log_stats: bool = True
    disable_tqdm: bool = False
    val_override_config: dict = field(default_factory=lambda: {"temperature": 0.6, "top_p": 0.95, "n": 1})


@dataclass
class RewardConfig:
    reward_function: str = "math"
    reward_function_kwargs: dict = field(default_factory=dict)
    skip_special_tokens: bool = True
    timeout: float = 10.0


@dataclass
class WorkerConfig:
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)


@dataclass
class TrainerConfig:
    total_epochs: int = 15
    max_steps: Optional[int] = None
    project_name: str = "easy_r1"
    experiment_name: str = "qwen2_5_vl_7b_geo3k_grpo"
    logger: list = field(default_factory=lambda: ["console", "file"])
    nnodes: int = 1
    n_gpus_per_node: int = 8
    device: str = "auto"
    max_try_make_batch: int = 20
    val_freq: int = 5
    val_before_train: bool = True
    val_only: bool = False
    val_generations_to_log: int = 3
    save_freq: int = 5
    save_limit: int = 3
    save_model_only: bool = False
    save_checkpoint_path: Optional[str] = None
    load_checkpoint_path: Optional[str] = None
    find_last_checkpoint: bool = True


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


class ConfigError(ValueError):
    pass


def load_config(path=None, overrides=()):
    """Defaults <- YAML file <- `a.b.c=value` overrides. Raises ConfigError naming the bad key."""
    cfg = Config()
    if path is not None:
        with open(path) as f:
            tree = yaml.safe_load(f) or {}
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: expected a mapping of sections at the top level, got {type(tree).__name__}")
        for key, value in _flatten(tree):
            _set_key(cfg, key, value, source=path)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form a.b.c=value")
        key, raw = item.split("=", 1)
        _set_key(cfg, key.strip(), yaml.safe_load(raw) if raw.strip() else None, source="command line")
    check_config(cfg)
    return cfg


def check_config(cfg):
    """Cross-key checks that can fail before any model is loaded."""
    a, r, d = cfg.worker.actor, cfg.worker.rollout, cfg.data
    choices = {
        "algorithm.adv_estimator": (cfg.algorithm.adv_estimator,
                                    ["grpo", "grpo_passk", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"]),
        "algorithm.kl_penalty": (cfg.algorithm.kl_penalty, ["kl", "abs", "mse", "low_var_kl"]),
        "algorithm.kl_type": (cfg.algorithm.kl_type, ["fixed", "adaptive"]),
        "worker.actor.loss_type": (a.loss_type, ["default", "gspo", "gspo_token", "cispo", "sapo"]),
        "worker.actor.loss_avg_mode": (a.loss_avg_mode, ["token", "seq", "seq_sum_norm"]),
        "worker.actor.optim.strategy": (a.optim.strategy, ["adamw", "adamw_bf16"]),
        "worker.actor.optim.lr_scheduler_type": (a.optim.lr_scheduler_type, ["constant", "cosine"]),
        "worker.rollout.name": (r.name, ["vllm", "hf"]),
        "trainer.device": (cfg.trainer.device, ["auto", "cpu", "cuda"]),
    }
    for key, (value, allowed) in choices.items():
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {allowed}")
    if a.clip_ratio_dual <= 1.0:
        raise ConfigError(f"worker.actor.clip_ratio_dual={a.clip_ratio_dual} must be > 1 (dual-clip PPO)")
    if d.rollout_batch_size % a.global_batch_size != 0:
        raise ConfigError(f"data.rollout_batch_size={d.rollout_batch_size} must be a multiple of "
                          f"worker.actor.global_batch_size={a.global_batch_size}")
    if cfg.algorithm.adv_estimator in ("grpo", "grpo_passk", "rloo") and r.n < 2:
        raise ConfigError(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} needs groups: "
                          f"set worker.rollout.n >= 2 (it is {r.n})")
    if a.ulysses_size != 1:
        raise ConfigError("worker.actor.ulysses_size > 1 (sequence parallelism) is not supported; set it to 1")
    if not a.padding_free:
        raise ConfigError("worker.actor.padding_free=false is not supported: the actor always packs sequences")


def config_to_dict(cfg):
    return dataclasses.asdict(cfg)


def _flatten(tree, prefix=""):
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and not _is_dict_field(dotted):
            yield from _flatten(value, dotted + ".")
        else:
            yield dotted, value


def _is_dict_field(dotted):
    """Keys whose value is itself a free-form dict (e.g. val_override_config)."""
    try:
        return _field_type(dotted) is dict
    except ConfigError:
        return False


def _all_keys(obj=None, prefix=""):
    obj = Config() if obj is None else obj
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _all_keys(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def _unknown_key(key, source):
    keys = list(_all_keys())
    last = key.split(".")[-1]
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
    if not close:  # right name, wrong section: match on the last part
        close = [k for k in keys if k.split(".")[-1] == last] or difflib.get_close_matches(
            last, [k.split(".")[-1] for k in keys], n=1, cutoff=0.6)
        close = [k for k in keys if close and k.split(".")[-1] == close[0].split(".")[-1]][:1]
    hint = f" did you mean {close[0]}?" if close else ""
    return ConfigError(f"unknown config key {key!r} ({source}).{hint}")


def _field_type(dotted):
    obj, parts = Config(), dotted.split(".")
    for i, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(obj)}
        if part not in fields:
            raise _unknown_key(dotted, "")
        value = getattr(obj, part)
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(value):
                raise ConfigError(f"{dotted} is a section; set its keys ({dotted}.<key>)")
            return _resolve_type(typing.get_type_hints(type(obj))[part])
        if not dataclasses.is_dataclass(value):
            raise _unknown_key(dotted, "")
        obj = value


def _resolve_type(hint):
    """Optional[X] -> X; list/dict stay; bool, int, float, str."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union and len(args) == 1:
        return _resolve_type(args[0])
    return typing.get_origin(hint) or hint


def _set_key(cfg, dotted, value, source):
    obj, parts = cfg, dotted.split(".")
    for part in parts[:-1]:
        if not hasattr(obj, part) or not dataclasses.is_dataclass(getattr(obj, part)):
            raise _unknown_key(dotted, source)
        obj = getattr(obj, part)
    if not dataclasses.is_dataclass(obj) or parts[-1] not in {f.name for f in dataclasses.fields(obj)}:
        raise _unknown_key(dotted, source)
    typ = _field_type(dotted)
    setattr(obj, parts[-1], _coerce(value, typ, dotted, source))


def _coerce(value, typ, key, source):
    if value is None:
        return None
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
                return value.lower() in ("true", "1", "yes")
            raise ValueError
        if typ is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(float(value)) if isinstance(value, str) else int(value)
        if typ is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if typ is str:
            if isinstance(value, (dict, list)):
                raise ValueError
            return str(value)
        if typ is list:
            if isinstance(value, str):  # a,b,c on the command line
                value = [yaml.safe_load(v) for v in value.split(",")]
            return list(value)
        if typ is dict:
            if not isinstance(value, dict):
                raise ValueError
            return dict(value)
    except (TypeError, ValueError):
        pass
    else:
        return value
    raise ConfigError(f"{key}={value!r} ({source}): expected {typ.__name__}")


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
    except ConfigError as e:
        parser.exit(2, f"config error: {e}\n")
    return args, cfg


def main(argv=None):
    args, cfg = parse_args(argv)
    if args.print_config:
        print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
        return 0
    raise SystemExit("the training loop is not built yet")


if __name__ == "__main__":
    sys.exit(main())
