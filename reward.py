"""reward.py: score responses with rule-based reward functions (strings in, dicts of floats out).

    score = load_reward_function("math")                          # a built-in: math | r1v | dapo | toy
    score = load_reward_function("my_reward.py:compute_score", max_response_length=2048)
    scores = score(inputs)                                        # list of dicts -> list of dicts

A reward input (one per response):
    response:        str   the decoded response (special tokens skipped: worker.reward.skip_special_tokens)
    response_length: int   its length in tokens, the EOS included when it stopped
    finish_reason:   str   "stop" (it ended with an EOS) or "length" (cut at data.max_response_length)
    ground_truth:    str   the row's answer (a list or dict answer as it is)
    prompt:          str   the chat-templated prompt (system message, format template, vision placeholders)
    extra:           dict  the row's other columns (e.g. a difficulty or a task type)
A reward function returns one dict of finite floats per input with at least "overall" (the scalar reward that
advantage.py turns into advantages); the other keys are logged as metrics, each the mean over the inputs that return
it (as EasyR1: a key of one task only is that task's mean).
A user's file sets REWARD_TYPE = "batch" (the default: fn(list of inputs, **kwargs) -> list of dicts) or
"sequential" (fn(input, **kwargs) -> dict, as the built-ins).
"""

import atexit
import contextlib
import ctypes
import copy
import importlib.util
import inspect
import math
import multiprocessing
import os
import re
import signal
import sys
import threading
import traceback
import weakref

from math_verify import parse, verify


class RewardError(RuntimeError):
    """A reward function failed or returned something unusable; the message names it and the sample."""


def load_reward_function(spec, call_timeout=None, **kwargs):
    """A RewardFunction from a built-in name or "path/file.py:function" (function defaults to main; the path is
    relative to the working directory). kwargs go to every call; call_timeout: seconds a call may take
    (worker.reward.call_timeout), None for no limit."""
    if spec in BUILTIN:
        return RewardFunction(BUILTIN[spec], spec, "sequential", kwargs, call_timeout)
    path, _, fn_name = spec.rpartition(":") if ":" in spec else (spec, "", "main")
    fn_name = fn_name or "main"
    if not path.endswith(".py"):
        raise RewardError(f"reward_function={spec!r} is neither a built-in ({', '.join(BUILTIN)}) "
                          f"nor a 'path/file.py:function'")
    if not os.path.isfile(path):
        raise RewardError(f"reward_function={spec!r}: file {os.path.abspath(path)} does not exist")
    module_name = f"reward_file_{os.path.splitext(os.path.basename(path))[0]}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # so that dataclasses and pickling inside the file work
    if (folder := os.path.dirname(os.path.abspath(path))) not in sys.path:
        sys.path.append(folder)  # its sibling files import, as when it runs as a script (appended: shadows nothing)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # a syntax error, or a package it imports that is not installed (EasyR1's need mathruler)
        raise RewardError(f"reward_function={spec!r}: {path} failed to load: {type(e).__name__}: {e}") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        found = [n for n, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module.__name__]
        raise RewardError(f"reward_function={spec!r}: {path} has no function {fn_name!r} "
                          f"(functions there: {', '.join(found) or 'none'})")
    reward_type = getattr(module, "REWARD_TYPE", "batch")
    if reward_type not in ("batch", "sequential"):
        raise RewardError(f"{path}: REWARD_TYPE = {reward_type!r}; it must be 'batch' or 'sequential'")
    return RewardFunction(fn, f"{os.path.basename(path)}:{fn_name}", reward_type, kwargs, call_timeout)


class RewardFunction:
    """A reward function with its kwargs bound; calling it scores a list of inputs and checks the results.

    call_timeout bounds every call: one per sample (sequential) or per batch. With a limit the function runs in a
    reward process forked here (first before Ray or any thread starts, again after a timeout or a crash; the
    function is not pickled) that serves calls over a pipe, killed at a timeout. Not a thread: Python cannot stop
    one, and one stuck in C code holding the GIL (a backtracking regex) would block the timer too."""

    _worker = None  # (process, pipe) while a reward process runs

    def __init__(self, fn, name, reward_type, kwargs, call_timeout=None):
        self.fn, self.name, self.reward_type, self.kwargs = fn, name, reward_type, dict(kwargs)
        self.call_timeout = call_timeout
        try:  # the first argument is the input (or the list of inputs)
            inspect.signature(fn).bind(None, **self.kwargs)
        except TypeError as e:
            raise RewardError(f"reward function {name!r} cannot be called with the keyword arguments "
                              f"{sorted(self.kwargs)} (worker.reward.reward_function_kwargs): {e}") from None
        if call_timeout is not None:
            if not 0 < call_timeout <= 1e6:  # the pipe's poll takes at most ~24 days
                raise RewardError(f"worker.reward.call_timeout={call_timeout!r}: give a number of seconds > 0 and "
                                  f"at most 1e6, or null for no limit")
            atexit.register(lambda ref=weakref.ref(self): ref() and ref().close())  # weak: GC still stops it
            self._start()

    def __call__(self, inputs):
        """inputs: list of reward-input dicts -> list of {key: float} with "overall", same order."""
        if self.reward_type == "sequential":
            results = [self._call(inputs, i) for i in range(len(inputs))]
        else:
            results = self._call(inputs)
            if not isinstance(results, (list, tuple)) or len(results) != len(inputs):
                got = f"{len(results)} results" if isinstance(results, (list, tuple)) else type(results).__name__
                raise RewardError(f"reward function {self.name!r} (REWARD_TYPE batch) returned {got} for "
                                  f"{len(inputs)} inputs; it must return one dict per input, in order")
        return [self._check(inputs, i, result) for i, result in enumerate(results)]

    def _check(self, inputs, i, result):
        """result as {key: float}, or a RewardError: not a dict, no "overall", not a finite number."""
        if not isinstance(result, dict):
            raise self._error(inputs, i, f"returned {type(result).__name__}, not a dict of floats")
        if not all(isinstance(key, str) for key in result):
            raise self._error(inputs, i, f"returned keys {list(result)}; they must be strings (metric names)")
        if "overall" not in result:
            raise self._error(inputs, i, f"returned keys {sorted(result)} without 'overall'")
        scores = {}
        for key, value in result.items():
            try:  # float("1.0") works, but a string is a bug
                scores[key] = float(None if isinstance(value, (str, bytes)) else value)
            except (TypeError, ValueError, OverflowError):  # OverflowError: an int beyond float's range
                raise self._error(inputs, i, f"returned {key!r} = {value!r}, which is not a number") from None
            if not math.isfinite(scores[key]):
                raise self._error(inputs, i, f"returned {key!r} = {scores[key]}")
        return scores

    def _call(self, inputs, i=None):
        """fn on a copy of inputs[i] (sequential) or of each input (i None: batch), as the reward process gets them;
        here or, with a call_timeout, there. A RewardError if it raises, times out or ends the process."""
        arg = copy.deepcopy(inputs[i]) if i is not None else [copy.deepcopy(x) for x in inputs]
        if self.call_timeout is None:
            try:
                return self.fn(arg, **self.kwargs)
            except (Exception, SystemExit) as e:  # sys.exit (argparse in a helper) must not end the trainer with 0
                raise self._error(inputs, i, f"raised {type(e).__name__}: {e}") from e
        if self._worker is None or not self._worker[0].is_alive():
            self.close()
            self._start()
        process, pipe = self._worker
        try:
            pipe.send(arg)
        except Exception as e:  # an input that cannot be pickled
            raise self._error(inputs, i, f"could not be called: its input cannot be sent to the reward process "
                                         f"({type(e).__name__}: {e})") from e
        if not pipe.poll(self.call_timeout):
            self.close()
            raise self._error(inputs, i, f"did not return within worker.reward.call_timeout={self.call_timeout:g} "
                                         f"s (the call was stopped; raise the limit if the function is only slow)")
        try:
            reply = pipe.recv()
        except EOFError:
            self.close()
            raise self._error(inputs, i, f"ended its process (exit code {process.exitcode})") from None
        if reply[0] == "ok":
            return reply[1]
        raise self._error(inputs, i, f"raised {reply[1]}") from RuntimeError(f"in the reward process:\n{reply[2]}")

    def _error(self, inputs, i, what):
        """The RewardError for sample i, or for the batch (i None: not called again one sample at a time, which
        would repeat its side effects, such as paid requests; the traceback, chained, says where it failed)."""
        if i is None:
            return RewardError(f"reward function {self.name!r} {what} on a batch of {len(inputs)} inputs (REWARD_TYPE "
                               f"batch, the default: one call with the list; 'sequential': one call per input)")
        return RewardError(f"reward function {self.name!r} {what} on sample {i} "
                           f"(ground_truth={inputs[i].get('ground_truth')!r}, response starts "
                           f"{str(inputs[i].get('response'))[:200]!r}). Fix the function so it returns a dict of "
                           f"finite floats with 'overall' for every sample.")

    def _start(self):
        context = multiprocessing.get_context("fork")
        pipe, child_end = context.Pipe()
        process = context.Process(target=_serve, args=(self.fn, self.kwargs, child_end, pipe), daemon=True,
                                  name=f"reward {self.name}")
        process.start()
        os.setpgid(process.pid, process.pid)  # its own process group, which close() kills: what fn started too
        child_end.close()
        self._worker = (process, pipe)

    def close(self):
        """Stop the reward process, if any (a later call starts a new one)."""
        if self._worker is not None:
            (process, pipe), self._worker = self._worker, None
            pipe.close()
            with contextlib.suppress(ProcessLookupError):  # the group has ended already
                os.killpg(process.pid, signal.SIGKILL)
            process.join()

    __del__ = close  # a garbage-collected RewardFunction stops its reward process


def _serve(fn, kwargs, pipe, trainer_end):
    """The reward process: call fn on each argument received, send back ("ok", result) or ("raised",
    "Type: message", traceback text), until the trainer closes the pipe or ends."""
    trainer_end.close()  # the copy forked here: while open, a trainer that dies would leave this process waiting
    multiprocessing.current_process().daemon = False  # fn may start processes (a Pool); the trainer still ends it
    if "torch" in sys.modules:  # forked after torch's OpenMP threads ran: a parallel op here would wait on them
        sys.modules["torch"].set_num_threads(1)  # forever (as torch's DataLoader workers, one thread each)
    os.setpgid(0, 0)  # its own process group (the trainer sets it too), before the guard below joins it
    with contextlib.suppress(AttributeError, OSError):  # Linux: killed with the trainer, also during a hung call
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
        group = os.getpid()
        if os.fork() == 0:  # a guard: when this process ends (killed with the trainer, too), it kills the group,
            try:  # so what fn started goes as well (a killed process's children live on)
                pipe.close()
                signal.signal(signal.SIGTERM, lambda *_: os.killpg(group, signal.SIGKILL))
                ctypes.CDLL(None).prctl(1, signal.SIGTERM)
                while os.getppid() == group:  # else this process ended already
                    signal.pause()
                os.killpg(group, signal.SIGKILL)
            finally:
                os._exit(0)
    while True:
        try:
            arg = pipe.recv()
        except EOFError:
            return
        try:
            reply = ("ok", fn(arg, **kwargs))
        except Exception as e:
            reply = ("raised", f"{type(e).__name__}: {e}", traceback.format_exc())
        try:
            pipe.send(reply)
        except Exception as e:  # a result that cannot be pickled
            pipe.send(("raised", f"{type(e).__name__}: its result cannot be sent back from the reward "
                                 f"process: {e}", traceback.format_exc()))


# -- Built-in scorers: one sample in, one dict out ----------------------------------------------------

R1V_THINK_END = re.compile(r"</think>\s*<answer>")
R1V_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
TOY_COLORS = ("red", "green", "blue", "yellow")  # the toy world's colours (toy.py COLORS)


def math_reward(sample, format_weight=0.1, timeout=10.0):
    """Math with a boxed answer (EasyR1's math.py; Geometry3K).

    text     = tidy(response): "< think >" becomes "<think>", and "x < 1 / 2" becomes "x<1/2"
    format   = 1 if text fullmatches <think>.*</think>.*\\boxed{.*}.* (DOTALL), else 0
    accuracy = 1 if the content of text's LAST \\boxed{...} (nested braces counted) is equivalent to the
               ground truth (is_equivalent), else 0
    overall  = (1 - format_weight) * accuracy + format_weight * format
    timeout: seconds for each grader step (see is_equivalent).
    """
    text = tidy(sample["response"])
    think_end = text.find("</think>", len("<think>")) if text.startswith("<think>") else -1
    box = text.find("\\boxed{", think_end + len("</think>")) if think_end >= 0 else -1
    form = 1.0 if box >= 0 and "}" in text[box + len("\\boxed{"):] else 0.0
    accuracy = 1.0 if is_equivalent(last_boxed(text) or "", sample["ground_truth"], timeout) else 0.0  # "": no box
    return _weighted(accuracy, form, format_weight)


def r1v_reward(sample, format_weight=0.5, timeout=10.0):
    """R1-V style <think>/<answer> (EasyR1's r1v.py).

    format   = 1 if the raw response fullmatches <think>.*?</think>\\s*<answer>.*?</answer> (DOTALL), else 0
               (nothing is stripped: a newline after </answer> gives 0, as in EasyR1); checked in linear time:
               starts with <think>, ends with </answer>, and its first </think>\\s*<answer> fits between them
    accuracy = 1 if the content of the first <answer>...</answer> (the whole response when there is
               none, as in EasyR1) is equivalent to the ground truth, else 0
    overall  = (1 - format_weight) * accuracy + format_weight * format
    """
    text = sample["response"]
    pair = R1V_THINK_END.search(text, len("<think>")) if text.startswith("<think>") else None
    form = 1.0 if pair and text.endswith("</answer>") else 0.0  # <answer> ends before </answer> starts
    found = R1V_ANSWER.search(text)
    accuracy = 1.0 if is_equivalent(found.group(1) if found else text, sample["ground_truth"], timeout) else 0.0
    return _weighted(accuracy, form, format_weight)


def dapo_reward(sample, *, max_response_length, overlong_buffer_length, overlong_penalty_factor):
    """DAPO (EasyR1's dapo.py): exact match after Minerva normalisation, plus a soft overlong penalty.

    answer   = text after the first "Answer:" of the last line that has one (case-insensitive; blank space after it
               skipped, line breaks too, then up to the end of that line, a later "Answer:" included) within the
               last 300 characters of the response; "[INVALID]" if there is none
    accuracy = +1 if minerva_normalize(answer) == minerva_normalize(ground_truth), else -1
    overlong, with L = response_length (tokens), L_max = max_response_length, L_buf = overlong_buffer_length:
               0                              if L <= L_max - L_buf
               (L_max - L_buf - L) / L_buf    if L_max - L_buf < L <= L_max   (linear from 0 to -1)
               -1                             if L > L_max
    overall  = accuracy + overlong_penalty_factor * overlong
    accuracy_normalized = (accuracy + 1) / 2   (in [0, 1]; the usual online-filtering key)
    """
    if not 0 <= overlong_buffer_length <= max_response_length:
        raise ValueError(f"overlong_buffer_length={overlong_buffer_length} must be within [0, "
                         f"max_response_length={max_response_length}]")
    answer = (DAPO_ANSWER.findall(sample["response"][-300:]) or ["[INVALID]"])[-1]
    accuracy = 1.0 if minerva_normalize(answer) == minerva_normalize(str(sample["ground_truth"])) else -1.0
    soft_start = max_response_length - overlong_buffer_length
    # the formula above as one clip to [-1, 0]; (L_buf or 1): with no buffer, -1 as soon as L > L_max
    overlong = min(max((soft_start - sample["response_length"]) / (overlong_buffer_length or 1), -1.0), 0.0)
    return {"overall": accuracy + overlong_penalty_factor * overlong, "accuracy": accuracy,
            "overlong": overlong, "accuracy_normalized": (accuracy + 1.0) / 2.0}


def toy_reward(sample, format_weight=0.1):
    """The offline toy tasks (colours of a square; sums of two numbers): the answer is the first word.

    word     = first whitespace-separated word of the response (of its first <answer>...</answer>, as the warm-started
               toy models write it, if there is one), lowercased, punctuation stripped from its ends
    accuracy = 1 if word == the ground truth (lowercased, stripped), else 0
    format   = 1 if word is a toy answer at all (red, green, blue, yellow, or a whole number), else 0
    overall  = (1 - format_weight) * accuracy + format_weight * format
    The format bonus gives a random-init model a signal before it ever names the right answer.
    """
    found = R1V_ANSWER.search(sample["response"])
    word = ((found.group(1) if found else sample["response"]).split() or [""])[0].lower().strip(".,;:!?\"'()[]{}")
    accuracy = 1.0 if word and word == str(sample["ground_truth"]).strip().lower() else 0.0
    form = 1.0 if word in TOY_COLORS or word.isdigit() else 0.0
    return _weighted(accuracy, form, format_weight)


def _weighted(accuracy, form, format_weight):
    return {"overall": (1 - format_weight) * accuracy + format_weight * form, "format": form, "accuracy": accuracy}


BUILTIN = {"math": math_reward, "r1v": r1v_reward, "dapo": dapo_reward, "toy": toy_reward}


# -- Helpers: tags, boxed answers, the grader, Minerva normalisation ----------------------------------

def tidy(text):
    """text without the white space around every <, > and / (for Qwen2.5-VL-32B's "< /think >"), as EasyR1's
    re.sub(r"\\s*(<|>|/)\\s*", r"\\1", text) but in linear time: (?<!\\s) starts a match only where a run starts."""
    return re.sub(r"(?<=[<>/])\s+|(?<!\s)\s+(?=[<>/])", "", text)


def last_boxed(text):
    """Content of the last \\boxed{...}, nested braces counted; None if there is none or it never closes."""
    start, depth = text.rfind("\\boxed{"), 0
    if start < 0:
        return None
    for i in range(start + len("\\boxed"), len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + len("\\boxed{"):i]
    return None


def is_equivalent(answer, ground_truth, timeout=10.0):
    """True if `answer` and `ground_truth` are equal stripped strings or equal to math-verify (\\frac{1}{2}, 0.5, 1/2
    and \\dfrac12 agree; units in \\text or \\mathrm and ^\\circ are ignored; a bare `12 cm^2` or `5.` is not "12" or
    "5", unlike mathruler). timeout: seconds (rounded up) per math-verify step, <= 0 for none (may hang); a timeout
    or error is False."""
    answer, ground_truth = answer.strip(), str(ground_truth).strip()
    if not answer or answer == ground_truth:  # an empty answer is never right
        return bool(answer)
    seconds = math.ceil(min(max(timeout, 1), 2**31 - 1)) if timeout > 0 else None  # SIGALRM's limit: 68 years
    if seconds and threading.current_thread() is not threading.main_thread():
        raise RuntimeError("the math grader's timeout uses SIGALRM, which only works in the main thread: "
                           "call the reward function from the main thread, or pass timeout=0 (no timeout)")
    try:
        gold = parse(f"\\boxed{{{ground_truth}}}", parsing_timeout=seconds)
        guess = parse(f"\\boxed{{{answer}}}", parsing_timeout=seconds)
        return bool(gold and guess and verify(gold, guess, timeout_seconds=seconds))
    except Exception:
        return False


# Minerva's answer normalisation (Lewkowycz et al. 2022, appendix), in the order it applies them:
# literal replacements (a "" replacement removes the text), then regex rewrites.
MINERVA_REPLACE = [
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
] + [(unit, "") for unit in [
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}",
    "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
]]
MINERVA_REWRITE = [
    (r"(.*?)\$(.*?)\$(.*)", r"$\2$"),      # keep the first $...$ of a line if there is one
    (r"\\text\{(.*?)\}", r"\1"),            # \text{x}, \textbf{x}, \overline{x} -> x
    (r"\\textbf\{(.*?)\}", r"\1"),
    (r"\\overline\{(.*?)\}", r"\1"),
    (r"\\boxed\{(.*)\}", r"\1"),             # \boxed{x} -> x
    (r"frac([^{])(.)", r"frac{\1}{\2}"),     # \frac12 -> \frac{1}{2}
    (r"sqrt([^{])", r"sqrt{\1}"),            # \sqrt2 -> \sqrt{2}
]


def minerva_normalize(answer):
    """Minerva's normalisation of a final answer: keep what follows the last "=", drop articles, spaces, "$",
    unit words and \\text/\\boxed wrappers, expand \\frac12 and \\sqrt2, drop the commas of an integer."""
    answer = answer.split("=")[-1]
    for old, new in MINERVA_REPLACE:
        answer = answer.replace(old, new)
    for pattern, replacement in MINERVA_REWRITE:
        answer = re.sub(pattern, replacement, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()
