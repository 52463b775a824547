"""merge.py at the edges: a save cut short, an --output that is a file or symlink, a stale <output>.partial, two
merges into one output, a malformed adapter_config.json, --force replacing an output with no moment where neither
old nor new exists; LoRA merged in fp32 and written in the stored dtype, embedding adapters, dtype names, the index
file, the checks of tensors, plans, shards and sizes. (tests/test_merge.py holds the round trips and the helpers
that build checkpoints.)"""

import json
import os
import pickle
import re
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

import merge
from test_merge import copy_ckpt, safetensors_contents, safetensors_keys, text_checkpoint, write_hf_dir


def test_unfinished_save_is_an_error_naming_what_is_missing(toy, tmp_path):
    """A save cut short: global_step_N/ without trainer_state.json (trainer.py writes it last), or huggingface/ without
    its tokenizer or a VL model's processor. A copied actor/ (no global_step_N parent) needs no trainer_state.json."""
    actor = tmp_path / "run" / "global_step_3" / "actor"
    text_checkpoint(toy, actor)
    with pytest.raises(merge.MergeError, match=r"global_step_3 has no trainer_state.json .*finish; merge it once"):
        merge.merge_checkpoint(str(actor))
    (actor.parent / "trainer_state.json").write_text("{}")
    os.remove(actor / "huggingface" / "tokenizer_config.json")
    for local_dir in (actor, copy_ckpt(actor, tmp_path / "copied" / "actor")):
        with pytest.raises(merge.MergeError, match=rf"{local_dir}/huggingface lacks tokenizer_config.json"):
            merge.merge_checkpoint(str(local_dir))
    shutil.copy(os.path.join(toy["text_model"], "tokenizer_config.json"), tmp_path / "copied" / "actor" / "huggingface")
    assert os.path.exists(merge.merge_checkpoint(str(tmp_path / "copied" / "actor")))
    vl = tmp_path / "vl" / "actor"  # checked before any weight is read: an empty .metadata will do
    write_hf_dir(toy["vl_model"], str(vl / "huggingface"))
    (vl / "model").mkdir()
    (vl / "model" / ".metadata").write_bytes(b"")
    os.remove(vl / "huggingface" / "processor_config.json")
    with pytest.raises(merge.MergeError, match=r"lacks processor_config.json or preprocessor_config.json"):
        merge.merge_checkpoint(str(vl))
    config = vl / "huggingface" / "config.json"
    config.write_text(config.read_text()[:100])  # cut short: was json's JSONDecodeError, a traceback
    with pytest.raises(merge.MergeError, match=rf"{config} cannot be read \(.*\); copy it again"):
        merge.merge_checkpoint(str(vl))
    assert sorted(os.listdir(actor)) == ["huggingface", "model"] and sorted(os.listdir(vl)) == ["huggingface", "model"]


def test_output_that_is_a_file_or_symlink_is_an_error_before_any_work(toy, tmp_path):
    actor = tmp_path / "actor"
    text_checkpoint(toy, actor)
    (tmp_path / "file").write_text("not ours")
    (tmp_path / "target").mkdir()
    (tmp_path / "dir_link").symlink_to(tmp_path / "target")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for output in ("file", "dir_link", "dangling"):
        with pytest.raises(merge.MergeError, match=rf"--output {tmp_path / output} is a file or a symlink"):
            merge.merge_checkpoint(str(actor), output=str(tmp_path / output), force=True)
    assert sorted(os.listdir(tmp_path)) == ["actor", "dangling", "dir_link", "file", "target"]
    assert (tmp_path / "file").read_text() == "not ours" and os.listdir(tmp_path / "target") == []


def test_a_stale_partial_is_removed_with_a_word_and_nothing_else_without_force(toy, tmp_path, monkeypatch, capsys):
    actor = tmp_path / "actor"
    text_checkpoint(toy, actor)
    (tmp_path / "out.partial").mkdir()
    (tmp_path / "out.partial" / "half.safetensors").write_text("an interrupted merge")
    merge.merge_checkpoint(str(actor), output=str(tmp_path / "out"))
    assert f"removing {tmp_path / 'out.partial'}, left by an interrupted merge" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == ["actor", "out"] and "half.safetensors" not in os.listdir(tmp_path / "out")

    named = copy_ckpt(actor, tmp_path / "merged.partial")  # a checkpoint that <output>.partial would be
    with pytest.raises(merge.MergeError, match="would overwrite the checkpoint"):
        merge.merge_checkpoint(named, output=str(tmp_path / "merged"))
    assert sorted(os.listdir(named)) == ["huggingface", "model"]

    write_model = merge.write_model

    def someone_else_writes_the_output(*args):  # after check_output, no --force: never deleted
        (tmp_path / "late").mkdir()
        (tmp_path / "late" / "theirs.txt").write_text("keep me")
        return write_model(*args)

    monkeypatch.setattr(merge, "write_model", someone_else_writes_the_output)
    with pytest.raises(OSError):
        merge.merge_checkpoint(str(actor), output=str(tmp_path / "late"))
    assert os.listdir(tmp_path / "late") == ["theirs.txt"]


def test_a_second_merge_into_an_output_being_written_stops_and_touches_nothing(toy, tmp_path):
    """Both merges wrote <output>.partial/new: the second removed the first's as "left by an interrupted merge", and
    with --force the output mixed the shards of two checkpoints. While a merge holds <output>.lock another one stops
    with an error naming the output; after it, one runs and leaves no lock file behind."""
    import fcntl

    actor = tmp_path / "actor"
    text_checkpoint(toy, actor)
    (tmp_path / "out.partial").mkdir()  # the running merge's work
    with open(tmp_path / "out.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(merge.MergeError, match=f"another merge.py is writing {tmp_path / 'out'}; wait for it"):
            merge.merge_checkpoint(str(actor), output=str(tmp_path / "out"), force=True)
        assert sorted(os.listdir(tmp_path)) == ["actor", "out.lock", "out.partial"]
    shutil.rmtree(tmp_path / "out.partial")
    merge.merge_checkpoint(str(actor), output=str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path)) == ["actor", "out"]


def test_malformed_adapter_config_is_an_error_naming_the_file_and_key(toy, tmp_path):
    """Invalid JSON, or no r / lora_alpha (peft would load its default 8 for either: another scale, no error), also
    in an empty {} (falsy: it was not checked, and merged as an adapter without r and lora_alpha)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(toy["text_model"])),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "model"), no_dist=True)
    write_hf_dir(toy["text_model"], str(tmp_path / "huggingface"), model.peft_config["default"])
    path = tmp_path / "huggingface" / "adapter_config.json"
    good = json.load(open(path))
    without = {key: json.dumps({k: v for k, v in good.items() if k != key}) for key in ("r", "lora_alpha")}
    for text, error in (('{"r": 4,', "JSONDecodeError"), (without["r"], "'r'"),
                        (without["lora_alpha"], "'lora_alpha'"), ("{}", "'r'")):  # {}: no key either
        path.write_text(text)
        for merge_lora in (False, True):
            with pytest.raises(merge.MergeError, match=rf"{path}.*{error}"):
                merge.merge_checkpoint(str(tmp_path), merge_lora=merge_lora)
    assert sorted(os.listdir(tmp_path)) == ["huggingface", "model"]


def test_force_keeps_the_old_output_until_the_new_one_is_in_place(toy, tmp_path, monkeypatch):
    """A crash between the two renames loses nothing: the old output is moved aside, removed after the new one."""
    actor, out = tmp_path / "actor", tmp_path / "out"
    text_checkpoint(toy, actor)
    out.mkdir()
    (out / "old.txt").write_text("keep me")
    replace = os.replace

    def crash_on_the_last_rename(src, dst):
        if str(dst) == str(out):
            raise KeyboardInterrupt
        return replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_the_last_rename)
    with pytest.raises(KeyboardInterrupt):
        merge.merge_checkpoint(str(actor), output=str(out), force=True)
    assert [p.read_text() for p in tmp_path.rglob("old.txt")] == ["keep me"]
    monkeypatch.setattr(os, "replace", replace)
    merge.merge_checkpoint(str(actor), output=str(out), force=True)
    assert sorted(os.listdir(tmp_path)) == ["actor", "out"] and "old.txt" not in os.listdir(out)


# ---------------------------------------------------------------------------------------------- LoRA, dtypes, checks
# (values worked out in each test: a merged W is computed here with plain torch)

def lora_text_checkpoint(toy, actor, dtype=torch.float32, targets=("q_proj", "v_proj"), **lora_kwargs):
    """An actor dir of the toy text model with a LoRA adapter (r=4, alpha=8, B nonzero), stored in `dtype`
    -> the checkpoint's state dict (peft's names)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(5)
    model = get_peft_model(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(toy["text_model"])),
                           LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), **lora_kwargs))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.copy_(torch.randn(p.shape) * 0.3)
    model.to(dtype)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    dcp.save(state, checkpoint_id=str(actor / "model"), no_dist=True)
    write_hf_dir(toy["text_model"], str(actor / "huggingface"), model.peft_config["default"])
    return state


def test_bf16_lora_merges_in_fp32_and_is_written_in_bf16(toy, tmp_path):
    """--merge_lora of a bf16 checkpoint: every adapted W is (W.float() + alpha/r * B.float() @ A.float()).bfloat16(),
    computed here by hand; everything else is written unchanged, in bf16, with safetensors' {"format": "pt"}."""
    state = lora_text_checkpoint(toy, tmp_path / "actor", dtype=torch.bfloat16)
    out = merge.merge_checkpoint(str(tmp_path / "actor"), merge_lora=True)
    written, metadata = safetensors_contents(out)
    assert metadata == [{"format": "pt"}] and json.load(open(os.path.join(out, "config.json")))["dtype"] == "bfloat16"
    expected = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        name = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
        module = key.removesuffix(".base_layer.weight")
        if key.endswith(".base_layer.weight"):
            a, b = state[f"{module}.lora_A.default.weight"].float(), state[f"{module}.lora_B.default.weight"].float()
            value = (value.float() + 2.0 * (b @ a)).to(torch.bfloat16)
        expected[name] = value
    assert len([k for k in state if k.endswith(".base_layer.weight")]) == 4
    assert written.keys() == expected.keys() and all(v.dtype == torch.bfloat16 for v in written.values())
    assert all(torch.equal(written[k], expected[k]) for k in expected)
    # --dtype fp32: the fp32 sum itself, not its bf16 rounding cast up (a small update vanished in it)
    written = safetensors_contents(merge.merge_checkpoint(str(tmp_path / "actor"), str(tmp_path / "fp32"), "fp32",
                                                          merge_lora=True))[0]
    for key in [k for k in state if k.endswith(".base_layer.weight")]:
        module, name = key.removesuffix(".base_layer.weight"), key.removeprefix("base_model.model.").replace(
            ".base_layer.", ".")
        a, b = state[f"{module}.lora_A.default.weight"].float(), state[f"{module}.lora_B.default.weight"].float()
        assert torch.equal(written[name], state[key].float() + 2.0 * (b @ a)), name


def test_adapter_keys_of_an_embedding_lora_and_its_dtype(toy, tmp_path):
    """The adapter folder names every LoRA tensor as peft saves it: the adapter name dropped, also from
    lora_embedding_A/B (no ".weight"); --dtype bf16 casts them; the shard carries {"format": "pt"}."""
    state = lora_text_checkpoint(toy, tmp_path / "actor", targets=("q_proj", "embed_tokens"))
    out = merge.merge_checkpoint(str(tmp_path / "actor"), dtype="bf16")
    written, metadata = safetensors_contents(out)
    expected = {k.replace(".default", ""): v for k, v in state.items() if ".lora_" in k}
    assert "base_model.model.model.embed_tokens.lora_embedding_A" in expected and metadata == [{"format": "pt"}]
    assert written.keys() == expected.keys()
    assert all(written[k].dtype == torch.bfloat16 and torch.equal(written[k], expected[k].bfloat16()) for k in expected)


def test_an_embedding_only_lora_gives_its_adapter(toy, tmp_path):
    """lora.target_modules=embed_tokens alone: peft's lora_embedding_A/B (no ".weight") name the adapter too."""
    state = lora_text_checkpoint(toy, tmp_path / "actor", targets=("embed_tokens",))
    written, _ = safetensors_contents(merge.merge_checkpoint(str(tmp_path / "actor")))
    assert sorted(written) == sorted(k.replace(".default", "") for k in state if ".lora_" in k) != []


def test_dtype_names_are_case_insensitive_and_accept_torch_dtypes(toy, tmp_path):
    """--dtype BF16 and dtype=torch.float16 are accepted like bf16 and fp16; fp32 writes float32."""
    model = text_checkpoint(toy, tmp_path / "actor", stored=torch.bfloat16)
    for dtype, expected in (("BF16", torch.bfloat16), (torch.float16, torch.float16), ("fp32", torch.float32)):
        out = merge.merge_checkpoint(str(tmp_path / "actor"), output=str(tmp_path / str(expected)), dtype=dtype)
        assert json.load(open(os.path.join(out, "config.json")))["dtype"] == str(expected).removeprefix("torch.")
        written, _ = safetensors_contents(out)
        assert all(written[k].dtype == expected and torch.equal(written[k], v.to(expected))
                   for k, v in model.state_dict().items())


def test_weight_files_in_huggingface_are_never_copied(toy, tmp_path):
    """Stale weights in huggingface/ (a base model's, a .bin) never reach the output, sharded or not."""
    text_checkpoint(toy, tmp_path / "actor")
    hf = tmp_path / "actor" / "huggingface"
    for name in ("model.safetensors", "model-00001-of-00009.safetensors", "model.safetensors.index.json",
                 "pytorch_model.bin", "stale.pt", "old.pth"):
        (hf / name).write_text("stale")
    whole = merge.merge_checkpoint(str(tmp_path / "actor"))
    assert sorted(f for f in os.listdir(whole) if "model" in f or f.endswith((".pt", ".pth"))) == ["model.safetensors"]
    sharded = merge.merge_checkpoint(str(tmp_path / "actor"), output=str(tmp_path / "sharded"), max_shard_size="30KB")
    index = json.load(open(os.path.join(sharded, "model.safetensors.index.json")))
    files = sorted(f for f in os.listdir(sharded) if f.endswith((".safetensors", ".bin", ".pt", ".pth")))
    assert files == sorted(set(index["weight_map"].values())) and "model-00001-of-00009.safetensors" not in files


def test_vl_index_names_the_saved_keys_and_one_file_has_no_index(toy, tmp_path):
    """A sharded VL output: the index maps exactly the names written in the shards (model.language_model.* renamed
    as save_pretrained renames them), each to the file holding it; an unsharded output has no index."""
    from transformers import AutoModelForImageTextToText

    actor = tmp_path / "actor"
    model = AutoModelForImageTextToText.from_pretrained(toy["vl_model"], dtype=torch.float32)
    dcp.save(model.state_dict(), checkpoint_id=str(actor / "model"), no_dist=True)
    write_hf_dir(toy["vl_model"], str(actor / "huggingface"))
    out = merge.merge_checkpoint(str(actor), max_shard_size="40KB")
    weight_map = json.load(open(os.path.join(out, "model.safetensors.index.json")))["weight_map"]
    assert weight_map.keys() == safetensors_keys(toy["vl_model"]) and len(set(weight_map.values())) > 2
    from safetensors import safe_open
    for file in set(weight_map.values()):
        with safe_open(os.path.join(out, file), "pt") as f:
            assert set(f.keys()) == {k for k, v in weight_map.items() if v == file}
    one = merge.merge_checkpoint(str(actor), output=str(tmp_path / "one"))
    assert sorted(f for f in os.listdir(one) if f.startswith("model")) == ["model.safetensors"]


def test_missing_or_unexpected_tensors_are_each_an_error(toy, tmp_path):
    """A checkpoint lacking one tensor, or holding one the model does not have: a MergeError naming it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    state = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(toy["text_model"])).state_dict()
    for kind, changed in (("missing", {k: v for k, v in state.items() if k != "model.norm.weight"}),
                          ("unexpected", {**state, "model.extra.weight": torch.zeros(3)})):
        actor = tmp_path / kind / "actor"
        dcp.save(changed, checkpoint_id=str(actor / "model"), no_dist=True)
        write_hf_dir(toy["text_model"], str(actor / "huggingface"))
        name = "model.norm.weight" if kind == "missing" else "model.extra.weight"
        with pytest.raises(merge.MergeError, match=rf"{kind} tensors \['{name}'\] \(1\)"):
            merge.merge_checkpoint(str(actor))
        assert sorted(os.listdir(actor)) == ["huggingface", "model"]


def test_an_interrupt_while_writing_leaves_no_partial(toy, tmp_path, monkeypatch):
    """Ctrl-C (KeyboardInterrupt, not an Exception) during the write removes <output>.partial."""
    text_checkpoint(toy, tmp_path / "actor")

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(merge, "write_model", interrupted)
    with pytest.raises(KeyboardInterrupt):
        merge.merge_checkpoint(str(tmp_path / "actor"), output=str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path)) == ["actor"]


def test_lora_plan_refuses_what_it_cannot_merge(tmp_path):
    """A peft tensor other than lora_A/B (DoRA's magnitude), an A without its B, two adapters, a 4-d (conv) pair:
    each a MergeError; fan_in_fan_out from the config reaches the plan."""
    prefix = "base_model.model.model.layers.0.mlp.up_proj"
    base = {f"{prefix}.base_layer.weight": torch.zeros(6, 5), f"{prefix}.lora_A.default.weight": torch.zeros(4, 5),
            f"{prefix}.lora_B.default.weight": torch.zeros(6, 4)}
    cases = (({f"{prefix}.lora_magnitude_vector.default.weight": torch.zeros(6)}, "cannot merge the peft tensor"),
             ({f"{prefix}.lora_B.default.weight": None}, r"has no 2-d .*lora_A.default.weight / .*lora_B"),
             ({f"{prefix}.lora_A.other.weight": torch.zeros(4, 5)}, r"one adapter .*, found \['default', 'other'\]"),
             ({f"{prefix}.lora_A.default.weight": torch.zeros(4, 5, 1, 1),  # a conv's LoRA: 4-d A and B
               f"{prefix}.lora_B.default.weight": torch.zeros(6, 4, 1, 1)}, r"has no 2-d .*lora_A"))
    for i, (change, error) in enumerate(cases):
        state = {k: v for k, v in {**base, **change}.items() if v is not None}
        dcp.save(state, checkpoint_id=str(tmp_path / str(i)), no_dist=True)
        with pytest.raises(merge.MergeError, match=error):
            merge.lora_plan(merge.read_metadata(str(tmp_path / str(i))), {"lora_alpha": 8})
    dcp.save(base, checkpoint_id=str(tmp_path / "ok"), no_dist=True)
    plan = merge.lora_plan(merge.read_metadata(str(tmp_path / "ok")), {"lora_alpha": 8, "fan_in_fan_out": True})
    assert plan["model.layers.0.mlp.up_proj.weight"][1][2:] == (2.0, True)


def test_alpha_pattern_or_modules_to_save_is_refused(toy, tmp_path):
    """adapter_config.json with alpha_pattern or modules_to_save: merge.py would merge them wrongly, so an error."""
    text_checkpoint(toy, tmp_path / "actor")
    path = tmp_path / "actor" / "huggingface" / "adapter_config.json"
    for extra in ({"alpha_pattern": {"q_proj": 16}}, {"modules_to_save": ["lm_head"]}):
        path.write_text(json.dumps({"r": 4, "lora_alpha": 8, **extra}))
        for merge_lora in (False, True):
            with pytest.raises(merge.MergeError, match="handles plain LoRA only"):
                merge.merge_checkpoint(str(tmp_path / "actor"), merge_lora=merge_lora)


def test_multi_digit_step_and_a_sibling_output_named_like_a_prefix(toy, tmp_path):
    """global_step_12/ without trainer_state.json is unfinished too; --output <dir>/act next to <dir>/actor (a
    prefix of its name, not a folder above it) is allowed."""
    actor = tmp_path / "run" / "global_step_12" / "actor"
    text_checkpoint(toy, actor)
    with pytest.raises(merge.MergeError, match="global_step_12 has no trainer_state.json"):
        merge.merge_checkpoint(str(actor))
    (actor.parent / "trainer_state.json").write_text("{}")
    assert merge.merge_checkpoint(str(actor), output=str(actor.parent / "act")) == str(actor.parent / "act")


def test_a_distcp_cut_by_one_byte_and_non_tensor_entries_are_errors(toy, tmp_path):
    """A .distcp one byte short of what .metadata needs is truncated; a checkpoint of more than tensors is refused."""
    text_checkpoint(toy, tmp_path / "actor")
    path = tmp_path / "actor" / "model" / "__0_0.distcp"
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1)
    with pytest.raises(merge.MergeError, match="__0_0.distcp is truncated"):
        merge.merge_checkpoint(str(tmp_path / "actor"))
    dcp.save({"w": torch.zeros(2), "step": 3}, checkpoint_id=str(tmp_path / "mixed"), no_dist=True)
    with pytest.raises(merge.MergeError, match=r"non-tensor entries \['step'\]"):
        merge.read_metadata(str(tmp_path / "mixed"))


def test_each_distcp_is_checked_against_its_largest_end_whatever_the_metadata_order(tmp_path):
    """Tensors a (8 floats) and b (2) in one file, cut short of its last item: truncated, also when .metadata lists
    that file's items in another order than their offsets (the end checked is each file's largest, not its last
    listed)."""
    dcp.save({"a": torch.zeros(8), "b": torch.ones(2)}, checkpoint_id=str(tmp_path), no_dist=True)
    metadata = pickle.load(open(tmp_path / ".metadata", "rb"))
    infos = sorted(metadata.storage_data.items(), key=lambda item: item[1].offset, reverse=True)  # the last first
    assert len({info.relative_path for _, info in infos}) == 1 and len(infos) == 2
    metadata.storage_data = dict(infos)
    pickle.dump(metadata, open(tmp_path / ".metadata", "wb"))
    path = tmp_path / infos[0][1].relative_path
    with open(path, "r+b") as f:
        f.truncate(infos[0][1].offset + infos[0][1].length - 1)  # past the first item's end, one byte short of the last
    with pytest.raises(merge.MergeError, match=rf"{infos[0][1].relative_path} is truncated"):
        merge.read_metadata(str(tmp_path))


def test_the_written_models_dtype_is_its_first_floating_tensors(tmp_path, monkeypatch):
    """write_model returns save_pretrained's model.dtype for config.json: the first floating tensor's (bf16 here),
    past an integer buffer stored first, which is written as it is; --dtype fp16 gives fp16."""
    state = {"counts": torch.arange(4), "w": torch.ones(3, 2, dtype=torch.bfloat16)}
    dcp.save(state, checkpoint_id=str(tmp_path / "model"), no_dist=True)
    names = ({name: [name] for name in state}, set(), {name: t.shape for name, t in state.items()}, None)
    monkeypatch.setattr(merge, "hf_names", lambda hf_dir: names)  # a model whose state dict starts with an int
    monkeypatch.setattr(merge, "revert_weight_conversion", lambda model, tensors: tensors)  # saved as named
    tensors = merge.read_metadata(str(tmp_path / "model"))
    for dtype, expected in ((None, torch.bfloat16), (torch.float16, torch.float16)):
        (out := tmp_path / str(dtype)).mkdir()
        assert merge.write_model(str(tmp_path / "model"), tensors, None, None, str(out), dtype, 10**9) == expected
        written, _ = safetensors_contents(str(out))
        assert written["counts"].dtype == torch.int64 and written["counts"].tolist() == [0, 1, 2, 3]
        assert written["w"].dtype == expected


def test_a_lora_config_beside_a_full_models_weights_is_an_error_naming_no_adapter(toy, tmp_path):
    """huggingface/adapter_config.json with a checkpoint that holds no LoRA tensor (the files of two runs mixed):
    a MergeError saying no adapter was found, with and without --merge_lora, and nothing written."""
    text_checkpoint(toy, tmp_path / "actor")
    (tmp_path / "actor" / "huggingface" / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    for merge_lora in (False, True):
        with pytest.raises(merge.MergeError, match="expected the LoRA tensors of one adapter in the checkpoint, "
                                                   "found none"):
            merge.merge_checkpoint(str(tmp_path / "actor"), merge_lora=merge_lora)
    assert sorted(os.listdir(tmp_path / "actor")) == ["huggingface", "model"]


def test_cast_and_size_units_by_hand():
    """cast leaves integer tensors alone; KB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024."""
    ints = torch.arange(3)
    assert merge.cast(ints, torch.bfloat16).dtype == torch.int64
    assert merge.cast(ints, torch.float16).tolist() == [0, 1, 2]
    sizes = {"3B": 3, "1KB": 1000, "1KiB": 1024, "2MB": 2 * 10**6, "2MiB": 2 * 2**20, "1GiB": 2**30, "1 kib": 1024}
    assert {size: merge.parse_size(size) for size in sizes} == sizes


def test_a_missing_folder_or_a_run_folder_is_said_as_such(tmp_path):
    """A wrong path says the folder does not exist; the run folder lists its checkpoints (only the format was named),
    its own even where its name holds glob characters (run[2] listed run2's), in step order (10 came before 2)."""
    with pytest.raises(merge.MergeError, match="does not exist. Pass .*global_step_N/actor. The folder does not exist"):
        merge.merge_checkpoint(str(tmp_path / "nowhere"))
    for step in (2, 10):
        os.makedirs(tmp_path / f"global_step_{step}" / "actor" / "model")
        (tmp_path / f"global_step_{step}" / "actor" / "model" / ".metadata").write_bytes(b"")
    with pytest.raises(merge.MergeError, match=re.escape("It holds global_step_2/actor, global_step_10/actor.")):
        merge.merge_checkpoint(str(tmp_path))
    os.makedirs(tmp_path / "run2" / "global_step_1" / "actor" / "model")
    (tmp_path / "run2" / "global_step_1" / "actor" / "model" / ".metadata").write_bytes(b"")
    (tmp_path / "run[2]").mkdir()  # a name with glob characters: its own checkpoints (none), not run2's
    with pytest.raises(merge.MergeError, match=r"global_step_N/actor\.$"):
        merge.merge_checkpoint(str(tmp_path / "run[2]"))


def test_a_mixture_of_experts_merges_into_what_save_pretrained_writes(toy, tmp_path):
    """transformers keeps a mixture's experts fused in memory ([experts, 2 x inner, hidden]) and splits them on save,
    one tensor per expert: the merged folder holds save_pretrained's tensors, names and values, in several shards
    with an index (before: a RuntimeError from transformers' conversion of empty probes)."""
    from safetensors.torch import load_file
    from test_actor_families import tiny_text_family

    model = tiny_text_family("qwen3_moe", str(tmp_path / "reference"), num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=32)
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "actor" / "model"), no_dist=True)
    write_hf_dir(toy["text_model"], str(tmp_path / "actor" / "huggingface"))
    model.config.save_pretrained(tmp_path / "actor" / "huggingface")
    out = merge.merge_checkpoint(str(tmp_path / "actor"), max_shard_size="100KB")
    expected = load_file(tmp_path / "reference" / "model.safetensors")
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))["weight_map"]
    got = {k: v for f in set(index.values()) for k, v in load_file(os.path.join(out, f)).items()}
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in got and got.keys() == expected.keys() == index.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_an_output_that_cannot_be_written_is_an_error_naming_it(toy, tmp_path):
    """The default output lies inside the checkpoint: a read-only checkpoint (an archive, a shared store) ended the
    merge with a PermissionError traceback from opening <output>.lock; now one line naming the output and
    --output. Root ignores modes, so a folder under a file stands in for it where the tests run as root."""
    actor = tmp_path / "actor"
    text_checkpoint(toy, actor)
    (tmp_path / "file").write_text("")
    outputs = [tmp_path / "file" / "merged"]
    if os.geteuid() != 0:
        os.chmod(actor, 0o555)
        outputs.append(actor / "merged")
    for output in outputs:
        with pytest.raises(merge.MergeError, match=rf"cannot write {output}: .*choose a writable folder with --output"):
            merge.merge_checkpoint(str(actor), output=None if output.parent == actor else str(output))
    os.chmod(actor, 0o755)
    assert sorted(os.listdir(actor)) == ["huggingface", "model"]


def test_a_tokenizer_that_does_not_load_is_an_error_before_any_work(toy, tmp_path):
    """huggingface/ without tokenizer.json (a copy cut short) merged with exit 0: a VL model's processor
    then failed to load at serving time ('Couldn't instantiate the backend tokenizer'), a text model's tokenizer
    loaded with no vocabulary and encoded every text to no tokens. Now an error naming the folder, before any weight
    is read."""
    actor, vl = tmp_path / "text" / "actor", tmp_path / "vl" / "actor"
    text_checkpoint(toy, actor)
    write_hf_dir(toy["vl_model"], str(vl / "huggingface"))
    (vl / "model").mkdir()
    (vl / "model" / ".metadata").write_bytes(b"")
    for local_dir in (actor, vl):
        os.remove(local_dir / "huggingface" / "tokenizer.json")
        with pytest.raises(merge.MergeError, match=rf"{local_dir}/huggingface: the tokenizer does not load.* or has no "
                                                   "vocabulary; copy its files from the base model"):
            merge.merge_checkpoint(str(local_dir))
        assert sorted(os.listdir(local_dir)) == ["huggingface", "model"]


def test_force_never_replaces_a_folder_holding_checkpoints(toy, tmp_path):
    """--output <a run folder> --force deleted that run, its checkpoints and tracker included, with exit 0;
    --force replaces an earlier merge's output, never another checkpoint or a run folder."""
    actor = tmp_path / "actor"
    text_checkpoint(toy, actor)
    run = tmp_path / "run"
    copy_ckpt(actor, run / "global_step_1" / "actor")
    (run / "checkpoint_tracker.json").write_text('{"last_global_step": 1}')
    other = copy_ckpt(actor, tmp_path / "other" / "actor")
    for output in (run, other):
        with pytest.raises(merge.MergeError, match=rf"--force would delete {output}, which holds training checkpoints"):
            merge.merge_checkpoint(str(actor), output=str(output), force=True)
    assert sorted(os.listdir(run)) == ["checkpoint_tracker.json", "global_step_1"]
    assert sorted(os.listdir(other)) == ["huggingface", "model"]
    out = merge.merge_checkpoint(str(actor), output=str(tmp_path / "merged"))
    assert merge.merge_checkpoint(str(actor), output=out, force=True) == out  # an earlier output: replaced


def test_a_config_naming_no_transformers_class_or_a_save_that_fuses_tensors_is_an_error(toy, tmp_path, monkeypatch):
    """The model is built from config.json's architectures: a name transformers lacks, or none, is a MergeError
    naming the file; a model whose save fuses several of its tensors into one (a conversion op that merge.py, writing
    tensor by tensor, cannot apply; stand-in: each layer's q_proj and k_proj saved as one qk_proj) is refused too.
    Nothing is written."""
    text_checkpoint(toy, tmp_path / "actor")
    config_path = tmp_path / "actor" / "huggingface" / "config.json"
    config = json.loads(config_path.read_text())
    for architectures, said in ((["NoSuchModelForCausalLM"], "['NoSuchModelForCausalLM']"), (None, "None")):
        config_path.write_text(json.dumps({**config, "architectures": architectures}))
        with pytest.raises(merge.MergeError, match=re.escape(f"{config_path}: architectures={said} names no "
                                                             "transformers class")):
            merge.merge_checkpoint(str(tmp_path / "actor"))
    config_path.write_text(json.dumps(config))
    save = merge.revert_weight_conversion

    def fusing(model, tensors):
        out = dict(save(model, tensors))
        for q in [name for name in out if ".q_proj." in name and name.replace(".q_proj.", ".k_proj.") in out]:
            k = q.replace(".q_proj.", ".k_proj.")
            out[q.replace(".q_proj.", ".qk_proj.")] = torch.cat([out.pop(q), out.pop(k)])
        return out

    monkeypatch.setattr(merge, "revert_weight_conversion", fusing)
    with pytest.raises(merge.MergeError, match=r"^Qwen2ForCausalLM saves tensors fused from several of its own"):
        merge.merge_checkpoint(str(tmp_path / "actor"))
    assert sorted(os.listdir(tmp_path / "actor")) == ["huggingface", "model"]


def test_an_output_of_exactly_two_shards_has_the_index_save_pretrained_writes(toy, tmp_path):
    """The toy text model holds 382,720 bytes in fp32 (embedding and head 167 x 64 each, two layers of 148,480, the
    final norm 256), so shards of at most 200 KB make two: the files and the index's weight map are save_pretrained's,
    and the index's total size is that sum."""
    model = text_checkpoint(toy, tmp_path / "actor")
    out = merge.merge_checkpoint(str(tmp_path / "actor"), max_shard_size="200KB")
    model.save_pretrained(tmp_path / "reference", max_shard_size="200KB")
    files = [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)] + ["model.safetensors.index.json"]
    for folder in (out, tmp_path / "reference"):
        assert sorted(f for f in os.listdir(folder) if f.startswith("model")) == files, folder
    index, reference = (json.load(open(os.path.join(folder, files[2]))) for folder in (out, tmp_path / "reference"))
    assert index["weight_map"] == reference["weight_map"] and index["metadata"]["total_size"] == 382_720
    assert set(index["weight_map"].values()) == set(files[:2])
