"""merge.py: checkpoints written the way the actor writes them (DCP of the model state dict, one rank and
two FSDP2 gloo ranks, full and LoRA) merge into folders that transformers and peft load back exactly.

The references are independent of merge.py: the state dict the checkpoint was saved from, the key names
`save_pretrained` / peft's `save_pretrained` write, and peft's own `merge_and_unload()`.
"""

import json
import os
import shutil
import socket
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

import merge
from conftest import leave_rank

LORA = dict(r=4, lora_alpha=8, target_modules="all-linear", exclude_modules=".*visual.*")


# ---------------------------------------------------------------------------------------------- building checkpoints

def write_hf_dir(base, dst, lora_config=None):
    """actor/huggingface/ as the actor writes it: config, generation config, processor or tokenizer (+ LoraConfig)."""
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer, GenerationConfig

    AutoConfig.from_pretrained(base).save_pretrained(dst)
    GenerationConfig.from_pretrained(base).save_pretrained(dst)
    has_processor = os.path.exists(os.path.join(base, "processor_config.json"))
    (AutoProcessor if has_processor else AutoTokenizer).from_pretrained(base).save_pretrained(dst)
    if lora_config is not None:
        lora_config.save_pretrained(dst)


def perturbed(model, seed):
    """A "trained" model: every weight moved, so a merge that copied the base model's file would fail."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def vl_model(toy):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(toy["vl_model"], dtype=torch.float32)


def lora_model(toy):
    """The toy VL model with a LoRA adapter whose B matrices are nonzero (peft initialises them to 0)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(vl_model(toy), LoraConfig(**LORA))
    model.peft_config["default"].base_model_name_or_path = toy["vl_model"]
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def fsdp_worker(rank, port, jobs):
    """One of two gloo ranks: for each (kind, reference state, checkpoint dir), build the model, load the
    reference weights, fully_shard every decoder layer and the root, dcp.save the sharded state dict."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    for kind, toy, state_path, out in jobs:
        model = lora_model(toy) if kind == "lora" else vl_model(toy)
        model.load_state_dict(torch.load(state_path))
        inner = model.get_base_model() if kind == "lora" else model
        for layer in inner.model.language_model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        dcp.save(get_model_state_dict(model), checkpoint_id=out)
    dist.destroy_process_group()
    leave_rank()


def spawn_two_ranks(worker, *args, timeout=300):
    """worker(rank, port, *args) in two spawned processes; fails the test on an error or after `timeout` s."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.spawn(worker, args=(port, *args), nprocs=2, join=False)
    deadline = time.time() + timeout
    while not context.join(timeout=5):
        if time.time() > deadline:
            for p in context.processes:
                p.kill()
            pytest.fail(f"the two gloo ranks did not finish within {timeout} s")


@pytest.fixture(scope="module")
def ckpts(toy, tmp_path_factory):
    """{"vl", "vl_fsdp", "lora_fsdp": actor dirs; "*_ref": the state dict each was saved from}."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    vl = perturbed(vl_model(toy), seed=2)
    out["vl_ref"] = {k: v.clone() for k, v in vl.state_dict().items()}
    lora = lora_model(toy)
    out["lora_ref"] = {k: v.clone() for k, v in lora.state_dict().items()}
    torch.save(out["vl_ref"], root / "vl_ref.pt")
    torch.save(out["lora_ref"], root / "lora_ref.pt")

    out["vl"] = str(root / "single" / "global_step_1" / "actor")  # one process, plain tensors
    dcp.save(vl.state_dict(), checkpoint_id=os.path.join(out["vl"], "model"), no_dist=True)
    write_hf_dir(toy["vl_model"], os.path.join(out["vl"], "huggingface"))
    (root / "single" / "global_step_1" / "trainer_state.json").write_text("{}")  # the save finished

    out["vl_fsdp"], out["lora_fsdp"] = str(root / "fsdp" / "actor"), str(root / "lora" / "actor")
    spawn_two_ranks(fsdp_worker, [("vl", toy, str(root / "vl_ref.pt"), os.path.join(out["vl_fsdp"], "model")),
                                  ("lora", toy, str(root / "lora_ref.pt"), os.path.join(out["lora_fsdp"], "model"))])
    write_hf_dir(toy["vl_model"], os.path.join(out["vl_fsdp"], "huggingface"))
    write_hf_dir(toy["vl_model"], os.path.join(out["lora_fsdp"], "huggingface"), lora.peft_config["default"])
    return out


def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


# ---------------------------------------------------------------------------------------------- checks

def load_vl(path):
    from transformers import AutoModelForImageTextToText

    model, info = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def vl_inputs(path):
    import random

    import toy as toy_world
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    content = [{"type": "image"}, {"type": "text", "text": "What colour is the square?"}]
    messages = [{"role": "user", "content": content}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    image = toy_world.color_image("red", random.Random(0))
    return processor(text=[text], images=[image], return_tensors="pt")


def greedy(model, inputs):
    with torch.no_grad():
        return model.generate(**inputs, do_sample=False, max_new_tokens=5, min_new_tokens=5)[0].tolist()


def safetensors_contents(folder):
    """{name: tensor} over every .safetensors file in `folder`, and the list of their metadata dicts."""
    from safetensors import safe_open

    tensors, metadata = {}, []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), "pt") as f:
                tensors.update({k: f.get_tensor(k) for k in f.keys()})
                metadata.append(f.metadata())
    return tensors, metadata


def safetensors_keys(folder):
    return set(safetensors_contents(folder)[0])


def assert_same_state(actual, expected, atol=0.0):
    assert actual.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(actual[k], expected[k], atol=atol, rtol=0, msg=k)


# ---------------------------------------------------------------------------------------------- full models

@pytest.mark.slow
def test_two_rank_fsdp_checkpoint_round_trips(toy, ckpts, tmp_path):
    from transformers import AutoProcessor, GenerationConfig

    pieces = merge.read_metadata(os.path.join(ckpts["vl_fsdp"], "model"))
    assert {len(meta.chunks) for meta in pieces.values()} == {2}  # every tensor really is split over the 2 ranks
    out = merge.merge_checkpoint(ckpts["vl_fsdp"], output=str(tmp_path / "hf"))
    assert out == str(tmp_path / "hf") and not os.path.exists(out + ".partial")
    # The names save_pretrained writes (transformers 5: model.language_model.* -> model.*, model.visual.* -> visual.*).
    assert safetensors_keys(out) == safetensors_keys(toy["vl_model"])
    assert os.listdir(out).count("model.safetensors") == 1  # toy < 2 GB: one file, no index
    model = load_vl(out)
    assert_same_state(model.state_dict(), ckpts["vl_ref"])

    original = AutoProcessor.from_pretrained(toy["vl_model"])
    merged = AutoProcessor.from_pretrained(out)
    assert merged.chat_template == original.chat_template
    assert merged.image_processor.to_dict() == original.image_processor.to_dict()
    assert merged.tokenizer.get_vocab() == original.tokenizer.get_vocab()
    inputs, original_inputs = vl_inputs(out), vl_inputs(toy["vl_model"])
    assert inputs.keys() == original_inputs.keys() and all(torch.equal(inputs[k], original_inputs[k]) for k in inputs)
    gen = GenerationConfig.from_pretrained(out)
    assert gen.to_dict() == GenerationConfig.from_pretrained(toy["vl_model"]).to_dict()
    assert gen.eos_token_id == [original.tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    config = json.load(open(os.path.join(out, "config.json")))
    assert config == json.load(open(os.path.join(toy["vl_model"], "config.json")))  # dtype kept: no --dtype given

    reference = vl_model(toy).eval()
    reference.load_state_dict(ckpts["vl_ref"])
    assert greedy(model, inputs) == greedy(reference, inputs)


@pytest.mark.slow
def test_bf16_sharded_output_reads_in_bounded_batches(ckpts, tmp_path, monkeypatch):
    """--dtype bf16 with 20 KB shards: an index, shards within the limit, one bounded DCP read per shard."""
    batches = []
    read = merge.read_tensors

    def spy(model_dir, tensors, keys):
        loaded = read(model_dir, tensors, keys)
        batches.append(sum(t.nbytes for t in loaded.values()))
        return loaded

    monkeypatch.setattr(merge, "read_tensors", spy)
    limit = 20_000
    actor = shutil.copytree(ckpts["vl"], tmp_path / "actor")  # config.json as save_pretrained writes it: sub-configs
    config = json.load(open(actor / "huggingface" / "config.json"))  # carry a dtype too
    config["text_config"]["dtype"] = config["vision_config"]["dtype"] = "float32"
    (actor / "huggingface" / "config.json").write_text(json.dumps(config))
    out = merge.merge_checkpoint(str(actor), output=str(tmp_path / "hf"), dtype="bf16", max_shard_size="20KB")
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == len(batches) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(f for f in os.listdir(out) if f.endswith(".safetensors")) == files
    largest = max(v.numel() for v in ckpts["vl_ref"].values()) * 4
    # Stored fp32, written bf16: a batch holds at most one shard's worth of fp32 (2 x limit), or one big tensor.
    assert max(batches) <= max(2 * limit, largest)
    from safetensors import safe_open
    for f in files:
        with safe_open(os.path.join(out, f), "pt") as st:
            sizes = [st.get_tensor(k).nbytes for k in st.keys()]
        assert sum(sizes) <= limit or len(sizes) == 1
    assert index["metadata"]["total_size"] == sum(v.numel() * 2 for v in ckpts["vl_ref"].values())
    config = json.load(open(os.path.join(out, "config.json")))  # every dtype says bf16
    assert [config["dtype"], config["text_config"]["dtype"], config["vision_config"]["dtype"]] == ["bfloat16"] * 3

    from transformers import AutoModelForImageTextToText
    model = AutoModelForImageTextToText.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    assert_same_state(model.state_dict(), {k: v.to(torch.bfloat16) for k, v in ckpts["vl_ref"].items()})


@pytest.mark.parametrize("tied", [False, True])
def test_text_model_with_and_without_tied_embeddings(toy, tmp_path, tied):
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(toy["text_model"], tie_word_embeddings=tied)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config).float()
    actor = tmp_path / "actor"
    dcp.save(model.state_dict(), checkpoint_id=str(actor / "model"), no_dist=True)
    write_hf_dir(toy["text_model"], str(actor / "huggingface"))
    model.config.save_pretrained(actor / "huggingface")  # the run's config (tie_word_embeddings as trained)

    out = merge.merge_checkpoint(str(actor))
    assert out == str(actor / "merged")
    model.save_pretrained(tmp_path / "reference")  # what transformers itself writes
    assert safetensors_keys(out) == safetensors_keys(tmp_path / "reference")
    assert ("lm_head.weight" in safetensors_keys(out)) == (not tied)
    merged, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert_same_state(merged.state_dict(), model.state_dict())
    assert (merged.lm_head.weight.data_ptr() == merged.model.embed_tokens.weight.data_ptr()) == tied
    eos = GenerationConfig.from_pretrained(toy["text_model"]).eos_token_id
    assert GenerationConfig.from_pretrained(out).eos_token_id == eos and len(eos) == 2
    ids = torch.tensor([[1, 7, 9, 2]])
    assert greedy(merged, {"input_ids": ids}) == greedy(model.eval(), {"input_ids": ids})


def text_checkpoint(toy, actor, stored=torch.float32, config_dtype="float32"):
    """An actor dir of the toy text model: weights stored in `stored`, huggingface/config.json saying `config_dtype`
    (a base model's config: Qwen's say bfloat16 while the actor's fp32 master weights are what it saves)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(toy["text_model"])).to(stored)
    dcp.save(model.state_dict(), checkpoint_id=str(actor / "model"), no_dist=True)
    write_hf_dir(toy["text_model"], str(actor / "huggingface"))
    AutoConfig.from_pretrained(toy["text_model"], dtype=config_dtype).save_pretrained(actor / "huggingface")
    return model


@pytest.mark.parametrize("stored, config_dtype", [(torch.float32, "bfloat16"), (torch.bfloat16, "float32")])
def test_config_dtype_is_the_dtype_written(toy, tmp_path, stored, config_dtype):
    """No --dtype: the stored weights are written, and config.json says their dtype (as save_pretrained does), so
    from_pretrained's default dtype="auto" loads them unchanged (a base config's bfloat16 cast an fp32 run down)."""
    from transformers import AutoModelForCausalLM

    model = text_checkpoint(toy, tmp_path / "actor", stored, config_dtype)
    out = merge.merge_checkpoint(str(tmp_path / "actor"))
    model.save_pretrained(tmp_path / "reference")
    assert json.load(open(os.path.join(out, "config.json")))["dtype"] == str(stored).removeprefix("torch.") == \
        json.load(open(tmp_path / "reference" / "config.json"))["dtype"]
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert merged.dtype == stored
    assert_same_state(merged.state_dict(), model.state_dict())


def test_a_write_protected_checkpoint_merges_into_writable_files(toy, tmp_path):
    """The checkpoint's files and folders made read-only: the output's are the user's to write (copytree copied the
    modes, so a non-root user's merge failed writing into its own read-only folder, leaving it behind) and everyone's
    to read, as save_pretrained's folders are under the usual umask (safetensors writes its files 0600)."""
    import stat

    text_checkpoint(toy, tmp_path / "actor", torch.float32, "float32")
    for root, dirs, files in os.walk(tmp_path / "actor"):
        for name in dirs + files:
            os.chmod(os.path.join(root, name), 0o555 if name in dirs else 0o444)
    out = merge.merge_checkpoint(str(tmp_path / "actor"), output=str(tmp_path / "merged"))
    assert all(os.stat(os.path.join(out, name)).st_mode & stat.S_IWUSR for name in [".", *os.listdir(out)])
    assert all(os.stat(os.path.join(out, name)).st_mode & stat.S_IROTH for name in [".", *os.listdir(out)])


# ---------------------------------------------------------------------------------------------- LoRA

@pytest.mark.slow
def test_lora_adapter_loads_with_peft(toy, ckpts, tmp_path):
    from peft import PeftModel

    out = merge.merge_checkpoint(ckpts["lora_fsdp"])
    assert out == os.path.join(ckpts["lora_fsdp"], "adapter")
    assert {"adapter_model.safetensors", "adapter_config.json", "generation_config.json"} <= set(os.listdir(out))
    assert "config.json" not in os.listdir(out)  # would make the folder look like a full model

    reference = lora_model(toy).eval()
    reference.load_state_dict(ckpts["lora_ref"])
    reference.save_pretrained(tmp_path / "peft_saved")  # peft's own adapter format
    from safetensors.torch import load_file
    assert_same_state(load_file(os.path.join(out, "adapter_model.safetensors")),
                      load_file(tmp_path / "peft_saved" / "adapter_model.safetensors"))
    config = json.load(open(os.path.join(out, "adapter_config.json")))
    assert config["base_model_name_or_path"] == toy["vl_model"] and config["inference_mode"] is True

    loaded = PeftModel.from_pretrained(vl_model(toy), out).eval()
    inputs = vl_inputs(toy["vl_model"])
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, reference(**inputs).logits, atol=0, rtol=0)
        assert not torch.allclose(loaded(**inputs).logits, vl_model(toy)(**inputs).logits)  # the adapter matters
    assert greedy(loaded, inputs) == greedy(reference, inputs)


@pytest.mark.slow
def test_lora_merged_equals_peft_merge_and_unload(toy, ckpts, tmp_path):
    out = merge.merge_checkpoint(ckpts["lora_fsdp"], output=str(tmp_path / "merged"), merge_lora=True)
    assert "adapter_config.json" not in os.listdir(out)
    assert safetensors_keys(out) == safetensors_keys(toy["vl_model"])
    model = load_vl(out)

    reference = lora_model(toy)
    reference.load_state_dict(ckpts["lora_ref"])
    expected = reference.merge_and_unload().eval()
    assert_same_state(model.state_dict(), expected.state_dict(), atol=1e-6)
    changed = [k for k, v in expected.state_dict().items() if not torch.equal(v, vl_model(toy).state_dict()[k])]
    assert changed and all("language_model" in k for k in changed)  # LoRA moved the adapted linears only
    inputs = vl_inputs(out)
    assert greedy(model, inputs) == greedy(expected, inputs)


def test_merge_lora_refuses_an_adapted_tied_head(toy, tmp_path):
    """A tied model with LoRA on lm_head: the merged model would store the embedding in the head's place and drop
    the head's update (logits 28 off peft's merge_and_unload in the review that found it): an error instead."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(toy["text_model"], tie_word_embeddings=True)
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(r=4, lora_alpha=8,
                                                                                target_modules=["q_proj", "lm_head"]))
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "model"), no_dist=True)
    write_hf_dir(toy["text_model"], str(tmp_path / "huggingface"), model.peft_config["default"])
    config.save_pretrained(tmp_path / "huggingface")  # tie_word_embeddings=True
    with pytest.raises(merge.MergeError, match=r"\['lm_head.weight'\] carry LoRA but are tied"):
        merge.merge_checkpoint(str(tmp_path), merge_lora=True)
    assert not os.path.exists(tmp_path / "merged") and not os.path.exists(tmp_path / "merged.partial")


def test_merge_formula_by_hand(tmp_path):
    """W' = W + scale * B @ A (transposed with fan_in_fan_out), scale = alpha / r or alpha / sqrt(r) (rsLoRA)."""
    w, a, b = torch.ones(2, 3), torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[1.0], [-1.0]])
    out = merge.merged_tensor({"w": w, "a": a, "b": b}, "w", ("a", "b", 0.5, False))
    torch.testing.assert_close(out, torch.tensor([[1.5, 2.0, 2.5], [0.5, 0.0, -0.5]]))
    out = merge.merged_tensor({"w": torch.ones(3, 2), "a": a, "b": b}, "w", ("a", "b", 1.0, True))
    torch.testing.assert_close(out, torch.tensor([[2.0, 0.0], [3.0, -1.0], [4.0, -2.0]]))

    prefix = "base_model.model.model.layers.0.mlp.up_proj"
    state = {f"{prefix}.base_layer.weight": torch.zeros(6, 5), f"{prefix}.base_layer.bias": torch.zeros(6),
             f"{prefix}.lora_A.default.weight": torch.zeros(4, 5), f"{prefix}.lora_B.default.weight": torch.zeros(6, 4),
             "base_model.model.model.norm.weight": torch.zeros(5)}
    dcp.save(state, checkpoint_id=str(tmp_path / "m"), no_dist=True)
    tensors = merge.read_metadata(str(tmp_path / "m"))
    plan = merge.lora_plan(tensors, {"lora_alpha": 8})
    assert plan == {"model.layers.0.mlp.up_proj.weight": (f"{prefix}.base_layer.weight", (
                        f"{prefix}.lora_A.default.weight", f"{prefix}.lora_B.default.weight", 2.0, False)),
                    "model.layers.0.mlp.up_proj.bias": (f"{prefix}.base_layer.bias", None),
                    "model.norm.weight": ("base_model.model.model.norm.weight", None)}
    rs = merge.lora_plan(tensors, {"lora_alpha": 8, "use_rslora": True})
    assert rs["model.layers.0.mlp.up_proj.weight"][1][2] == 4.0  # 8 / sqrt(4)


# ---------------------------------------------------------------------------------------------- bad input

@pytest.mark.slow
def test_bad_inputs_give_clear_errors(toy, ckpts, tmp_path):
    with pytest.raises(merge.MergeError, match=r"is not an actor checkpoint.*model/.metadata"):
        merge.merge_checkpoint(str(tmp_path))
    step = os.path.dirname(ckpts["vl"])
    with pytest.raises(merge.MergeError, match="Did you mean --local_dir .*actor"):
        merge.merge_checkpoint(step)
    with pytest.raises(merge.MergeError, match=f"Did you mean --local_dir {ckpts['vl']}\\?"):  # EasyR1's folder
        merge.merge_checkpoint(os.path.join(ckpts["vl"], "huggingface"))
    with pytest.raises(merge.MergeError, match="'int8' cannot be written: choose bf16, fp16 or fp32"):
        merge.merge_checkpoint(ckpts["vl"], output=str(tmp_path / "o"), dtype="int8")
    with pytest.raises(merge.MergeError, match="max_shard_size '2 parsecs'"):
        merge.merge_checkpoint(ckpts["vl"], output=str(tmp_path / "o"), max_shard_size="2 parsecs")
    with pytest.raises(merge.MergeError, match="--merge_lora was given but .*adapter_config.json does not exist"):
        merge.merge_checkpoint(ckpts["vl"], output=str(tmp_path / "o"), merge_lora=True)
    for inside in ("huggingface", "model", "."):
        with pytest.raises(merge.MergeError, match="would overwrite the checkpoint"):
            merge.merge_checkpoint(ckpts["vl"], output=os.path.join(ckpts["vl"], inside), force=True)

    missing = copy_ckpt(ckpts["vl_fsdp"], tmp_path / "missing")
    os.remove(os.path.join(missing, "model", "__1_0.distcp"))
    with pytest.raises(merge.MergeError, match=r"model/__1_0.distcp is missing.*Copy every rank's"):
        merge.merge_checkpoint(missing)
    truncated = copy_ckpt(ckpts["vl_fsdp"], tmp_path / "truncated")
    with open(os.path.join(truncated, "model", "__0_0.distcp"), "r+b") as f:
        f.truncate(100)
    with pytest.raises(merge.MergeError, match=r"__0_0.distcp is truncated"):
        merge.merge_checkpoint(truncated)

    dora = copy_ckpt(ckpts["lora_fsdp"], tmp_path / "dora")
    lora_config = json.load(open(os.path.join(dora, "huggingface", "adapter_config.json")))
    json.dump({**lora_config, "use_dora": True}, open(os.path.join(dora, "huggingface", "adapter_config.json"), "w"))
    with pytest.raises(merge.MergeError, match="handles plain LoRA only"):
        merge.merge_checkpoint(dora, merge_lora=True)

    wrong = copy_ckpt(ckpts["vl"], tmp_path / "wrong")  # a text model's config next to the VL weights
    shutil.copy(os.path.join(toy["text_model"], "config.json"), os.path.join(wrong, "huggingface", "config.json"))
    with pytest.raises(merge.MergeError, match=r"does not match the model of .*missing tensors .*unexpected tensors"):
        merge.merge_checkpoint(wrong)
    assert sorted(os.listdir(wrong)) == ["huggingface", "model"]  # no half-written output left behind

    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "old.txt").write_text("keep me")
    with pytest.raises(merge.MergeError, match="already exists; pass --force"):
        merge.merge_checkpoint(ckpts["vl"], output=str(existing))
    assert (existing / "old.txt").read_text() == "keep me"
    merge.merge_checkpoint(ckpts["vl"], output=str(existing), force=True)
    assert not (existing / "old.txt").exists() and (existing / "model.safetensors").exists()


@pytest.mark.parametrize("length", [0, 50])
def test_unreadable_metadata_is_an_error_naming_it(toy, tmp_path, length):
    """An empty or cut .metadata (a copy that stopped, a full disk): one MergeError naming the file, not pickle's."""
    text_checkpoint(toy, tmp_path / "actor")
    with open(tmp_path / "actor" / "model" / ".metadata", "r+b") as f:
        f.truncate(length)
    with pytest.raises(merge.MergeError, match=r"actor/model/.metadata cannot be read"):
        merge.merge_checkpoint(str(tmp_path / "actor"))
    assert sorted(os.listdir(tmp_path / "actor")) == ["huggingface", "model"]


def test_config_of_other_shapes_is_an_error(toy, tmp_path):
    """huggingface/config.json with the same tensor names but other shapes (here intermediate_size): an error naming
    the tensors, not a folder that from_pretrained then refuses ("size mismatch")."""
    from transformers import AutoConfig

    text_checkpoint(toy, tmp_path / "actor")
    config = AutoConfig.from_pretrained(toy["text_model"], intermediate_size=96)
    config.save_pretrained(tmp_path / "actor" / "huggingface")
    with pytest.raises(merge.MergeError, match=r"does not match the model of .*config.json: .*tensors of another shape "
                                               r"\['model.layers.0.mlp.down_proj.weight'.* \(6\)"):
        merge.merge_checkpoint(str(tmp_path / "actor"))
    assert sorted(os.listdir(tmp_path / "actor")) == ["huggingface", "model"]


def test_force_never_replaces_any_part_of_the_checkpoint(toy, tmp_path):
    """--force replaces an old output, never the optimizer state or extra_state.pt the actor saved next to model/,
    nor the checkpoint reached through a symlinked folder."""
    actor = tmp_path / "real" / "actor"
    text_checkpoint(toy, actor)
    (actor / "optim").mkdir()
    (actor / "optim" / "__0_0.distcp").write_text("optimizer state")
    (actor / "extra_state.pt").write_text("steps")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    for output in (actor / "optim", actor / "optim" / "sub", actor / "extra_state.pt", tmp_path / "link" / "actor",
                   tmp_path / "link" / "actor" / "model"):
        with pytest.raises(merge.MergeError, match="would overwrite the checkpoint"):
            merge.merge_checkpoint(str(actor), output=str(output), force=True)
    assert sorted(os.listdir(actor)) == ["extra_state.pt", "huggingface", "model", "optim"]
    assert (actor / "optim" / "__0_0.distcp").read_text() == "optimizer state"
    assert (actor / "extra_state.pt").read_text() == "steps"


def test_max_shard_size_parsing():
    assert merge.parse_size("2GB") == 2 * 10**9 and merge.parse_size("1.5GiB") == 3 * 2**29
    assert merge.parse_size(" 500 mb ") == merge.parse_size(".5GB") == 5 * 10**8 and merge.parse_size(1000) == 1000
    for bad in ("1.5.GB", ".", "0.1", "0", "-1GB", "2 parsecs", "GB"):
        with pytest.raises(merge.MergeError, match="is not a size such as 2GB"):
            merge.parse_size(bad)


@pytest.mark.slow
def test_cli(ckpts, tmp_path, capsys):
    merge.main(["--local_dir", ckpts["vl"], "--output", str(tmp_path / "cli"), "--dtype", "fp16"])
    assert f"wrote {tmp_path / 'cli'} from " in capsys.readouterr().out
    assert json.load(open(tmp_path / "cli" / "config.json"))["dtype"] == "float16"
    from safetensors import safe_open
    with safe_open(str(tmp_path / "cli" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}
    with pytest.raises(SystemExit) as exit_info:
        merge.main(["--local_dir", ckpts["vl"], "--output", str(tmp_path / "cli")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "merge.py: error:" in err and "already exists; pass --force" in err


# ---------------------------------------------------------------------------------------------- the actor's checkpoints

def actor_samples(model_path):
    """Two prompts (an image one, a text one) x two responses with advantages, as trainer.py hands them to the
    actor: prompt_ids, multi_modal_inputs, position_ids [4, P] (the model's get_rope_index, built on meta)."""
    import random

    import toy as toy_world
    from transformers import AutoConfig, AutoModel, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_path)
    with torch.device("meta"):
        rope_model = AutoModel.from_config(AutoConfig.from_pretrained(model_path))
    samples = []
    for image, content in ((toy_world.color_image("blue", random.Random(1)),
                            [{"type": "image"}, {"type": "text", "text": "What colour is the square?"}]),
                           (None, "What is 3 + 4?")):
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)
        out = processor(text=[text], images=[image] if image else None, return_tensors="pt")
        ids = out["input_ids"][0]  # [P]
        mm = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]} if image else {}
        mrope, _ = rope_model.get_rope_index(
            input_ids=ids[None], mm_token_type_ids=(ids == processor.image_token_id).long()[None],
            image_grid_thw=mm.get("image_grid_thw"), attention_mask=torch.ones_like(ids)[None])  # [3, 1, P]
        for words, advantage in (("blue square", 1.0), ("red", -1.0)):
            end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
            response = processor.tokenizer(words)["input_ids"] + [end]
            samples.append({"prompt_ids": ids.tolist(), "multi_modal_inputs": mm, "response_ids": response,
                            "position_ids": torch.cat([torch.arange(len(ids))[None], mrope[:, 0]]),  # [4, P]
                            "advantage": advantage})
    return samples


def actor_worker(rank, port, model_path, samples_path, root):
    """One of two gloo ranks: for a full and a LoRA actor, one update on this rank's two samples, then
    save_checkpoint(<root>/<kind>/actor); rank 0 keeps named_tensors() (the weights the rollout would get)."""
    import torch.distributed as dist

    import actor
    from config import ActorConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    samples = torch.load(samples_path, weights_only=False)[2 * rank:2 * rank + 2]
    for kind, lora_rank in (("full", 0), ("lora", 4)):
        cfg = ActorConfig()
        cfg.model.model_path, cfg.model.enable_gradient_checkpointing = model_path, False
        cfg.model.lora.rank, cfg.model.lora.alpha = lora_rank, 8
        cfg.fsdp.torch_dtype = cfg.fsdp.mp_param_dtype = "fp32"
        cfg.optim.lr, cfg.global_batch_size, cfg.dynamic_batching = 1e-2, 2, False
        policy = actor.Actor(cfg, role="actor", device="cpu", max_prompt_length=64, max_response_length=8,
                             n_per_prompt=2, training_steps=1)
        for sample, logp in zip(samples, policy.compute_log_probs(samples)):
            sample["old_logprobs"] = logp
        policy.update(samples)
        policy.save_checkpoint(os.path.join(root, kind, "actor"))
        named = {name: tensor.clone() for name, tensor in policy.named_tensors()}
        if rank == 0:
            torch.save(named, os.path.join(root, f"{kind}_named.pt"))
    dist.destroy_process_group()
    leave_rank()


@pytest.mark.slow
def test_actor_checkpoints_merge_to_its_named_tensors(toy, tmp_path):
    from peft import PeftModel

    torch.save(actor_samples(toy["vl_model"]), tmp_path / "samples.pt")
    spawn_two_ranks(actor_worker, toy["vl_model"], str(tmp_path / "samples.pt"), str(tmp_path), timeout=540)
    base = vl_model(toy).state_dict()
    for kind, atol in (("full", 0.0), ("lora", 1e-6)):
        named = torch.load(tmp_path / f"{kind}_named.pt")
        assert [k for k in base if not torch.equal(named[k], base[k])]  # the update moved weights
        model = load_vl(merge.merge_checkpoint(str(tmp_path / kind / "actor"), merge_lora=kind == "lora"))
        assert_same_state(model.state_dict(), named, atol=atol)
    adapter = merge.merge_checkpoint(str(tmp_path / "lora" / "actor"))
    merged_by_peft = PeftModel.from_pretrained(vl_model(toy), adapter).merge_and_unload()
    assert_same_state(merged_by_peft.state_dict(), named, atol=1e-6)
