"""config.py: every setting of a run, with EasyR1's section and key names; imports no stage, Ray or datasets.

    cfg = load_config("configs/geo3k.yaml", ["worker.rollout.n=8", "trainer.logger=[console,wandb]"])
    cfg.worker.actor.optim.lr                      # 1e-06: plain dataclasses, one per section

Defaults are EasyR1's `examples/config.yaml` with its geo3k script's data and model, but for the actor's offload and
the logger (README); configs/geo3k.yaml documents every key. load_config merges defaults <- YAML file <- `a.b.c=value`
overrides with OmegaConf, as EasyR1 does (a value must fit its key's type: `n=2.5` fails); unlike it, `a,b` sets a list
key, a dict key given whole is replaced, and an unknown key names the closest valid one (EASYR1_ONLY's: why not here).
check_config checks values against each other; trainer.check_choices those each stage lists in its own table."""

import dataclasses
import difflib
import logging
import operator
import os
import typing
from dataclasses import dataclass, field
from typing import Literal, Optional

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, GrammarParseError, OmegaConfBaseException

logger = logging.getLogger(__name__)

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


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
    skip_bad_rows: bool = False


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True
    disable_kl: bool = False
    use_kl_loss: bool = True
    kl_penalty: Literal["kl", "abs", "mse", "low_var_kl"] = "low_var_kl"
    kl_coef: float = 1.0e-2
    kl_type: Literal["fixed", "adaptive"] = "fixed"
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
    strategy: Literal["adamw", "adamw_bf16"] = "adamw"
    lr_warmup_ratio: float = 0.0
    lr_warmup_steps: Optional[int] = None
    min_lr_ratio: Optional[float] = None
    lr_scheduler_type: Literal["constant", "cosine"] = "constant"


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
    strategy: Literal["fsdp"] = "fsdp"
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
    use_torch_compile: bool = True
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
    call_timeout: Optional[float] = 600.0


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
    device: Literal["auto", "cpu", "cuda"] = "auto"
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
    """Defaults <- YAML file <- `a.b.c=value` overrides, then check_config. Raises ConfigError naming the bad key."""
    try:
        cfg = OmegaConf.structured(Config)  # struct mode: a key that is not a field is an error
        if path is not None:
            try:
                tree = OmegaConf.load(path := _config_file(path))
            except OSError as e:  # no permission; a file of one value (OmegaConf: "Invalid loaded object type: int")
                raise ConfigError(f"{path}: {e.strerror or e}; expected a mapping of sections at the top") from None
            except UnicodeDecodeError as e:  # saved as UTF-16, or no text file at all (a .parquet given as --config)
                raise ConfigError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); expected a YAML file") \
                    from None
            if not isinstance(tree, DictConfig):
                raise ConfigError(f"{path}: expected a mapping of sections at the top level, got a list")
            cfg = _merge(cfg, tree, path, replace_dicts=True)
        for item in overrides:
            key, equals, value = item.partition("=")
            if not (key := key.strip()) or not equals:
                raise ConfigError(f"override {item!r} is not of the form a.b.c=value")
            if any(k.startswith(key + ".") for k in KEYS):
                raise ConfigError(f"{key} is a section; set its keys ({key}.<key>=value)")
            value = f"[{value}]" if KEYS.get(key) is list and not value.lstrip().startswith("[") else value  # a,b,c
            layer = OmegaConf.from_dotlist([f"{key}={value}"])
            if KEYS.get(key) in (str, Optional[str]) and type(OmegaConf.select(layer, key)) in (int, float, bool):
                OmegaConf.update(layer, key, value.strip())  # `experiment_name=007` is the text 007, not 7
            # `val_override_config={...}` replaces the dict; `val_override_config.top_p=0.9` sets one entry
            cfg = _merge(cfg, layer, "command line", replace_dicts=key in KEYS)
        cfg = OmegaConf.to_object(cfg)  # the dataclasses, ${...} interpolations resolved
    except OmegaConfBaseException as e:  # e.g. a bad ${...} interpolation in the file, an override or a default
        literal = " (a literal ${ is written \\${)" if isinstance(e, GrammarParseError) else ""
        raise ConfigError(f"{e.full_key}: {str(e).splitlines()[0]}{literal}") from None
    except yaml.YAMLError as e:  # the file's syntax; the message says where
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    check_config(cfg)
    return cfg


def check_config(cfg):
    """Checks of values against each other, before any model is loaded."""
    a, r, d, t, alg = cfg.worker.actor, cfg.worker.rollout, cfg.data, cfg.trainer, cfg.algorithm
    o = a.optim
    for key in ("data.rollout_batch_size", "data.mini_rollout_batch_size", "worker.actor.global_batch_size",
                "worker.actor.micro_batch_size_per_device_for_update", "worker.actor.max_tokens_per_micro_batch",
                "worker.actor.micro_batch_size_per_device_for_experience", "worker.actor.ppo_epochs",
                "worker.rollout.n", "worker.rollout.tensor_parallel_size", "trainer.total_epochs", "trainer.max_steps",
                "trainer.nnodes", "trainer.n_gpus_per_node", "data.max_response_length"):
        if (value := operator.attrgetter(key)(cfg)) is not None and value < 1:
            raise ConfigError(f"{key}={value} must be at least 1")
    if nan := [k for k, hint in KEYS.items() if hint in (float, Optional[float])  # NaN passes every range check
               and (value := operator.attrgetter(k)(cfg)) != value]:
        raise ConfigError(f"{', '.join(nan)}=nan: not a number; give a value")
    if not 0 <= o.lr < float("inf"):  # AdamW: a traceback at setup; adamw_bf16: gradient ascent; inf: NaN weights
        raise ConfigError(f"worker.actor.optim.lr={o.lr} must be finite and >= 0")
    if d.val_batch_size == 0 or d.val_batch_size < -1:
        raise ConfigError(f"data.val_batch_size={d.val_batch_size} must be at least 1, or -1 for the whole set")
    if min(a.max_grad_norm, a.clip_ratio_low, a.clip_ratio_high) < 0 or (a.tis_cap is not None and a.tis_cap <= 0) \
            or a.clip_ratio_low > 1:  # 1 - clip_ratio_low < 0: no lower clip at all (EasyR1: NaN)
        raise ConfigError(f"worker.actor.max_grad_norm={a.max_grad_norm} (0: no clipping), clip_ratio_low="
                          f"{a.clip_ratio_low} (in [0, 1]), clip_ratio_high={a.clip_ratio_high} (>= 0), tis_cap="
                          f"{a.tis_cap} (> 0 or null): out of range (a negative one reverses or stops the gradient)")
    if min(alg.kl_coef, o.weight_decay, o.lr_warmup_steps or 0) < 0 or not 0 <= o.lr_warmup_ratio <= 1 \
            or not 0 <= (o.min_lr_ratio or 0) <= 1:  # beta < 0 pushes away from the reference; a ratio > 1 lifts lr
        raise ConfigError(f"algorithm.kl_coef={alg.kl_coef}, worker.actor.optim.weight_decay={o.weight_decay}, "
                          f"lr_warmup_steps={o.lr_warmup_steps} (>= 0; null: the ratio), lr_warmup_ratio="
                          f"{o.lr_warmup_ratio}, min_lr_ratio={o.min_lr_ratio} (in [0, 1]): out of range")
    if len(o.betas) != 2 or not all(type(b) in (int, float) and 0 <= b < 1 for b in o.betas):  # else AdamW fails
        raise ConfigError(f"worker.actor.optim.betas={o.betas} must be two numbers in [0, 1), as [0.9, 0.999]")
    if (lora := a.model.lora).rank < 0 or lora.rank and lora.alpha <= 0:  # alpha 0 zeroes every adapter's output
        raise ConfigError(f"worker.actor.model.lora.rank={lora.rank} (0: no LoRA) and alpha={lora.alpha} (> 0 with a "
                          "rank): out of range")
    if a.clip_ratio_dual <= 1.0:
        raise ConfigError(f"worker.actor.clip_ratio_dual={a.clip_ratio_dual} must be > 1 (dual-clip PPO)")
    if not (a.tau_positive > 0 and a.tau_negative > 0):  # SAPO's gate (4 / tau) sigma(tau (r - 1)): NaN at 0
        raise ConfigError(f"worker.actor.tau_positive={a.tau_positive}, tau_negative={a.tau_negative} must be > 0 "
                          "(SAPO's gate temperatures)")
    if d.rollout_batch_size % a.global_batch_size != 0:
        raise ConfigError(f"data.rollout_batch_size={d.rollout_batch_size} must be a multiple of "
                          f"worker.actor.global_batch_size={a.global_batch_size}")
    world, n = t.nnodes * t.n_gpus_per_node, d.rollout_batch_size * r.n  # workers (GPUs; CPU: processes); responses
    if r.name == "vllm" and world % r.tensor_parallel_size:
        raise ConfigError(f"worker.rollout.tensor_parallel_size={r.tensor_parallel_size} must divide the {world} "
                          f"workers (trainer.nnodes x trainer.n_gpus_per_node)")
    if bad := [f"worker.{k}.fsdp.fsdp_size={f.fsdp_size}" for k, f in (("actor", a.fsdp), ("ref", cfg.worker.ref.fsdp))
               if 0 < f.fsdp_size < world and world % f.fsdp_size]:  # the (world / size, size) mesh: not all ranks
        raise ConfigError(f"{', '.join(bad)} must divide the {world} workers (trainer.nnodes x n_gpus_per_node), or -1")
    if a.global_batch_size * r.n % world:  # then rollout_batch_size x n, a multiple, divides too
        raise ConfigError(f"worker.actor.global_batch_size x worker.rollout.n = {a.global_batch_size * r.n} must be "
                          f"divisible by the {world} workers (trainer.nnodes x trainer.n_gpus_per_node)")
    if alg.adv_estimator in ("grpo", "grpo_passk", "rloo", "reinforce_plus_plus_baseline") and r.n < 2:
        raise ConfigError(f"algorithm.adv_estimator={alg.adv_estimator} needs groups: worker.rollout.n={r.n} < 2")
    if alg.kl_type == "adaptive" and (alg.kl_target <= 0 or alg.kl_horizon <= 0.2 * n):  # beta (1 - 0.2 n / h) > 0
        raise ConfigError(f"algorithm.kl_type=adaptive needs algorithm.kl_target={alg.kl_target} > 0 and "
                          f"algorithm.kl_horizon={alg.kl_horizon} > 0.2 x {n} (responses a step)")
    if alg.online_filtering and r.n < 2:  # a group of one: only responses scoring strictly between would train
        raise ConfigError(f"algorithm.online_filtering keeps the groups whose mean score is in (filter_low, "
                          f"filter_high): worker.rollout.n={r.n} makes each response its own group")
    if alg.online_filtering and alg.filter_low >= alg.filter_high:  # a group is kept when low < mean < high: none
        raise ConfigError(f"algorithm.filter_low={alg.filter_low} must be < algorithm.filter_high={alg.filter_high}")
    if not alg.online_filtering and (d.mini_rollout_batch_size or 0) > d.rollout_batch_size:  # the excess is dropped
        raise ConfigError(f"data.mini_rollout_batch_size={d.mini_rollout_batch_size} must be at most "
                          f"data.rollout_batch_size={d.rollout_batch_size} without algorithm.online_filtering")
    if d.mini_rollout_batch_size and 0 < t.max_try_make_batch < (rounds := -(-d.rollout_batch_size //
                                                                            d.mini_rollout_batch_size)):
        raise ConfigError(f"trainer.max_try_make_batch={t.max_try_make_batch} is below the {rounds} generation rounds "
                          f"of data.mini_rollout_batch_size={d.mini_rollout_batch_size} that a step's data.rollout_"
                          f"batch_size={d.rollout_batch_size} needs at least (step 1 would fail after generating them; "
                          f"online filtering needs more): raise it (<= 0: no limit)")
    for where, s in (("", vars(r)), ("val_override_config.", {**vars(r), **r.val_override_config})):  # at start-up
        if any(type(s[k]) not in (int, float) for k in ("temperature", "top_p")) \
                or any(type(s[k]) is not int for k in ("n", "top_k")) or s["n"] < 1 \
                or s["temperature"] < 0 or not 0 < s["top_p"] <= 1 or s["top_k"] < -1:  # a dict's values: untyped
            raise ConfigError(f"worker.rollout.{where}n={s['n']} (>= 1), temperature={s['temperature']} (>= 0), "
                              f"top_p={s['top_p']} (in (0, 1]), top_k={s['top_k']} (-1 or 0: off; n and top_k "
                              f"integers): out of range")
    if not 0 < r.gpu_memory_utilization <= 1 or not d.video_fps > 0:  # vLLM's refusal in each worker; frames of 0 fps
        raise ConfigError(f"worker.rollout.gpu_memory_utilization={r.gpu_memory_utilization} (in (0, 1]), data.video_"
                          f"fps={d.video_fps} (> 0): out of range")
    if r.max_model_len is not None and r.max_model_len < d.max_prompt_length + d.max_response_length:
        raise ConfigError(f"worker.rollout.max_model_len={r.max_model_len} is below data.max_prompt_length + "
                          f"max_response_length = {d.max_prompt_length + d.max_response_length}: vLLM would refuse "
                          "the longest prompts mid-run and cut responses short (null: their sum)")
    if r.temperature < 1e-5:  # 0: NaN log-probs; vLLM samples greedily below 1e-5
        raise ConfigError(f"worker.rollout.temperature={r.temperature}: training samples at a temperature >= 1e-5 "
                          "(log-probs divide the logits by it); greedy decoding is for validation: val_override_config")
    if alg.kl_type == "adaptive" and alg.use_kl_loss and not alg.disable_kl:  # as EasyR1: the loss keeps kl_coef
        raise ConfigError("algorithm.kl_type=adaptive adapts the KL in the reward, which use_kl_loss=true turns off "
                          "(the KL loss keeps algorithm.kl_coef): set algorithm.use_kl_loss=false, or kl_type=fixed")
    if not alg.norm_adv_by_std_in_grpo and alg.adv_estimator != "grpo":
        raise ConfigError(f"algorithm.norm_adv_by_std_in_grpo=false (Dr. GRPO) applies to adv_estimator=grpo only, "
                          f"not {alg.adv_estimator}")
    if abs(d.seed) >= 2**43:  # epoch e shuffles under seed * 1_000_003 + e, which must fit torch's 64-bit seed
        raise ConfigError(f"data.seed={d.seed} must be below 2**43 in size")
    if r.top_p < 1 or r.top_k > 0:
        logger.warning("worker.rollout.top_p=%s, top_k=%s: responses are sampled from the truncated distribution, "
                       "but the log-probs are of the whole one, so the PPO ratios and KL are off (rollout/logp_diff_"
                       "mean shows how far; as in EasyR1): keep top_p 1 and top_k -1 for training; val_override_config "
                       "may set them for validation", r.top_p, r.top_k)
    if not alg.online_filtering and d.mini_rollout_batch_size and d.rollout_batch_size % d.mini_rollout_batch_size:
        logger.warning("data.mini_rollout_batch_size=%d does not divide data.rollout_batch_size=%d: each step's last "
                       "generation round makes prompts it does not train on (as in EasyR1); a divisor wastes none",
                       d.mini_rollout_batch_size, d.rollout_batch_size)
    if (length := cfg.worker.reward.reward_function_kwargs.get("max_response_length", d.max_response_length)) \
            != d.max_response_length:  # DAPO's overlong penalty then starts and ends elsewhere than the cut
        logger.warning("worker.reward.reward_function_kwargs.max_response_length=%s, data.max_response_length=%d: "
                       "the reward's length limit is not the rollout's", length, d.max_response_length)
    if o.min_lr_ratio and o.lr_scheduler_type == "constant":  # as in EasyR1, but a floor set suggests a decay
        logger.warning("worker.actor.optim.min_lr_ratio=%s does nothing under lr_scheduler_type=constant: set "
                       "lr_scheduler_type=cosine to decay to it", o.min_lr_ratio)
    if a.fsdp.mp_param_dtype in ("fp16", "float16") or a.fsdp.torch_dtype in ("fp16", "float16"):
        logger.warning("worker.actor.fsdp mp_param_dtype=%s, torch_dtype=%s: fp16 training has no loss scaling "
                       "here, so gradients below fp16's range vanish and activations may overflow: use bf16 where the "
                       "GPU has it", a.fsdp.mp_param_dtype, a.fsdp.torch_dtype)
    if alg.gamma != 1.0:
        raise ConfigError("algorithm.gamma must be 1.0: returns are undiscounted sums of the response's token "
                          "rewards (a discount, which EasyR1 applies in REINFORCE++ and GAE, is not supported)")
    if a.ulysses_size != 1 or not a.padding_free:  # EasyR1's keys, kept so that its configs load
        raise ConfigError(f"worker.actor.ulysses_size={a.ulysses_size}, padding_free={a.padding_free}: only 1 and "
                          "true are supported (no sequence parallelism; the actor always packs sequences)")


def _merge(cfg, layer, source, replace_dicts):
    """cfg with `layer` merged in (OmegaConf checks keys and types); with replace_dicts, a dict key that the
    layer sets is replaced, not merged entry by entry."""
    for key in [k for k, hint in KEYS.items() if hint is dict and replace_dicts]:
        if OmegaConf.select(layer, key, throw_on_resolution_failure=False) is not None:
            OmegaConf.update(cfg, key, {}, merge=False)
    try:
        return OmegaConf.merge(cfg, layer)
    except TypeError:  # a list key given a mapping, a dict key a list: OmegaConf's "incompatible container types"
        wrong = {list: DictConfig, dict: ListConfig}  # the container each kind of key cannot take
        bad = [k for k, hint in KEYS.items()
               if isinstance(OmegaConf.select(layer, k, throw_on_resolution_failure=False), wrong.get(hint, ()))]
        if not bad:
            raise
        value = OmegaConf.to_container(OmegaConf.select(layer, bad[0]))
        raise ConfigError(f"{bad[0]}={value!r} ({source}): expected {KEYS[bad[0]].__name__}") from None
    except ConfigKeyError as e:  # not a field: name the closest key, or the key of that name in another section
        leaves = {k.split(".")[-1]: k for k in reversed(KEYS)}  # last part -> the first key ending in it
        tried, sub = e.full_key, OmegaConf.select(layer, e.full_key, throw_on_resolution_failure=False)
        while isinstance(sub, DictConfig) and len(sub):  # a mistyped section (worker.actr.optim.lr): its first key
            key = next(iter(sub))
            tried, sub = f"{tried}.{key}", sub[key]
        close = difflib.get_close_matches(tried, KEYS, n=1, cutoff=0.5) or [
            leaves[m] for m in difflib.get_close_matches(e.full_key.split(".")[-1], leaves, n=1, cutoff=0.6)]
        hint = EASYR1_ONLY.get(e.full_key) or (f" did you mean {close[0]}?" if close else "")
        raise ConfigError(f"unknown config key {e.full_key!r} ({source}).{hint}") from None
    except OmegaConfBaseException as e:
        if e.full_key not in KEYS:  # e.g. a value given for a whole section
            raise ConfigError(f"{source}: {str(e).splitlines()[0]}") from None
        value, hint = OmegaConf.select(layer, e.full_key, throw_on_resolution_failure=False), KEYS[e.full_key]
        args = typing.get_args(hint)  # a Literal's values, or an Optional's types
        if typing.get_origin(hint) is Literal:
            raise ConfigError(f"{e.full_key}={value!r} is not one of {list(args)} ({source})") from None
        expected = " or ".join("null" if t is type(None) else t.__name__ for t in args or [hint])
        raise ConfigError(f"{e.full_key}={value!r} ({source}): expected {expected}") from None


def _config_file(path):
    """`path` as given if it exists (~ expanded), else from this folder (`configs/geo3k.yaml` run elsewhere), else the
    file of that name in configs/ (`geo3k.yaml`, or `geo3k`)."""
    path = os.path.expanduser(path)
    for candidate in (path, os.path.join(os.path.dirname(CONFIGS), path), os.path.join(CONFIGS, path),
                      os.path.join(CONFIGS, path + ".yaml")):
        if os.path.isfile(candidate):
            return candidate
    shipped = sorted(n for n in os.listdir(CONFIGS) if n.endswith(".yaml"))
    raise ConfigError(f"no config file {path!r} (nor in {CONFIGS}: {', '.join(shipped)})")


def _leaves(cls, prefix=""):
    for name, hint in typing.get_type_hints(cls).items():  # a section's keys, or (key, type) of a leaf
        yield from _leaves(hint, f"{prefix}{name}.") if dataclasses.is_dataclass(hint) else [(f"{prefix}{name}", hint)]


KEYS = dict(_leaves(Config))  # every dotted key and its type: "worker.rollout.n" -> int
EASYR1_ONLY = {k: f" EasyR1's key, not supported here: {v}." for k, v in {  # not a near miss: why there is none
    "worker.critic": "no critic (no gae)", "algorithm.lam": "GAE's (no gae)", "trainer.critic_warmup": "no critic",
    "worker.hybrid_engine": "the rollout always shares the actor's GPUs", "trainer.ray_timeline": "no Ray timeline",
    "worker.reward.num_cpus": "rewards run on the driver", "worker.ref.strategy": "always FSDP, as the actor"}.items()}
config_to_dict = dataclasses.asdict  # a Config as nested dicts, for printing and logging
