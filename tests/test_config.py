import logging
import os
import re
import subprocess
import sys

import pytest
import yaml

import advantage
import config
import trainer
from config import CONFIGS, ConfigError, load_config


def load_checked(*overrides):
    """load_config, then trainer's check of the values each stage accepts (its own tables), as the command line."""
    cfg = load_config(None, overrides)
    trainer.check_choices(cfg)
    return cfg


def test_config_imports_no_stage_nor_ray_nor_datasets():
    """Tests and benchmarks build configs without starting the trainer's imports."""
    code = "import sys, config; print(sorted(set(sys.modules) & set(sys.argv[1:])))"
    heavy = ["ray", "datasets", "torch", "data", "rollout", "reward", "advantage", "actor", "merge", "trainer",
             "workers"]
    out = subprocess.run([sys.executable, "-c", code, *heavy], cwd=os.path.dirname(CONFIGS), capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]"


def test_defaults_match_easyr1_example_config():
    cfg = load_config()
    # A sample of EasyR1 examples/config.yaml values (research notes, section 2).
    assert cfg.data.max_prompt_length == 2048 and cfg.data.rollout_batch_size == 512
    assert cfg.data.min_pixels == 262144 and cfg.data.max_pixels == 4194304
    assert cfg.algorithm.kl_penalty == "low_var_kl" and cfg.algorithm.kl_coef == 1e-2 and cfg.algorithm.use_kl_loss
    assert cfg.worker.actor.clip_ratio_high == 0.3 and cfg.worker.actor.clip_ratio_dual == 3.0
    assert cfg.worker.actor.global_batch_size == 128 and cfg.worker.actor.optim.lr == 1e-6
    assert cfg.worker.rollout.n == 5 and cfg.worker.rollout.gpu_memory_utilization == 0.6
    assert cfg.worker.rollout.val_override_config == {"temperature": 0.6, "top_p": 0.95, "n": 1}
    assert cfg.trainer.save_limit == 3 and cfg.trainer.val_freq == 5
    # EasyR1's dataclass defaults that its example config does not set (research notes, section 3).
    assert cfg.worker.actor.clip_ratio_low == 0.2 and cfg.worker.actor.optim.betas == [0.9, 0.999]
    assert cfg.worker.actor.optim.min_lr_ratio is None and cfg.worker.actor.optim.lr_scheduler_type == "constant"


def test_yaml_and_overrides_with_type_coercion(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  rollout_batch_size: 256\nworker:\n  rollout:\n    n: 8\n")
    cfg = load_config(str(path), [
        "worker.actor.optim.lr=1e-5",           # YAML 1.1 reads this as a string; coerced to float
        "worker.actor.ppo_epochs=2",
        "algorithm.disable_kl=true",
        "trainer.logger=[console,file,tensorboard]",
        "trainer.max_steps=null",
        "data.format_prompt=null",
        "worker.actor.optim.betas=0.9,0.95",
        "worker.rollout.val_override_config={temperature: 0.0, n: 2}",
    ])
    assert cfg.data.rollout_batch_size == 256 and cfg.worker.rollout.n == 8
    assert cfg.worker.actor.optim.lr == 1e-5 and isinstance(cfg.worker.actor.optim.lr, float)
    assert cfg.worker.actor.ppo_epochs == 2 and cfg.algorithm.disable_kl is True
    assert cfg.trainer.logger == ["console", "file", "tensorboard"]
    assert cfg.trainer.max_steps is None and cfg.data.format_prompt is None
    assert cfg.worker.actor.optim.betas == [0.9, 0.95]
    assert cfg.worker.rollout.val_override_config == {"temperature": 0.0, "n": 2}


def test_a_dict_key_is_replaced_whole_and_one_entry_can_be_set(tmp_path):
    """A file's val_override_config replaces the default's (no top_p 0.95 left over);
    `key.entry=value` on the command line sets one entry and keeps the others."""
    path = tmp_path / "c.yaml"
    path.write_text("worker:\n  rollout:\n    val_override_config: {temperature: 0.0, n: 1}\n")
    assert load_config(str(path)).worker.rollout.val_override_config == {"temperature": 0.0, "n": 1}
    cfg = load_config(None, ["worker.rollout.val_override_config.top_p=0.9"])
    assert cfg.worker.rollout.val_override_config == {"temperature": 0.6, "top_p": 0.9, "n": 1}
    with pytest.raises(ConfigError, match=re.escape("worker.rollout is a section; set its keys")):
        load_config(None, ["worker.rollout=5"])


@pytest.mark.parametrize("override, suggestion", [
    ("worker.rollout.temprature=0.5", "worker.rollout.temperature"),
    ("temperature=0.5", "worker.rollout.temperature"),
    ("data.max_prompt_len=10", "data.max_prompt_length"),
    ("worker.actor.lr=1e-6", "worker.actor.optim.lr"),
])
def test_unknown_key_names_the_closest(override, suggestion):
    with pytest.raises(ConfigError, match=re.escape(f"did you mean {suggestion}?")):
        load_config(None, [override])


def test_unknown_key_in_yaml_names_file(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("worker:\n  rollout:\n    temprature: 0.5\n")
    with pytest.raises(ConfigError, match=r"typo\.yaml.*did you mean worker\.rollout\.temperature"):
        load_config(str(path))


def test_broken_yaml_and_interpolations_are_config_errors(tmp_path):
    """A YAML syntax error names the file and line; a `${` that is no interpolation, in the file or on the command
    line, names the key and how to write it literally (both were raw tracebacks from OmegaConf); so does a file that
    is not UTF-8 (a UnicodeDecodeError traceback)."""
    broken = tmp_path / "broken.yaml"
    broken.write_text("data:\n  system_prompt: [a\n  seed: 1\n")
    with pytest.raises(ConfigError, match=r"(?s)broken\.yaml is not valid YAML: .*line 2"):
        load_config(str(broken))
    dollar = tmp_path / "dollar.yaml"
    dollar.write_text('data:\n  system_prompt: "costs ${5"\n')
    for path, overrides in ((str(dollar), []), (None, ["data.system_prompt=costs ${5"])):
        with pytest.raises(ConfigError, match=re.escape("data.system_prompt: ") + ".*" +
                           re.escape("(a literal ${ is written \\${)")):
            load_config(path, overrides)
    assert load_config(None, ["data.system_prompt=costs \\${5"]).data.system_prompt == "costs ${5"
    utf16 = tmp_path / "utf16.yaml"  # an editor's UTF-16, or a data file given as --config: a UnicodeDecodeError
    utf16.write_bytes("trainer:\n  max_steps: 3\n".encode("utf-16"))
    with pytest.raises(ConfigError, match=re.escape(f"{utf16} is not UTF-8 text (invalid start byte at byte 0)")):
        load_config(str(utf16))


@pytest.mark.parametrize("override, message", [
    ("worker.actor.optim.lr=abc", "worker.actor.optim.lr='abc' (command line): expected float"),
    ("worker.rollout.n=2.5", "worker.rollout.n=2.5 (command line): expected int"),
    ("algorithm.disable_kl=maybe", "algorithm.disable_kl='maybe' (command line): expected bool"),
    ("trainer.logger.wandb=true", "trainer.logger={'wandb': True} (command line): expected list"),  # a list key's entry
    ("worker.actor.optim.betas.0=0.9", "worker.actor.optim.betas={'0': 0.9} (command line): expected list"),
    ("worker.rollout.val_override_config=[0.6]", "worker.rollout.val_override_config=[0.6] (command line): "
                                                 "expected dict"),
])
def test_bad_value_type(override, message):
    """A list key given a mapping or a dict key a list was OmegaConf's TypeError, a traceback naming no key."""
    with pytest.raises(ConfigError, match=re.escape(message) + "$"):
        load_config(None, [override])


def test_a_dict_key_written_as_a_list_in_the_file_names_the_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("worker:\n  reward:\n    reward_function_kwargs:\n      - max_response_length: 16\n")
    with pytest.raises(ConfigError, match=re.escape(f"worker.reward.reward_function_kwargs=[{{'max_response_length': "
                                                    f"16}}] ({path}): expected dict")):
        load_config(str(path))


def test_a_logger_entry_that_is_not_a_name_is_a_config_error():
    """A mapping or a list as an entry of trainer.logger (YAML's `- wandb:` under logger, trainer.logger=[[file]])
    loads, as the list's entries are not typed, but the check of the names stopped trainer.py with 'TypeError:
    unhashable type', a traceback naming no key."""
    for override, entry in (("trainer.logger=[console,{wandb: 1}]", "{'wandb': 1}"),
                            ("trainer.logger=[[file]]", "['file']")):
        with pytest.raises(ConfigError, match=re.escape(f"trainer.logger has [{entry}]; choose from ['console'")):
            load_checked(override)


def test_cross_key_checks():
    with pytest.raises(ConfigError, match="clip_ratio_dual"):
        load_config(None, ["worker.actor.clip_ratio_dual=1.0"])
    for lora in (["rank=-1"], ["rank=8", "alpha=0"]):  # peft's error from each worker; alpha 0: adapters add nothing
        with pytest.raises(ConfigError, match=r"lora.rank=-?\d \(0: no LoRA\) and alpha=\d+ .*out of range"):
            load_config(None, [f"worker.actor.model.lora.{o}" for o in lora])
    with pytest.raises(ConfigError, match="multiple of"):
        load_config(None, ["data.rollout_batch_size=100"])
    with pytest.raises(ConfigError, match="needs groups"):
        load_config(None, ["worker.rollout.n=1"])
    with pytest.raises(ConfigError, match="not one of"):
        load_checked("algorithm.adv_estimator=gae")


def test_every_key_documented_once_in_geo3k_yaml():
    """geo3k.yaml lists every key with a comment (worker.ref mirrors worker.actor.fsdp/offload)."""
    lines = open(os.path.join(CONFIGS, "geo3k.yaml")).read().splitlines()
    documented, stack = set(), []
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        indent = (len(line) - len(line.lstrip())) // 2
        key = line.strip().split(":")[0]
        stack = stack[:indent] + [key]
        dotted = ".".join(stack)
        is_leaf = line.split(":", 1)[1].split("#")[0].strip() != ""
        if is_leaf:
            documented.add(dotted)
            assert "#" in line or dotted.startswith("worker.ref."), f"no comment for {dotted}"
    keys = set(config.KEYS)
    assert keys - documented == set(), f"undocumented keys: {sorted(keys - documented)}"
    assert documented - keys == set(), f"documented keys that do not exist: {sorted(documented - keys)}"
    # And the file itself equals the defaults: it is the reference job.
    geo3k = load_config(os.path.join(CONFIGS, "geo3k.yaml"))
    assert config.config_to_dict(geo3k) == config.config_to_dict(load_config())


def test_every_shipped_config_loads():
    names = [n for n in os.listdir(CONFIGS) if n.endswith(".yaml")]
    assert "toy.yaml" in names and "geo3k.yaml" in names
    for name in names:
        trainer.check_choices(load_config(os.path.join(CONFIGS, name)))


def test_print_config_and_typo_on_the_command_line(capsys):
    assert trainer.main(["--print-config", "worker.rollout.n=7"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["worker"]["rollout"]["n"] == 7
    with pytest.raises(SystemExit) as exit_info:
        trainer.main(["worker.rollout.temprature=1"])
    assert exit_info.value.code == 2
    assert "did you mean worker.rollout.temperature?" in capsys.readouterr().err


@pytest.mark.parametrize("override, message", [
    ("data.rollout_batch_size=0", "data.rollout_batch_size=0 must be at least 1"),
    ("worker.actor.global_batch_size=0", "worker.actor.global_batch_size=0 must be at least 1"),
    ("data.mini_rollout_batch_size=0", "data.mini_rollout_batch_size=0 must be at least 1"),
    ("trainer.max_steps=0", "trainer.max_steps=0 must be at least 1"),
    ("data.val_batch_size=0", "data.val_batch_size=0 must be at least 1, or -1"),
    ("worker.actor.micro_batch_size_per_device_for_update=0", "for_update=0 must be at least 1"),  # a 0 token budget
    ("worker.actor.micro_batch_size_per_device_for_experience=0", "for_experience=0 must be at least 1"),
    ("worker.actor.max_tokens_per_micro_batch=-5", "max_tokens_per_micro_batch=-5 must be at least 1"),
    ("worker.rollout.tensor_parallel_size=0", "tensor_parallel_size=0 must be at least 1"),  # was a ZeroDivisionError
])
def test_zero_sizes_are_config_errors(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])


def test_worker_count_that_does_not_divide_the_batch_fails_at_load():
    """6 workers: mini-batches of 128 x 5 = 640 responses (and so 512 x 5) do not split evenly; found by load_config,
    before any data loads."""
    with pytest.raises(ConfigError, match=re.escape("worker.actor.global_batch_size x worker.rollout.n = 640 must be "
                                                    "divisible by the 6 workers")):
        load_config(None, ["trainer.n_gpus_per_node=6"])
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 must divide the 3 workers"):
        load_config(None, ["trainer.n_gpus_per_node=3"])
    load_config(None, ["trainer.n_gpus_per_node=3", "worker.rollout.name=hf", "data.rollout_batch_size=384",
                       "worker.actor.global_batch_size=192"])
    # the responses of a mini-batch are what is split: 128 prompts x 3 responses = 384 over 3 workers, 128 each
    load_config(None, ["trainer.n_gpus_per_node=3", "worker.rollout.name=hf", "worker.rollout.n=3"])


@pytest.mark.parametrize("override, message", [
    ("worker.actor.strategy=megatron", "worker.actor.strategy='megatron' is not one of ['fsdp']"),
    ("worker.actor.fsdp.mp_buffer_dtype=bf16", "worker.actor.fsdp.mp_buffer_dtype=bf16: buffers"),
    ("worker.ref.fsdp.mp_buffer_dtype=fp16", "worker.ref.fsdp.mp_buffer_dtype=fp16: buffers"),
    ("worker.ref.fsdp.torch_dtype=fp32", "worker.ref.fsdp.torch_dtype=fp32: the reference stores its weights"),
    ("worker.actor.fsdp.torch_dtype=fp64", "worker.actor.fsdp.torch_dtype='fp64' is not one of"),
    ("worker.rollout.dtype=int8", "worker.rollout.dtype='int8' is not one of"),  # was each worker's traceback
    ("trainer.logger=[console,neptune]", "trainer.logger has ['neptune']"),
])
def test_keys_that_were_silently_ignored_now_fail_with_a_message(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_checked(override)
    # the values that do what EasyR1 does load
    load_checked("worker.ref.fsdp.torch_dtype=bf16", "worker.actor.fsdp.mp_buffer_dtype=float32",
                 "trainer.logger=[console,file,mlflow,swanlab]")
    load_checked("worker.ref.fsdp.torch_dtype=bfloat16")  # the compute dtype bf16 under another of its names
    load_checked("worker.ref.fsdp.torch_dtype=fp32", "worker.ref.fsdp.mp_param_dtype=float32")


def test_bare_config_name_resolves_under_configs(capsys):
    assert trainer.main(["--config", "geo3k.yaml", "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["trainer"]["experiment_name"] == "qwen2_5_vl_7b_geo3k_grpo"
    assert load_config("dapo").data.mini_rollout_batch_size == 128
    with pytest.raises(SystemExit) as exit_info:
        trainer.main(["--config", "geo3k_typo.yaml"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "no config file 'geo3k_typo.yaml'" in err
    assert "geo3k.yaml" in err and "toy.yaml" in err  # it lists what there is


def test_a_shipped_config_is_found_by_its_repository_path_from_any_directory(tmp_path, monkeypatch, capsys):
    """`--config configs/toy_lora.yaml`, as the README writes it, failed outside the repository; overrides may stand
    before and after the options (argparse refused the later ones as unrecognized arguments)."""
    monkeypatch.chdir(tmp_path)
    assert load_config("configs/toy_lora.yaml").worker.actor.model.lora.rank == 8
    argv = ["worker.rollout.n=3", "--config", "configs/toy_lora.yaml", "data.seed=7", "--print-config"]
    assert trainer.main(argv) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["worker"]["rollout"]["n"] == 3 and printed["data"]["seed"] == 7


def test_easyr1_command_line_form_config_equals_path(capsys):
    """EasyR1's scripts name the file as an override, `config=examples/config.yaml`, anywhere on the line: the
    same as --config; two files are an error."""
    assert trainer.main(["worker.rollout.n=3", "config=geo3k.yaml", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert (printed["trainer"]["experiment_name"], printed["worker"]["rollout"]["n"]) == ("qwen2_5_vl_7b_geo3k_grpo", 3)
    with pytest.raises(SystemExit) as exit_info:
        trainer.main(["--config", "toy.yaml", "config=geo3k.yaml"])
    assert exit_info.value.code == 2
    assert "one config file, got ['toy.yaml', 'geo3k.yaml']" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the last one was taken, silently
        trainer.main(["--config", "toy.yaml", "--config", "geo3k.yaml"])
    assert "one config file, got ['toy.yaml', 'geo3k.yaml']" in capsys.readouterr().err


def test_gpu_requirements_install_from_wheels_and_flash_attn_is_a_documented_extra():
    """flash-attn has no binary wheel on PyPI: listed, it turns `pip install -r requirements-gpu.txt` into an
    hours-long source build. It is an optional extra the README explains."""
    root = os.path.dirname(CONFIGS)
    lines = [l.split("#")[0].strip() for l in open(os.path.join(root, "requirements-gpu.txt"))]
    assert not [l for l in lines if l.lower().startswith(("flash-attn", "flash_attn"))]
    readme = open(os.path.join(root, "README.md")).read()
    assert "pip install flash-attn --no-build-isolation" in readme and "varlen_attn" in readme


@pytest.mark.parametrize("overrides, message", [
    # adaptive KL: beta *= 1 + clip(kl / target - 1, -0.2, 0.2) n / horizon, n = 512 x 5 responses a step; target 0
    # divides by zero at step 1, a negative target or horizon turns the controller around (beta falls while the KL
    # grows), and a horizon of at most 0.2 n makes the factor <= 0 when the KL is low: beta 0 or negative
    (["algorithm.kl_type=adaptive", "algorithm.kl_target=0"], "algorithm.kl_target=0.0 > 0 and"),
    (["algorithm.kl_type=adaptive", "algorithm.kl_horizon=-5"], "algorithm.kl_horizon=-5.0 > 0.2 x 2560 (responses"),
    (["algorithm.kl_type=adaptive", "algorithm.kl_horizon=512"], "algorithm.kl_horizon=512.0 > 0.2 x 2560"),
    # the controller adapts the KL in the reward only, which use_kl_loss (the default) turns off: silently fixed
    (["algorithm.kl_type=adaptive"], "algorithm.kl_type=adaptive adapts the KL in the reward, which use_kl_loss=true"),
    # every log-prob pass divides the logits by the temperature: all NaN, every update skipped, validation fine
    (["worker.rollout.temperature=0"], "worker.rollout.temperature=0.0: training samples at a temperature >= 1e-5"),
    # fp32 logits / 1e-40 overflow: a non-finite log-prob error blamed the sample (vLLM samples greedily below 1e-5)
    (["worker.rollout.temperature=1e-40"], "worker.rollout.temperature=1e-40: training samples at a temperature"),
    (["data.max_response_length=0"], "data.max_response_length=0 must be at least 1"),  # was the worker's error
    (["algorithm.adv_estimator=grpo_passk", "algorithm.norm_adv_by_std_in_grpo=false"],
     "algorithm.norm_adv_by_std_in_grpo=false (Dr. GRPO) applies to adv_estimator=grpo only, not grpo_passk"),
    (["data.seed=35184372088832"], "data.seed=35184372088832 must be below 2**43"),  # overflowed at the 1st batch
    # a negative clip norm or TIS cap turned the gradient around; a negative upper clip ratio stopped A > 0 tokens
    (["worker.actor.max_grad_norm=-1"], "worker.actor.max_grad_norm=-1.0 (0: no clipping), clip_ratio_low=0.2"),
    (["worker.actor.tis_cap=0"], "tis_cap=0.0 (> 0 or null): out of range"),
    (["worker.actor.clip_ratio_high=-0.5"], "clip_ratio_high=-0.5 (>= 0)"),
    (["worker.rollout.gpu_memory_utilization=1.5"], "gpu_memory_utilization=1.5 (in (0, 1]), data.video_fps=2.0"),
    (["data.video_fps=0"], "data.video_fps=0.0 (> 0): out of range"),  # vLLM's error in each worker; no frames
    # a group is kept when low < mean < high: no group ever is, and the step retries max_try_make_batch rounds
    (["algorithm.online_filtering=true", "algorithm.filter_low=0.5", "algorithm.filter_high=0.5"],
     "algorithm.filter_low=0.5 must be < algorithm.filter_high=0.5"),
    # ReMax's n=1: each response its own group, only scores strictly between the bounds trained (no right answer)
    (["algorithm.online_filtering=true", "algorithm.adv_estimator=remax", "worker.rollout.n=1"],
     "worker.rollout.n=1 makes each response its own group"),
    # without filtering every group of a round is kept: 512 of the 1024 prompts generated each step were dropped
    (["data.mini_rollout_batch_size=1024"], "data.mini_rollout_batch_size=1024 must be at most data.rollout"),
    # a typo here failed only at the first validation, val_freq steps into training
    (["worker.rollout.val_override_config={temperature: 0.6, topp: 0.9}"],
     "worker.rollout.val_override_config has ['topp']; choose from ['n', 'temperature', 'top_p', 'top_k']"),
    # sampling settings out of range failed at the first generation (validation's: at the first validation), after
    # the models loaded; top_k < -1 switched top-k off in the transformers engine, where vLLM raises
    (["worker.rollout.top_k=-5"], "top_k=-5 (-1 or 0: off; n and top_k integers): out of range"),
    (["worker.rollout.temperature=-0.5"], "worker.rollout.n=5 (>= 1), temperature=-0.5 (>= 0)"),
    (["worker.rollout.val_override_config={top_p: 0}"], "worker.rollout.val_override_config.n=5 (>= 1), "
                                                         "temperature=1.0 (>= 0), top_p=0 (in (0, 1])"),
    (["worker.rollout.val_override_config={n: 0}"], "worker.rollout.val_override_config.n=0 (>= 1)"),
    # a dict's values are not typed by OmegaConf: a string here was a bare TypeError from the comparison
    (["worker.rollout.val_override_config={top_p: abc}"], "top_p=abc (in (0, 1]), top_k=-1 (-1 or 0: off; n and"),
    # a float n or top_k crashed the first validation (range() and topk() take integers)
    (["worker.rollout.val_override_config={temperature: 0, n: 2.0}"],
     "val_override_config.n=2.0 (>= 1), temperature=0"),
    (["worker.rollout.val_override_config={top_k: 2.0}"], "top_k=2.0 (-1 or 0: off; n and top_k integers)"),
])
def test_impossible_combinations_are_config_errors_naming_the_keys(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_checked(*overrides)


def test_the_possible_neighbours_of_those_combinations_load():
    load_checked("algorithm.kl_type=fixed", "algorithm.kl_target=0")  # the target of a fixed controller is unused
    load_checked("algorithm.kl_type=adaptive", "algorithm.kl_horizon=513",  # beta x (1 - 0.2 x 2560 / 513) > 0
                 "algorithm.use_kl_loss=false")
    load_checked("algorithm.kl_type=adaptive", "algorithm.disable_kl=true")  # no KL at all: nothing to adapt
    load_checked("algorithm.filter_low=0.9", "algorithm.filter_high=0.1")  # unused without online filtering
    # with online filtering a round may generate more prompts than a step keeps (veRL's DAPO recipe: 3x)
    load_checked("algorithm.online_filtering=true", "data.mini_rollout_batch_size=1536")
    load_checked("worker.rollout.top_k=0", "worker.rollout.val_override_config={temperature: 0, top_p: 1.0}")


def test_settings_that_train_on_another_distribution_or_waste_prompts_are_warned_about(caplog):
    """top_p / top_k in training: sampled from the truncated distribution, log-probs of the whole one (the ratios
    off, as in EasyR1); a mini_rollout_batch_size that does not divide rollout_batch_size generates prompts no step
    trains on; a reward length limit (DAPO's overlong penalty) that is not the rollout's; fp16 training. All load
    (EasyR1 runs them) with a warning; the defaults say nothing."""
    import logging

    with caplog.at_level(logging.WARNING, logger="config"):
        load_checked()
        assert not caplog.text
        load_checked("worker.rollout.top_p=0.9", "data.mini_rollout_batch_size=384",
                     "worker.reward.reward_function_kwargs={max_response_length: 20480}")
    assert "worker.rollout.top_p=0.9, top_k=-1: responses are sampled from the truncated distribution" in caplog.text
    assert "data.mini_rollout_batch_size=384 does not divide data.rollout_batch_size=512" in caplog.text
    assert "reward_function_kwargs.max_response_length=20480, data.max_response_length=2048" in caplog.text
    caplog.clear()
    load_checked("worker.actor.fsdp.mp_param_dtype=fp16")  # no GradScaler: small gradients flush to zero
    assert "mp_param_dtype=fp16, torch_dtype=None: fp16 training has no loss scaling here" in caplog.text


def _flat(tree, prefix=""):
    """{dotted key: value} of a config dict; the dict keys (val_override_config, ...) are values."""
    return {k: v for name, value in tree.items() for k, v in (
        _flat(value, f"{prefix}{name}.").items() if f"{prefix}{name}" not in config.KEYS else [(prefix + name, value)])}



@pytest.mark.parametrize("override", ["worker.actor.ppo_epochs=0", "worker.rollout.n=0", "trainer.total_epochs=0",
                                      "trainer.nnodes=0", "trainer.n_gpus_per_node=0", "data.val_batch_size=-2"])
def test_more_counts_below_one_are_config_errors_naming_the_key(override):
    """Zero epochs, responses, nodes or GPUs (0 workers: a division by zero) and val_batch_size -2 fail naming the
    key (reinforce_plus_plus, so that n=0 is not caught as a group estimator's n < 2 first)."""
    key, _, value = override.partition("=")
    with pytest.raises(ConfigError, match=re.escape(f"{key}={value} must be at least 1")):
        load_config(None, ["algorithm.adv_estimator=reinforce_plus_plus", override])


def test_the_edges_of_the_allowed_ranges_load():
    """mini_rollout_batch_size equal to rollout_batch_size (512), val_batch_size -1 (the whole set), one response a
    prompt for estimators without groups; each closed end the messages name: max_grad_norm 0 (no clipping),
    clip_ratio_high 0, a beta of 0, gpu_memory_utilization 1, temperature 1e-5, alpha 0 without a LoRA rank, and
    max_try_make_batch 0 (no limit) below the rounds a step needs."""
    assert load_config(None, ["data.mini_rollout_batch_size=512"]).data.mini_rollout_batch_size == 512
    assert load_config(None, ["data.val_batch_size=-1"]).data.val_batch_size == -1
    assert load_config(None, ["worker.rollout.max_model_len=4096"]).worker.rollout.max_model_len == 4096  # 2048 x 2
    for estimator in ("reinforce_plus_plus", "remax"):
        load_config(None, [f"algorithm.adv_estimator={estimator}", "worker.rollout.n=1"])
    for edge in ("worker.actor.max_grad_norm=0", "worker.actor.clip_ratio_high=0", "worker.actor.optim.betas=[0, 0.9]",
                 "worker.rollout.gpu_memory_utilization=1", "worker.rollout.temperature=1.0e-5",
                 "worker.actor.model.lora.alpha=0"):
        key, _, value = edge.partition("=")
        assert _flat(config.config_to_dict(load_config(None, [edge])))[key] == yaml.safe_load(value), edge
    load_config(None, ["data.mini_rollout_batch_size=128", "trainer.max_try_make_batch=0"])  # 4 rounds, no limit


@pytest.mark.parametrize("estimator", sorted(advantage.ZERO_WHEN_FLAT))  # the estimators with a group baseline
def test_every_group_estimator_needs_two_responses_a_prompt(estimator):
    """grpo, grpo_passk, rloo and reinforce_plus_plus_baseline compare a response with its group: n=1 fails at load,
    not at the first step's advantages after the models load and generate. The list is advantage.py's, so an
    estimator added there and not to config.check_config fails here."""
    with pytest.raises(ConfigError, match=re.escape(f"adv_estimator={estimator} needs groups: worker.rollout.n=1 < 2")):
        load_config(None, [f"algorithm.adv_estimator={estimator}", "worker.rollout.n=1"])


@pytest.mark.parametrize("overrides, message", [
    (["worker.rollout.top_k=-2"], "worker.rollout.n=5 (>= 1), temperature=1.0 (>= 0), top_p=1.0 (in (0, 1]), top_k=-2"),
    (["worker.rollout.val_override_config={top_k: -2}"], "val_override_config.n=5 (>= 1), temperature=1.0 (>= 0), "
                                                          "top_p=1.0 (in (0, 1]), top_k=-2 (-1 or 0: off;"),
    (["worker.rollout.val_override_config={n: true}"], "val_override_config.n=True (>= 1)"),  # a bool is no count
    (["worker.rollout.val_override_config={temperature: true}"], "temperature=True (>= 0)"),
    (["algorithm.gamma=0.99"], "algorithm.gamma must be 1.0"),
    (["worker.actor.optim.betas=0.9"], r"betas=[0.9] must be two numbers in [0, 1)"),  # AdamW's IndexError at setup
    (["worker.actor.optim.betas=[0.9, 1.0]"], r"betas=[0.9, 1.0] must be two"),
    (["worker.actor.ulysses_size=0"], "worker.actor.ulysses_size=0, padding_free=True: only 1 and true are supported"),
    # 4 workers: 2 prompts x 5 = 10 responses an optimizer step do not split, though 4 x 5 = 20 a step would
    (["trainer.n_gpus_per_node=4", "worker.actor.global_batch_size=2", "data.rollout_batch_size=4"],
     "worker.actor.global_batch_size x worker.rollout.n = 10 must be divisible by the 4 workers"),
])
def test_more_values_that_cannot_train_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, overrides)


@pytest.mark.parametrize("override", ["algorithm.kl_penalty=kl", "algorithm.kl_penalty=abs", "algorithm.kl_penalty=mse",
                                      "algorithm.kl_penalty=low_var_kl", "trainer.device=cpu", "trainer.device=cuda",
                                      "worker.actor.optim.strategy=adamw_bf16"])
def test_every_documented_choice_of_a_literal_key_loads(override):
    """The KL estimators EasyR1 documents (kl, abs, mse, low_var_kl), the devices and the optimizers all load."""
    key, _, value = override.partition("=")
    assert _flat(config.config_to_dict(load_config(None, [override])))[key] == value


@pytest.mark.parametrize("override, message", [
    ("worker.rollout.top_k=2.5", "worker.rollout.top_k=2.5 (command line): expected int"),
    ("data.mini_rollout_batch_size=abc", "data.mini_rollout_batch_size='abc' (command line): expected int or null"),
    ("worker.reward.call_timeout=abc", "worker.reward.call_timeout='abc' (command line): expected float or null"),
    ("trainer.device=gpu", "trainer.device='gpu' is not one of ['auto', 'cpu', 'cuda'] (command line)"),
    ("worker.rollout.n", "override 'worker.rollout.n' is not of the form a.b.c=value"),  # no `=`
])
def test_bad_values_of_optional_and_literal_keys_say_what_is_expected(override, message):
    with pytest.raises(ConfigError, match=re.escape(message) + "$"):
        load_config(None, [override])


def test_a_list_key_takes_one_value_or_a_bracketed_list():
    """`trainer.logger=console` is the list [console]; a value in brackets is not wrapped again."""
    assert load_config(None, ["trainer.logger=console"]).trainer.logger == ["console"]
    assert load_config(None, ["worker.actor.optim.betas=[0.8, 0.9]"]).worker.actor.optim.betas == [0.8, 0.9]


def test_a_text_key_given_digits_on_the_command_line_keeps_them_as_written():
    """`trainer.experiment_name=007` named the run 7 (OmegaConf reads 007 as a number, then makes it text)."""
    cfg = load_config(None, ["trainer.experiment_name=007", "data.system_prompt=1e3", "data.prompt_key=true",
                             "data.image_dir=null", "trainer.project_name='0.50'"])
    assert (cfg.trainer.experiment_name, cfg.data.system_prompt, cfg.data.prompt_key) == ("007", "1e3", "true")
    assert cfg.data.image_dir is None and cfg.trainer.project_name == "0.50"


def test_a_file_with_a_list_or_a_value_for_a_section_names_the_file(tmp_path):
    top, section, value = tmp_path / "top.yaml", tmp_path / "section.yaml", tmp_path / "value.yaml"
    top.write_text("- data\n- trainer\n")
    section.write_text("worker:\n  rollout: 5\n")
    value.write_text("5\n")  # was OmegaConf's OSError, a traceback
    for path in (top, value):
        with pytest.raises(ConfigError, match=re.escape(f"{path}: ") + ".*expected a mapping of sections at the top"):
            load_config(str(path))
    with pytest.raises(ConfigError, match=re.escape(f"{section}: ")):
        load_config(str(section))


@pytest.mark.parametrize("override, hint", [
    ("worker.rolout.n=3", " did you mean worker.rollout.n?"),  # a typo in a section's name
    ("worker.actr.optim.lr=1", " did you mean worker.actor.optim.lr?"),  # was worker.actor.tis_cap: the whole key
    ("fsdp_siz=2", " did you mean worker.actor.fsdp.fsdp_size?"),  # by its last part: the actor's, the first key
    ("zzzz=1", ""), ("xq=1", ""), ("foo=1", ""),  # nothing is close: no suggestion (not data.format_prompt)
    ("data.tra=x", " did you mean data.train_files?"),  # close only at ratio 0.64: the cutoff is not higher
    ("kl=0.1", ""),  # at a lower cutoff 'kl' became worker.actor.optim.lr
])
def test_unknown_key_hints_for_a_section_typo_a_bare_name_and_none_for_noise(override, hint):
    with pytest.raises(ConfigError, match=re.escape(f"(command line).{hint}") + "$"):
        load_config(None, [override])


def test_a_config_path_that_exists_is_read_before_the_file_of_that_name_in_configs(tmp_path, monkeypatch):
    """`toy.yaml` in the working directory is that file, not configs/toy.yaml; a missing one falls back there."""
    (tmp_path / "toy.yaml").write_text("trainer:\n  experiment_name: from_the_working_directory\n")
    monkeypatch.chdir(tmp_path)
    assert load_config("toy.yaml").trainer.experiment_name == "from_the_working_directory"
    assert load_config("toy").trainer.experiment_name != "from_the_working_directory"


@pytest.mark.parametrize("override, message", [
    ("worker.rollout.top_p=1.5", "top_p=1.5 (in (0, 1])"),  # vLLM would refuse it at the first generation
    ("worker.actor.clip_ratio_low=-0.1", "clip_ratio_low=-0.1"),  # 1 - (-0.1) would widen the trust region
    ("worker.actor.clip_ratio_low=1.5", "clip_ratio_low=1.5 (in [0, 1])"),  # 1 - 1.5 < 0: the ratio is never clipped
    ("worker.actor.tau_negative=0", "tau_negative=0.0 must be > 0"),  # SAPO's 4 / tau: NaN gradients, all skipped
    ("worker.actor.tau_positive=0", "tau_positive=0.0, tau_negative=1.05 must be > 0"),  # the same for A > 0
    ("worker.actor.tau_negative=-1.05", "tau_negative=-1.05 must be > 0"),  # trains as |tau|, the loss shifted
    ("data.seed=8796093022208", "data.seed=8796093022208 must be below 2**43"),  # 2**43 itself is out
    ("data.seed=-8796093022208", "data.seed=-8796093022208 must be below 2**43 in size"),  # -2**43 x 1_000_003 too
    ("algorithm.kl_coef=-0.5", "algorithm.kl_coef=-0.5, worker"),  # away from the reference
    ("worker.actor.optim.weight_decay=-1", "weight_decay=-1.0"),  # adamw_bf16 would grow the weights
    ("worker.actor.optim.lr_warmup_steps=-1", "lr_warmup_steps=-1 (>= 0; null: the ratio)"),
    ("worker.actor.optim.lr_warmup_ratio=1.5", "lr_warmup_ratio=1.5"),  # lr would reach 0.6 x its peak at the end
    ("worker.actor.optim.min_lr_ratio=2", "min_lr_ratio=2.0 (in [0, 1])"),  # cosine would climb to 2 x the peak
    ("worker.rollout.max_model_len=4095", "max_model_len=4095 is below data.max_prompt_length + max_response_length"),
    ("worker.rollout.gpu_memory_utilization=0", "gpu_memory_utilization=0.0 (in (0, 1])"),  # vLLM: no KV cache
])
def test_values_just_outside_their_range_are_config_errors(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])


def test_top_k_one_warns_a_mini_batch_that_divides_does_not_and_a_list_after_a_space_is_one_list(caplog):
    """top_k=1 samples from a truncated distribution (greedy) as any top_k does, top_k=0 none; mini_rollout_batch_size
    256 of 512 wastes no prompt; a cosine floor loads silently, a floor under the constant schedule is warned of.
    `trainer.logger= [console,file]` (a space after =) is [console, file], not nested."""
    with caplog.at_level(logging.WARNING, logger="config"):
        load_config(None, ["worker.rollout.top_k=1"])
        assert "top_k=1: responses are sampled from the truncated distribution" in caplog.text
        caplog.clear()
        load_config(None, ["data.mini_rollout_batch_size=256", "worker.actor.optim.min_lr_ratio=0.1",
                           "worker.actor.optim.lr_scheduler_type=cosine", "worker.actor.optim.lr_warmup_ratio=1",
                           "worker.rollout.top_k=0"])  # top_k 0 is off, as -1: the whole distribution
        assert not caplog.text
        load_config(None, ["worker.actor.optim.min_lr_ratio=1", "algorithm.kl_coef=0"])  # a floor at the peak
        assert "min_lr_ratio=1.0 does nothing under lr_scheduler_type=constant" in caplog.text
    assert load_config(None, ["trainer.logger= [console,file]"]).trainer.logger == ["console", "file"]


def test_max_try_make_batch_below_the_rounds_a_step_needs_is_a_config_error():
    """A step takes at least ceil(rollout / mini) rounds (exactly that many without online filtering, which
    keeps some groups only); fewer allowed failed step 1 after its rounds."""
    for filtering in ("false", "true"):
        with pytest.raises(ConfigError, match=re.escape("max_try_make_batch=3 is below the 4 generation rounds")):
            load_config(None, ["data.rollout_batch_size=16", "data.mini_rollout_batch_size=4",
                               "trainer.max_try_make_batch=3", "worker.actor.global_batch_size=16",
                               f"algorithm.online_filtering={filtering}"])
    for more in (["trainer.max_try_make_batch=4"], ["trainer.max_try_make_batch=-1"]):
        load_config(None, ["data.rollout_batch_size=16", "data.mini_rollout_batch_size=4",
                           "worker.actor.global_batch_size=16", "trainer.max_try_make_batch=3", *more])
    uneven = ["data.rollout_batch_size=16", "data.mini_rollout_batch_size=5", "worker.actor.global_batch_size=16"]
    with pytest.raises(ConfigError, match=re.escape("max_try_make_batch=3 is below the 4 generation rounds")):
        load_config(None, [*uneven, "trainer.max_try_make_batch=3"])  # 5 + 5 + 5 prompts leave one to a 4th round
    load_config(None, [*uneven, "trainer.max_try_make_batch=4"])


@pytest.mark.parametrize("override, message", [
    ("worker.actor.optim.lr=-1e-6", "worker.actor.optim.lr=-1e-06 must be finite and >= 0"),  # torch's traceback
    ("worker.actor.optim.lr=inf", "worker.actor.optim.lr=inf must be finite"),
    ("worker.actor.optim.lr=nan", "worker.actor.optim.lr=nan: not a number"),
    ("algorithm.kl_coef=nan", "algorithm.kl_coef=nan: not a number"),  # min(nan, ...) < 0 let it through
    ("worker.rollout.temperature=nan", "worker.rollout.temperature=nan"),
    ("worker.actor.max_grad_norm=nan", "worker.actor.max_grad_norm=nan"),
    ("worker.actor.tis_cap=nan", "worker.actor.tis_cap=nan: not a number"),  # Optional[float]: nan <= 0 is false
    ("worker.reward.call_timeout=nan", "worker.reward.call_timeout=nan: not a number"),  # no range check of its own
])
def test_a_negative_or_infinite_lr_and_any_nan_are_config_errors(override, message):
    """These loaded; lr=-1e-3 on the toy died in the worker's setup with torch's 'Invalid learning rate'."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])
    load_config(None, ["worker.actor.optim.lr=0", "worker.reward.call_timeout=null"])


def test_betas_that_are_not_numbers_are_a_config_error_not_a_type_error():
    """betas=[0.9,abc] raised TypeError ('<=' between int and str) out of check_config."""
    with pytest.raises(ConfigError, match=re.escape("betas=[0.9, 'abc'] must be two numbers")):
        load_config(None, ["worker.actor.optim.betas=[0.9,abc]"])


def test_an_fsdp_size_that_does_not_divide_the_workers_is_a_config_error():
    """fsdp_size=3 of 8 GPUs loaded; the workers' init_device_mesh((2, 3)) then fails on 8 ranks."""
    with pytest.raises(ConfigError, match=re.escape("worker.ref.fsdp.fsdp_size=3 must divide the 8 workers")):
        load_config("geo3k", ["worker.ref.fsdp.fsdp_size=3"])
    load_config("geo3k", ["worker.actor.fsdp.fsdp_size=4", "worker.ref.fsdp.fsdp_size=8"])  # 8: all, as -1
    load_config("geo3k", ["worker.actor.fsdp.fsdp_size=16"])  # more than the 8 workers: all of them too (modeling.py)
