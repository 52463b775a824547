"""merge.py: a training checkpoint -> a Hugging Face folder that `from_pretrained` and vLLM load directly.

    python merge.py --local_dir checkpoints/<project>/<exp>/global_step_N/actor
    python merge.py --local_dir ... --merge_lora      # LoRA run: the merged full model, not the adapter

Reads, never modifies, what actor.Actor.save_checkpoint writes: <local_dir>/model/ (the torch.distributed.checkpoint
of the model state dict, peft's names for LoRA, from any number of ranks) and <local_dir>/huggingface/ (config,
tokenizer, processor, chat template; adapter_config.json for LoRA). Writes <output> (default <local_dir>/merged, or
<local_dir>/adapter for LoRA without --merge_lora) through <output>.partial, renamed at the end (<output>.lock, held
meanwhile, stops a second merge into the same output):
  full model    safetensors shards with save_pretrained's names and tensors (Qwen2.5-VL model.language_model.layers.*
                -> model.layers.*; a mixture's fused experts split one per expert; a tied lm_head left out), cut
                where it cuts them (a mixture's: elsewhere, planned over the fused tensors), the huggingface/ files
                (config.json's "dtype": as written)
  LoRA adapter  adapter_model.safetensors (peft's saved names), adapter_config.json (inference_mode true) and the
                tokenizer/processor files
  --merge_lora  the full model with W <- W + scale * B @ A for every adapted linear (merged_tensor)
Peak memory: one output shard (about max_shard_size x stored / written bytes, or the largest tensor); the model is
built on the meta device only.
"""

import argparse
import fcntl
import glob
import json
import math
import os
import pathlib
import re
import shutil
import warnings

import torch
import torch.distributed.checkpoint as dcp
import transformers
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file
from transformers.core_model_loading import revert_weight_conversion

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.pt", "*.pth")  # never copied from huggingface/


class MergeError(ValueError):
    """Bad input: the message says what is wrong, where, and what to do."""  # the CLI prints it, exit code 2


def merge_checkpoint(local_dir, output=None, dtype=None, merge_lora=False, force=False, max_shard_size="2GB"):
    """Merge the actor checkpoint in `local_dir` into a Hugging Face folder; returns the output path.
    dtype: None keeps each tensor's stored dtype; "bf16" | "fp16" | "fp32" casts every floating tensor."""
    model_dir, hf_dir = check_checkpoint(local_dir := os.path.abspath(local_dir))
    if dtype is not None and str(dtype).lower().removeprefix("torch.") not in DTYPES:
        raise MergeError(f"dtype {dtype!r} cannot be written: choose bf16, fp16 or fp32 (None keeps the stored dtype)")
    dtype, max_bytes = dtype and DTYPES[str(dtype).lower().removeprefix("torch.")], parse_size(max_shard_size)
    lora_path = os.path.join(hf_dir, "adapter_config.json")
    try:  # r and lora_alpha are required: peft would default either to 8, silently another scale
        lora = json.load(open(lora_path)) if os.path.exists(lora_path) else None
        lora is not None and [lora[key] for key in ("r", "lora_alpha")]  # a KeyError naming the missing one ({} too)
    except (ValueError, KeyError, TypeError) as e:  # json.JSONDecodeError is a ValueError
        raise MergeError(f"{lora_path} cannot be read as a LoRA config: {e!r}; copy it again from the run") from None
    if merge_lora and lora is None:
        raise MergeError(f"--merge_lora was given but {lora_path} does not exist: merge this full model without it")
    if lora and (lora.get("use_dora") or lora.get("alpha_pattern") or lora.get("modules_to_save")):
        raise MergeError(f"{lora_path}: merge.py handles plain LoRA only (no use_dora, alpha_pattern or "
                         f"modules_to_save); load the checkpoint into the peft model and use peft's save/merge instead")
    adapter_only = lora is not None and not merge_lora
    output = os.path.abspath(output or os.path.join(local_dir, "adapter" if adapter_only else "merged"))
    check_output(output, local_dir, force)
    try:
        os.makedirs(os.path.dirname(output), exist_ok=True)
        lock = open(output + ".lock", "w")  # held until this merge ends (a crash too: the OS lets it go)
    except OSError as e:  # a read-only checkpoint (the default output is inside it), no permission, a full disk
        raise MergeError(f"cannot write {output}: {e.strerror}; choose a writable folder with --output") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise MergeError(f"another merge.py is writing {output}; wait for it, or choose another --output") from None
    try:
        check_output(output, local_dir, force)  # again: the other merge may have just written it
        tensors = read_metadata(model_dir)
        partial, work = output + ".partial", output + ".partial/new"  # work is renamed to output at the end
        if os.path.lexists(partial):  # a crash leaves no half-written output, only <output>.partial
            print(f"merge.py: removing {partial}, left by an interrupted merge")
            shutil.rmtree(partial)
        skip = ["adapter_config.json", *WEIGHT_FILES, *(["config.json"] if adapter_only else [])]
        # tokenizer, processor, ...: contents only, so a write-protected checkpoint gives a writable output
        shutil.copytree(hf_dir, work, ignore=shutil.ignore_patterns(*skip), copy_function=shutil.copyfile)
        os.chmod(work, 0o755)
        try:
            if adapter_only:
                write_adapter(model_dir, tensors, lora, work, dtype)
            else:  # config.json gets the dtype written, not the base model's: from_pretrained(dtype="auto") keeps it
                dtype = write_model(model_dir, tensors, hf_dir, lora, work, dtype, max_bytes)
                config = json.load(open(os.path.join(work, "config.json")))
                for part in [config, *(v for v in config.values() if isinstance(v, dict) and "dtype" in v)]:
                    part["dtype"] = str(dtype).removeprefix("torch.")  # a VL model's text and vision configs too
                pathlib.Path(work, "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
            for path in pathlib.Path(work).iterdir():  # world-readable, as save_pretrained's (safetensors: 0600)
                path.chmod(0o755 if path.is_dir() else 0o644)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        if force and os.path.isdir(output):  # aside until the new output is in place: a crash in between loses nothing
            os.replace(output, os.path.join(partial, "old"))
        os.replace(work, output)  # without --force, an output made meanwhile by someone else is an error, not deleted
        shutil.rmtree(partial)
        return output
    finally:  # no lock file left behind, whatever happened
        os.remove(lock.name)
        lock.close()


def write_model(model_dir, tensors, hf_dir, lora, out_dir, dtype, max_bytes):
    """The full model in safetensors shards of <= max_bytes (a larger single tensor gets its own shard) -> its dtype."""
    saved_name, tied, shapes, model = hf_names(hf_dir)  # in-memory HF name -> the names save_pretrained writes
    plan = lora_plan(tensors, lora) if lora else {key: (key, None) for key in tensors}
    missing, unexpected = sorted(saved_name.keys() - plan.keys()), sorted(plan.keys() - saved_name.keys() - tied)
    wrong = sorted(name for name in saved_name.keys() & plan.keys() if tensors[plan[name][0]].size != shapes[name])
    if adapted_tied := sorted(name for name in tied if name in plan and plan[name][1]):
        raise MergeError(f"--merge_lora: {adapted_tied} carry LoRA but are tied to the input embeddings, which the "
                         f"merged model stores in their place; merge with peft's merge_and_unload() instead")
    if missing or unexpected or wrong:
        raise MergeError(f"{model_dir} does not match the model of {hf_dir}/config.json: missing tensors "
                         f"{missing[:5]} ({len(missing)}), unexpected tensors {unexpected[:5]} ({len(unexpected)}), "
                         f"tensors of another shape {wrong[:5]} ({len(wrong)}). Is huggingface/ from the same run?")
    stored = {name: tensors[plan[name][0]] for name in saved_name}  # in the model's order
    written = {n: torch.empty(s.size, dtype=dtype or s.properties.dtype, device="meta") for n, s in stored.items()}
    split = split_torch_state_dict_into_shards(written, max_shard_size=max_bytes)  # as save_pretrained splits
    for file, shard in split.filename_to_tensors.items():
        keys = [key for name in shard for key in (plan[name][0], *(plan[name][1] or ())[:2])]  # W (+ A, B)
        loaded = read_tensors(model_dir, tensors, keys)
        out = {}
        for name in shard:  # renamed, or (a mixture's fused experts) split as save_pretrained splits them
            out.update(revert_weight_conversion(model, {name: cast(merged_tensor(loaded, *plan[name], dtype), dtype)}))
        save_file(out, os.path.join(out_dir, file), metadata={"format": "pt"})
        del loaded, out
    if split.is_sharded:
        weight_map = {saved: file for name, file in split.tensor_to_filename.items() for saved in saved_name[name]}
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": split.metadata, "weight_map": weight_map}, f, indent=2, sort_keys=True)
    return next(t.dtype for t in written.values() if t.is_floating_point())  # save_pretrained's model.dtype


def merged_tensor(loaded, key, lora, dtype=None):
    """The tensor to write for one plan entry (popped from `loaded`). For an adapted linear, from the checkpoint's
    W [out, in], A [r, in], B [out, r]:
        W' = W + scale * B @ A,  scale = alpha / r  (alpha / sqrt(r) with use_rslora),  transposed if fan_in_fan_out,
    summed in fp32, rounded once to `dtype` (--dtype), else to W's stored dtype (peft's merge_and_unload: twice)."""
    weight = loaded.pop(key)
    if lora is None:
        return weight
    key_a, key_b, scale, transpose = lora
    delta = loaded.pop(key_b).float() @ loaded.pop(key_a).float()  # [out, r] @ [r, in] -> [out, in]
    return (weight.float() + (delta.T if transpose else delta) * scale).to(dtype or weight.dtype)


def lora_plan(tensors, lora):
    """{in-memory HF name: (checkpoint key, None | (key of A, key of B, scale, fan_in_fan_out))} for a peft checkpoint:
    `base_model.model.<name>` and `<module>.base_layer.weight` -> `<module>.weight`."""
    adapter, plan = adapter_name(tensors), {}
    for key in tensors:
        if ".lora_" in key:
            if not re.search(rf"\.lora_[AB]\.{re.escape(adapter)}\.weight$", key):
                raise MergeError(f"--merge_lora cannot merge the peft tensor {key}; use peft's merge_and_unload()")
            continue
        name = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
        if not key.endswith(".base_layer.weight"):
            plan[name] = (key, None)  # not adapted (or an adapted layer's bias)
            continue
        module = key.removesuffix(".base_layer.weight")
        key_a, key_b = f"{module}.lora_A.{adapter}.weight", f"{module}.lora_B.{adapter}.weight"
        if key_a not in tensors or key_b not in tensors or len(tensors[key_a].size) != 2:
            raise MergeError(f"{key} has no 2-d {key_a} / {key_b} pair; use peft's merge_and_unload()")
        scale = lora["lora_alpha"] / (math.sqrt if lora.get("use_rslora") else float)(tensors[key_a].size[0])
        plan[name] = (key, (key_a, key_b, scale, bool(lora.get("fan_in_fan_out"))))
    return plan


def write_adapter(model_dir, tensors, lora, out_dir, dtype):
    """adapter_model.safetensors with peft's saved names (`...lora_A.default.weight` -> `...lora_A.weight`)."""
    keys, adapter = [key for key in tensors if ".lora_" in key], adapter_name(tensors)
    loaded = read_tensors(model_dir, tensors, keys)
    out = {re.sub(rf"\.{re.escape(adapter)}(\.weight)?$", r"\1", key): cast(loaded.pop(key), dtype) for key in keys}
    save_file(out, os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter_config = json.dumps({**lora, "inference_mode": True}, indent=2, sort_keys=True)
    pathlib.Path(out_dir, "adapter_config.json").write_text(adapter_config)


# ---------------------------------------------------------------------------------------------- helpers

def check_checkpoint(local_dir):
    model_dir, hf_dir, step = f"{local_dir}/model", f"{local_dir}/huggingface", os.path.dirname(local_dir)
    if not os.path.exists(os.path.join(model_dir, ".metadata")):
        steps = sorted(sorted(glob.glob(f"{glob.escape(local_dir)}/global_step_*/actor/model/.metadata")), key=len)
        hint = next((f" Did you mean --local_dir {d}?" for d in (f"{local_dir}/actor", os.path.dirname(local_dir))
                     if os.path.exists(f"{d}/model/.metadata")), "")  # global_step_N, or actor/huggingface
        if steps and not hint:  # a run folder: its checkpoints in step order (9 before 10: by length, then name)
            hint = f" It holds {', '.join(os.path.relpath(p, local_dir)[:-len('/model/.metadata')] for p in steps)}."
        hint = hint if os.path.isdir(local_dir) else " The folder does not exist."
        raise MergeError(f"{local_dir} is not an actor checkpoint: {model_dir}/.metadata (torch.distributed.checkpoint)"
                         f" does not exist. Pass checkpoints/<project>/<exp>/global_step_N/actor.{hint}")
    if re.fullmatch(r"global_step_\d+", os.path.basename(step)) and not os.path.exists(f"{step}/trainer_state.json"):
        raise MergeError(f"{step} has no trainer_state.json (trainer.py writes it last): its save did not finish; "
                         "merge it once the run has saved it, or merge an earlier global_step_N/actor")
    try:
        vl = os.path.exists(f"{hf_dir}/config.json") and "vision_config" in json.load(open(f"{hf_dir}/config.json"))
    except ValueError as e:  # cut short: a JSONDecodeError
        raise MergeError(f"{hf_dir}/config.json cannot be read ({e}); copy it again from the run") from None
    needed = ["config.json", "tokenizer_config.json"] + ["processor_config.json or preprocessor_config.json"] * vl
    if missing := [f for f in needed if not any(os.path.exists(f"{hf_dir}/{name}") for name in f.split(" or "))]:
        raise MergeError(f"{hf_dir} lacks {', '.join(missing)} (save or copy cut short); copy them from the base model")
    try:  # its vocabulary (tokenizer.json, vocab.json, ...) lost: the merged model's does not load, or encodes nothing
        problem = not transformers.AutoTokenizer.from_pretrained(hf_dir)("a b", add_special_tokens=False).input_ids
    except Exception as e:
        problem = f" ({type(e).__name__}: {(str(e).splitlines() or [''])[0]})"
    if problem:
        raise MergeError(f"{hf_dir}: the tokenizer does not load{'' if problem is True else problem} or has no "
                         "vocabulary; copy its files from the base model")
    return model_dir, hf_dir


def check_output(output, local_dir, force):
    """Not the checkpoint, a folder above it, or inside what Actor.save_checkpoint wrote there (symlinks resolved)."""
    real, local_dir = os.path.realpath(output), os.path.realpath(local_dir)
    ins = tuple(os.path.join(local_dir, name) + os.sep for name in ("model", "optim", "extra_state.pt", "huggingface"))
    if (local_dir + os.sep).startswith((real + os.sep, real + ".partial/")) or (real + os.sep).startswith(ins):
        raise MergeError(f"--output {real} would overwrite the checkpoint {local_dir}; choose another folder")
    if os.path.islink(output) or os.path.exists(output) and not os.path.isdir(output):  # --force would not replace it
        raise MergeError(f"--output {output} is a file or a symlink; remove it or choose another --output")
    if os.path.exists(output) and not force:
        raise MergeError(f"{output} already exists; pass --force to replace it, or choose another --output")
    if force and (held := glob.glob(f"{glob.escape(output)}/**/.metadata", recursive=True)
                  + glob.glob(f"{glob.escape(output)}/checkpoint_tracker.json")):  # a run folder, a checkpoint
        raise MergeError(f"--force would delete {output}, which holds training checkpoints ({held[0]}); "
                         "choose another --output")


def read_metadata(model_dir):
    """{checkpoint key: TensorStorageMetadata (.size, .properties.dtype)}, after checking that every .distcp
    file the metadata points into (one per saving rank) exists and is long enough."""
    try:
        metadata = dcp.FileSystemReader(model_dir).read_metadata()
    except Exception as e:  # an empty or cut file: EOFError, UnpicklingError
        raise MergeError(f"{model_dir}/.metadata cannot be read ({e!r}); copy it again from where the run saved it")
    ends = sorted((info.relative_path, info.offset + info.length) for info in metadata.storage_data.values())
    for name, nbytes in dict(ends).items():  # each file's largest end (the last of its sorted pairs)
        path = os.path.join(model_dir, name)
        if not os.path.exists(path):
            raise MergeError(f"{path} is missing: {model_dir}/.metadata lists it (each saving rank writes one). Copy "
                             f"every rank's .distcp file into {model_dir} (on several nodes, each node wrote its own).")
        if os.path.getsize(path) < nbytes:
            raise MergeError(f"{path} is truncated ({os.path.getsize(path)} bytes, the metadata needs {nbytes}); "
                             f"copy it again from where the run saved it")
    if not_tensors := [key for key, meta in metadata.state_dict_metadata.items() if not hasattr(meta, "size")]:
        raise MergeError(f"{model_dir} holds non-tensor entries {not_tensors[:5]}; it must hold the model state dict")
    return metadata.state_dict_metadata


def read_tensors(model_dir, tensors, keys):
    """Only `keys`, each assembled from every rank's pieces: dcp.load into fresh full-size tensors."""
    state = {key: torch.empty(tensors[key].size, dtype=tensors[key].properties.dtype) for key in keys}
    with warnings.catch_warnings(action="ignore"):  # "torch.distributed is disabled ... single process": intended
        dcp.load(state, storage_reader=dcp.FileSystemReader(model_dir), no_dist=True)
    return state


def hf_names(hf_dir):
    """({in-memory name: [saved names]}, tied in-memory names, {in-memory name: shape}, the model on the meta device),
    from transformers' own revert_weight_conversion (what save_pretrained applies before writing: a rename, or a
    mixture of experts' fused experts split into one tensor per expert), applied to each tensor alone."""
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    cls = getattr(transformers, (config.architectures or ["(none)"])[0], None)  # the class the run trained
    if cls is None:
        raise MergeError(f"{hf_dir}/config.json: architectures={config.architectures} names no transformers class")
    with torch.device("meta"):
        model = cls._from_config(config)
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    state = {name: tensor for name, tensor in model.state_dict().items() if name not in tied}
    saved = {name: list(revert_weight_conversion(model, {name: tensor})) for name, tensor in state.items()}
    if sorted(n for names in saved.values() for n in names) != sorted(revert_weight_conversion(model, dict(state))):
        raise MergeError(f"{type(model).__name__} saves tensors fused from several of its own (a transformers "
                         f"conversion op); merge.py writes renamed or split tensors only")
    return saved, tied, {name: tensor.shape for name, tensor in model.state_dict().items()}, model


def cast(tensor, dtype):
    return (tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor).contiguous()


def parse_size(size):
    """2000000000, "2GB", "500MB", "1.5GiB" -> bytes (KB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024)."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    match = re.fullmatch(r"(\d+\.?\d*|\.\d+)\s*([a-z]*)", str(size).strip(), re.IGNORECASE)
    if (nbytes := int(float(match.group(1)) * units.get(match.group(2).upper(), 0)) if match else 0) < 1:
        raise MergeError(f"max_shard_size {size!r} is not a size such as 2GB, 500MB or 1000000")
    return nbytes


def adapter_name(keys):
    """The one peft adapter name in `...lora_A.<adapter>.weight` (`...lora_embedding_A.<adapter>`) keys ("default")."""
    names = {m.group(1) for key in keys if (m := re.search(r"\.lora_(?:embedding_)?A\.([^.]+)(?:\.weight)?$", key))}
    if len(names) != 1:
        raise MergeError(f"expected the LoRA tensors of one adapter in the checkpoint, found {sorted(names) or 'none'}")
    return names.pop()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_dir", required=True, help="checkpoints/<project>/<exp>/global_step_N/actor")
    parser.add_argument("--output", help="default <local_dir>/merged (<local_dir>/adapter: LoRA without --merge_lora)")
    parser.add_argument("--dtype", help="bf16 | fp16 | fp32 (default: as stored in the checkpoint)")
    parser.add_argument("--merge_lora", action="store_true", help="LoRA run: write the merged full model")
    parser.add_argument("--max_shard_size", default="2GB", help="per safetensors file (default 2GB)")
    parser.add_argument("--force", action="store_true", help="replace an existing output folder")
    args = parser.parse_args(argv)
    try:
        print(f"wrote {merge_checkpoint(**vars(args))} from {args.local_dir}")
    except MergeError as e:
        parser.exit(2, f"merge.py: error: {e}\n")


if __name__ == "__main__":
    main()
