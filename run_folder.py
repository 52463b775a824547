"""run_folder.py: the files a run keeps in trainer.save_checkpoint_path; imports no stage. Logger writes
experiment_log.jsonl (a row of metrics per step), generations.log, metrics.png and the tracking backends.
find_checkpoint picks the complete global_step_N folder a run resumes from; set_aside_later and remove_old_checkpoints
move or remove others. Run.save_checkpoint (trainer.py) writes the checkpoints, checkpoint_tracker.json last."""

import functools
import json
import os
import re
import shutil
import tempfile
import time

import torch
from tqdm import tqdm

from config import config_to_dict

TRACKER = "checkpoint_tracker.json"
LOG_FILES = ("experiment_log.jsonl", "generations.log")  # in the checkpoint root, cut back on resume (Logger.rewind)
STEP_FOLDER = re.compile(r"global_step_(0|[1-9]\d*)")  # a checkpoint's folder in the checkpoint root (no 007)
LOGGERS = {"console": None, "file": None, "tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow",
           "swanlab": "swanlab"}  # trainer.logger entries -> the package each needs


class Logger:
    """Console (progress bar, a line per step), JSONL (always, appended), and TensorBoard, W&B, MLflow, SwanLab when
    asked, called as EasyR1 calls them but writing into root: tensorboard/ (EasyR1: $TENSORBOARD_DIR/<project>/<exp>),
    swanlab/ unless SWANLAB_DIR is set (SwanLab also reads SWANLAB_API_KEY and SWANLAB_MODE)."""

    def __init__(self, root, names, cfg):
        self.jsonl, self.generations = (open(os.path.join(root, name), "a") for name in LOG_FILES)
        self.names, self.root, self.purge_step, self.jsonl_path = names, root, None, self.jsonl.name
        t, config = cfg.trainer, config_to_dict(cfg)
        self.sinks = []  # (log a row: f(metrics, step), close: f()) of each tracking backend asked for
        if "tensorboard" in names:  # opened at the first row, with rewind's purge_step: a resumed step shows once
            from torch.utils.tensorboard import SummaryWriter
            tb = functools.cache(lambda: SummaryWriter(os.path.join(root, "tensorboard"), purge_step=self.purge_step))
            self.sinks.append((lambda m, at: [tb().add_scalar(k, v, at) for k, v in m.items()], lambda: tb().close()))
        if "wandb" in names:
            import wandb
            run = wandb.init(project=t.project_name, name=t.experiment_name, config=config, resume="allow")
            self.sinks.append((lambda m, step: run.log(m, step=step), run.finish))
        if "mlflow" in names:
            import mlflow
            import pandas
            mlflow.start_run(run_name=t.experiment_name)
            mlflow.log_params(pandas.json_normalize(config, sep="/").to_dict("records")[0])  # a/b/c, as EasyR1
            self.sinks.append((lambda m, step: mlflow.log_metrics(m, step=step), mlflow.end_run))
        if "swanlab" in names:
            import swanlab
            if os.environ.get("SWANLAB_API_KEY"):
                swanlab.login(os.environ["SWANLAB_API_KEY"])
            swanlab.init(project=t.project_name, experiment_name=t.experiment_name, config=config,
                         logdir=os.environ.get("SWANLAB_DIR", os.path.join(root, "swanlab")),
                         mode=os.environ.get("SWANLAB_MODE", "cloud"))
            self.sinks.append((lambda m, step: swanlab.log(m, step=step), swanlab.finish))

    def log(self, metrics, step, amend=False):
        """One row per step in experiment_log.jsonl. amend: merge into `step`'s row if there is one (a resumed run's
        validation of the step it resumes from), replacing the file atomically, so no step has two rows."""
        metrics = {k: float(v) for k, v in metrics.items()}
        lines = open(self.jsonl_path).readlines() if amend else []
        rows = [i for i, line in enumerate(lines) if line.endswith("\n") and json.loads(line).get("step") == step]
        if not rows and lines and not lines[-1].endswith("\n"):  # a killed run's row cut short: not appended to
            rows, lines[-1] = [len(lines) - 1], json.dumps({"step": step}) + "\n"  # the new row in its place
        if rows:
            lines[rows[-1]] = json.dumps({**json.loads(lines[rows[-1]]), **metrics}) + "\n"
            self.jsonl.close()
            write_atomic(self.jsonl_path, "".join(lines))
            self.jsonl = open(self.jsonl_path, "a")
        else:
            print(json.dumps({"step": step, **metrics}), file=self.jsonl, flush=True)
        if "console" in self.names:
            keys = [k for k in ("reward/overall", "val/reward_score", "actor/pg_loss", "actor/entropy",
                                "response_length/mean", "timing_s/step") if k in metrics]
            tqdm.write(f"step {step}: " + "  ".join(f"{k}={metrics[k]:.4g}" for k in keys))
        for log, _ in self.sinks:
            log(metrics, step)

    def flush(self):
        for f in (self.jsonl, self.generations):
            f.flush()
            os.fsync(f.fileno())

    def rewind(self, step, generations=None):
        """Truncate each of the LOG_FILES at its first row of a step after `step` (the checkpoint resumed from; -1: a
        fresh start) or cut short, saying so (rows are in step order); generations.log after `generations` instead, if
        given (a resume that validates first logs step's generations again). By step, not byte size: amend rewrites
        the checkpoint's row to a new size. TensorBoard hides later steps' earlier events (its purge_step)."""
        self.purge_step = step + 1
        for f, last in ((self.jsonl, step), (self.generations, step if generations is None else generations)):
            lines = open(f.name, "rb").readlines()  # rows are {"step": N, ...}\n; no match: a row cut short
            rows = [re.match(rb'\{"step": (-?\d+)[,}]', line) if line.endswith(b"\n") else None for line in lines]
            kept = next((i for i, row in enumerate(rows) if not row or int(row.group(1)) > last), len(lines))
            if kept < len(lines):
                os.truncate(f.name, sum(map(len, lines[:kept])))  # appends continue there (the file is O_APPEND)
                print(f"{f.name}: dropped {len(lines) - kept} lines of the steps that run again", flush=True)

    def log_generations(self, rows, step):
        for row in rows:
            self.generations.write(json.dumps({"step": step, **row}) + "\n")
            if "console" in self.names:
                tqdm.write(f"[prompt] {row['prompt']!r}\n[output] {row['response']!r}\n"
                           f"[ground_truth] {row['ground_truth']!r} [score] {row['score']:.3f}")
        self.generations.flush()

    def plot(self):
        """metrics.png: reward, accuracy, format score and response length by step (train, validation) from the log."""
        try:
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        plt.switch_backend("Agg")
        rows = [json.loads(line) for line in open(self.jsonl_path)]
        panels = {"reward": ("reward/overall", "val/reward_score"),
                  "accuracy": ("reward/accuracy", "val/accuracy_reward"),
                  "format": ("reward/format", "val/format_reward"),
                  "response length": ("response_length/mean", "val_response_length/mean")}
        fig, axes = plt.subplots(1, len(panels), figsize=(17, 3.5))
        for ax, (title, keys) in zip(axes, panels.items()):
            for key, label in zip(keys, ("train", "validation")):
                if points := sorted({r["step"]: r[key] for r in rows if key in r}.items()):
                    ax.plot(*zip(*points), marker="." if len(points) < 30 else None, label=label)
            ax.set(title=title, xlabel="step")
            if ax.lines:
                ax.legend()
        fig.tight_layout()
        path = os.path.join(self.root, "metrics.png")
        fig.savefig(path, dpi=80)
        plt.close(fig)
        return path

    def close(self):
        for close in [self.jsonl.close, self.generations.close] + [close for _, close in self.sinks]:
            close()


def write_atomic(path, text):
    """Write `text` to a temporary file, flush it to disk, then rename it over `path`: `path` is whole or old."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class CheckpointError(RuntimeError):
    pass


def find_checkpoint(root, load_path, find_last, val_only=False):
    """The global_step_N folder to resume from, checked complete (no Ray): `load_path` if given (a later complete one
    in root: a warning; with `val_only`, another folder's into a root that holds a training run: an error); else the
    tracker's, or the newest complete one if that is incomplete or the tracker unreadable. None for a fresh start: no
    checkpoint in root; or not `find_last`, or none complete and no tracker (with one: a CheckpointError), these two
    moving the earlier run's files aside unless `val_only`."""
    if load_path is not None:
        match = STEP_FOLDER.fullmatch(os.path.basename(os.path.normpath(load_path)))
        if not match or not os.path.isdir(load_path):
            raise CheckpointError(f"trainer.load_checkpoint_path={load_path} must be an existing global_step_N folder")
        if problem := checkpoint_problem(load_path):
            raise CheckpointError(f"cannot resume from trainer.load_checkpoint_path={load_path}: {problem}")
        log = os.path.join(root, LOG_FILES[0])  # val_only amends the step's row, or adds one (a resume cuts it)
        other = not os.path.samefile(os.path.dirname(os.path.abspath(load_path)), root)  # another folder's checkpoint
        if val_only and other and os.path.isfile(log) and (os.path.exists(os.path.join(root, TRACKER)) or re.search(
                rb'[{,] "(?!val|step")', open(log, "rb").read())):  # root trained: a tracker, or a row's training key
            raise CheckpointError(f"trainer.val_only of trainer.load_checkpoint_path={load_path}, another folder's "
                                  f"checkpoint, would write its scores as step {match[1]}'s into {log}, another "
                                  f"run's: set trainer.save_checkpoint_path to a new folder")
        if later := [s for s in saved_steps(root) if s > int(match[1])
                     and not checkpoint_problem(os.path.join(root, f"global_step_{s}"))]:
            print(f"warning: {root} holds global_step_{later[-1]}, a complete checkpoint later than trainer.load_"
                  f"checkpoint_path={load_path}: unless trainer.val_only, steps after {match[1]} run again (checkpoints"
                  f" moved aside, log rows cut); unset trainer.load_checkpoint_path to resume from it", flush=True)
        return load_path
    tracker, steps, problems = os.path.join(root, TRACKER), saved_steps(root)[::-1], []
    if not find_last:  # a fresh start: the earlier run's files go aside (none cut, overwritten or rotated away)
        return None if val_only else move_aside(root, "trainer.find_last_checkpoint=false")  # with or without steps
    if not steps and not os.path.exists(tracker):
        return None
    last, problem = _load("", tracker, lambda p: int(json.load(open(p))["last_global_step"]))
    if problem:  # unreadable, or missing: folders copied here, or a first save stopped before the tracker
        print(f"{problem}; looking for the newest complete checkpoint in {root}", flush=True)
    else:
        if last not in steps:
            problems.append(f"global_step_{last} (named by the tracker) does not exist")
        steps = [s for s in steps if s <= last]  # later folders were being written when the run stopped
    for step in steps:
        path = os.path.join(root, f"global_step_{step}")
        if problem := checkpoint_problem(path):
            problems.append(f"global_step_{step}: {problem}")
            continue
        if problems:
            print(f"resuming from {path}, the newest complete checkpoint; skipped: {'; '.join(problems)}", flush=True)
        return path
    if not os.path.exists(tracker):  # e.g. a first save that stopped, or save_model_only checkpoints copied here
        return None if val_only else move_aside(root, f"none is complete ({'; '.join(problems)}): starting afresh")
    raise CheckpointError(f"{root} has a checkpoint tracker but no complete checkpoint to resume from: "
                          f"{'; '.join(problems) or 'no global_step_N folder'}. Restore the missing files, or start "
                          f"afresh with trainer.find_last_checkpoint=false (they are moved aside) or another "
                          f"trainer.save_checkpoint_path")


def set_aside_later(root, path, step, best):
    """A resume from `path` (step `step`). `path` in root: root's complete checkpoints of later steps, which run again,
    go to earlier_<time>/ with a copy of the logs (their rows, which the resume cuts here) and of experiment_config.json
    (their settings; the resume's first save writes its own), and the tracker then names `step`: folders, tracker and
    logs agree even if this run stops before saving (a later incomplete folder stays until its step is saved). `path`
    another folder's: root's run is another's (or an earlier attempt's), so all of it goes aside, not left for rotation
    (every checkpoint, the tracker, metrics.png, tensorboard/: a writer's purge_step would hide its events), the logs
    copied even if it saved nothing. -> the last step whose log rows stay here: `step`, or -1 (all are cut)."""
    inside = os.path.samefile(os.path.dirname(os.path.abspath(path)), root)
    moved = [f"global_step_{s}" for s in saved_steps(root)
             if not inside or s > step and not checkpoint_problem(os.path.join(root, f"global_step_{s}"))]
    if not inside:
        moved += [n for n in (TRACKER, "metrics.png", "tensorboard") if os.path.exists(os.path.join(root, n))]
    if moved or not inside:  # not inside: the logs (copied) of a run that saved nothing, or of validations, too
        why = "the later steps run again" if inside else "another folder's checkpoint: this folder's run goes aside"
        move_aside(root, f"resuming from {path}: {why}", moved, copies=(*LOG_FILES, "experiment_config.json"))
        if inside:
            write_atomic(os.path.join(root, TRACKER), json.dumps({"last_global_step": step, **best}))
    return step if inside else -1


def move_aside(root, why, names=None, copies=()):
    """Move root's `names` (default: a run's logs, tracker and checkpoints) to a new root/earlier_<time>/, with a copy
    of those of `copies` that are there, saying so; no names: a new folder for the copies alone, if one is not empty."""
    run = (*LOG_FILES, TRACKER, "experiment_config.json", "metrics.png", "tensorboard")
    names = [n for n in os.listdir(root) if n in run or STEP_FOLDER.fullmatch(n)] if names is None else names
    copied = [name for name in copies if os.path.isfile(os.path.join(root, name))]
    if names or any(os.path.getsize(os.path.join(root, name)) for name in copied):  # not a new folder's empty logs
        aside = tempfile.mkdtemp(prefix=time.strftime("earlier_%Y%m%d_%H%M%S_"), dir=root)  # a new folder
        os.chmod(aside, 0o755)
        for name in names:
            os.rename(os.path.join(root, name), os.path.join(aside, name))
        for name in copied:
            shutil.copy2(os.path.join(root, name), aside)
        print(f"{why}: {', '.join(names) or 'no checkpoint'} moved from {root} to {aside}"
              + (f"; a copy of {', '.join(copied)} with them" if copied else ""), flush=True)


def checkpoint_problem(path):
    """None when the folder holds every file a resume reads, else what is wrong, in words: trainer_state.json,
    dataloader.pt and actor/extra_state.pt load; actor/model and actor/optim hold every shard their .metadata names."""
    from torch.distributed.checkpoint import FileSystemReader

    actor = os.path.join(path, "actor")  # EasyR1's run folder is this one's by default (project and experiment names)
    if os.path.isdir(actor) and any(re.fullmatch(r"model_world_size_\d+_rank_\d+\.pt", n) for n in os.listdir(actor)):
        return ("an EasyR1 checkpoint (actor/model_world_size_*_rank_*.pt), which this trainer does not resume: merge "
                "it with EasyR1's scripts/model_merger.py and set worker.actor.model.model_path to the merged model")
    state, problem = _load(path, "trainer_state.json", lambda p: json.load(open(p)))
    if problem or not isinstance(state, dict) or not {"global_step", "kl_coef"} <= state.keys():
        return problem or "trainer_state.json lacks global_step or kl_coef"
    if not state.get("resumable", True):
        return "trainer.save_model_only=true saved no optimizer state: it cannot be resumed (merge it with merge.py)"
    for name in ("dataloader.pt", "actor/extra_state.pt"):
        if problem := _load(path, name, lambda p: torch.load(p, weights_only=True))[1]:
            return problem
    for name in ("actor/model", "actor/optim"):
        metadata, problem = _load(path, f"{name}/.metadata",
                                  lambda p: FileSystemReader(os.path.dirname(p)).read_metadata())
        if problem:
            return problem
        for info in metadata.storage_data.values():
            shard = os.path.join(path, name, info.relative_path)
            if not os.path.exists(shard) or os.path.getsize(shard) < info.offset + info.length:
                return f"{name}/{info.relative_path} is missing or truncated"
    return None


def _load(folder, name, load):
    """(load(folder/name), None), or (None, in words why it cannot be loaded): missing, truncated, not JSON..."""
    try:
        return load(os.path.join(folder, name)), None
    except FileNotFoundError:
        return None, f"{name} is missing"
    except Exception as e:  # truncated, or not plain tensors and containers
        return None, f"{name} cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"


def saved_steps(root):
    return sorted(int(m.group(1)) for n in os.listdir(root) if (m := STEP_FOLDER.fullmatch(n)))


def remove_old_checkpoints(root, step, best_step, limit):
    """Keep the newest `limit` saved checkpoints up to `step` (the best by validation counts toward them, if its
    folder is there, and is never removed); an earlier folder of a save cut short (its step passed unsaved after a
    resume) is not counted; a later folder, left by a stopped run, is neither counted nor removed (it is
    replaced when reached)."""
    if limit <= 0:
        return
    steps = [s for s in saved_steps(root) if s <= step]
    keep = {step} | ({best_step} & set(steps))  # a best rotated away before a resume from an earlier step: not counted
    complete = [s for s in reversed(steps) if s not in keep  # trainer_state.json: a save's last file in its folder
                and os.path.isfile(os.path.join(root, f"global_step_{s}", "trainer_state.json"))]
    keep |= set(complete[:max(limit - len(keep), 0)])
    for s in steps:
        if s not in keep:
            remove_checkpoint(os.path.join(root, f"global_step_{s}"))


def remove_checkpoint(path):
    """Remove `path`, or of a folder that holds more (merge.py's actor/merged or actor/adapter, an --output) only the
    files save_checkpoint wrote, saying what stays."""
    names = {os.path.join(d, n) for d in ("", "actor") if os.path.isdir(os.path.join(path, d))
             for n in os.listdir(os.path.join(path, d))}
    own = {n for n in names if n.split(".tmp.")[0] in {"actor/model", "actor/optim", "actor/extra_state.pt",  # and
           "actor/huggingface", "dataloader.pt", "trainer_state.json"}}  # write_atomic's .tmp.<pid> of a save killed
    try:
        if not (kept := sorted(names - own - {"actor"})):
            return shutil.rmtree(path)
        if own:  # none: removed, and said, before
            print(f"{path}: removing the checkpoint but keeping what else is there: {', '.join(kept)}", flush=True)
        for name in own:
            (shutil.rmtree if os.path.isdir(os.path.join(path, name)) else os.remove)(os.path.join(path, name))
    except FileNotFoundError:  # not there (a step saved the first time), or removed meanwhile
        return None
    except OSError as e:  # immutable or another user's files: left, and said (the run goes on)
        return print(f"{path}: not removed ({e.strerror or e}: {e.filename or path}); remove by hand", flush=True)
