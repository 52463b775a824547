"""merge.py at the edges: a save cut short, an --output that is a file or symlink, a stale <output>.partial, a
malformed adapter_config.json, and --force replacing an output with no moment where neither old nor new exists.
(tests/test_merge.py holds the round trips and the helpers that build checkpoints.)"""

import json
import os
import shutil

import pytest
import torch.distributed.checkpoint as dcp

import merge
from test_merge import copy_ckpt, text_checkpoint, write_hf_dir


def test_unfinished_save_is_an_error_naming_what_is_missing(toy, tmp_path):
    """A save cut short: global_step_N/ without trainer_state.json (trainer.py writes it last), or huggingface/ without
    its tokenizer or a VL model's processor. A copied actor/ (no global_step_N parent) needs no trainer_state.json."""
    actor = tmp_path / "run" / "global_step_3" / "actor"
    text_checkpoint(toy, actor)
    with pytest.raises(merge.MergeError, match=r"global_step_3 has no trainer_state.json .*its save did not finish"):
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


def test_malformed_adapter_config_is_an_error_naming_the_file_and_key(toy, tmp_path):
    """Invalid JSON, or no r / lora_alpha (peft would load its default 8 for either: another scale, no error)."""
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
                        (without["lora_alpha"], "'lora_alpha'")):
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
