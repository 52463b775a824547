"""reward.py's reward process (worker.reward.call_timeout): calls under a time limit, failures that name the
function and the sample, and a process that ends with the trainer and takes what the function started along."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import reward
from reward import RewardError, load_reward_function
from test_reward import BATCH_BODY, SEQUENTIAL_BODY, sample, write


# ---------------------------------------------------------------------------------------------------
# A time limit per call (worker.reward.call_timeout).

HANGING_FILE = '''
import re, time
REWARD_TYPE = "{kind}"
calls = []

def score(x):
    calls.append(x["ground_truth"])
    if x["ground_truth"] == "regex":       # backtracks for ages in C, holding the GIL
        re.match(r"(a+)+$", "a" * 40 + "b")
    if x["ground_truth"] == "sleep":
        time.sleep(1000)
    return {{"overall": float(len(calls))}}

def main(inputs):
    {body}
'''


@pytest.mark.parametrize("kind,body", [("sequential", SEQUENTIAL_BODY), ("batch", BATCH_BODY)])
@pytest.mark.parametrize("hang", ["regex", "sleep"])
def test_a_call_that_never_returns_fails_naming_function_and_sample(tmp_path, kind, body, hang):
    fn = load_reward_function(write(tmp_path, "hangs.py", HANGING_FILE.format(kind=kind, body=body)), call_timeout=0.5)
    start = time.perf_counter()
    with pytest.raises(RewardError) as caught:
        fn([sample("a", "1"), sample("the slow one", hang), sample("c", "3")])
    text = str(caught.value)
    assert "'hangs.py:main' did not return within worker.reward.call_timeout=0.5 s" in text
    where = "on a batch of 3 inputs" if kind == "batch" else f"on sample 1 (ground_truth={hang!r}, response starts"
    assert where in text
    assert time.perf_counter() - start < 5.0
    # the reward process was replaced; its state (calls) persists between calls, as in EasyR1's worker
    assert fn([sample("a", "1")]) == [{"overall": 1.0}]
    assert fn([sample("a", "1")]) == [{"overall": 2.0}]
    fn.close()


def test_a_slow_batch_that_no_sample_slows_alone(tmp_path):
    text = "import time\ndef main(xs):\n    time.sleep(0.3 * len(xs))\n    return [{'overall': 0.0} for x in xs]\n"
    fn = load_reward_function(write(tmp_path, "slow.py", text), call_timeout=0.5)
    with pytest.raises(RewardError, match="'slow.py:main' did not return within .*0.5 s.* on a batch of 2 inputs"):
        fn([sample("a", "1"), sample("b", "2")])


def test_builtins_grade_in_the_reward_process():
    """The math grader's own timeouts use SIGALRM, which works in the reward process's main thread."""
    fn = load_reward_function("math", call_timeout=30)
    assert fn([sample("<think>x</think> \\boxed{\\frac{1}{2}}", "0.5"), sample("\\boxed{3}", "4")]) == [
        {"overall": 1.0, "format": 1.0, "accuracy": 1.0}, {"overall": 0.0, "format": 0.0, "accuracy": 0.0}]
    fn.close()


def test_a_raise_in_the_reward_process_keeps_its_traceback(tmp_path):
    fn = load_reward_function(write(tmp_path, "raises.py", "def main(xs):\n    return [{'overall': 1 / 0}]\n"),
                              call_timeout=30)
    with pytest.raises(RewardError, match="'raises.py:main' raised ZeroDivisionError: division by zero "
                                          "on a batch of 1 inputs") as caught:
        fn([sample("a", "1")])
    assert "raises.py\", line 2, in main" in str(caught.value.__cause__)
    with pytest.raises(RewardError, match="call_timeout=0: give a number of seconds > 0 and at most 1e6, or null"):
        load_reward_function("math", call_timeout=0)


def alive(pid):
    """pid runs (a zombie, ended but not yet reaped by its parent, counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def ends_within(pid, seconds):
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if alive(pid):  # leave nothing behind, then fail
        os.kill(pid, signal.SIGKILL)
        return False
    return True


STARTS_A_PROCESS = '''
import subprocess, time
REWARD_TYPE = "sequential"

def main(x, pid_file):
    child = subprocess.Popen(["sleep", "60"])  # e.g. a sandbox that runs the response's code
    with open(pid_file, "w") as f:
        f.write(str(child.pid))
    time.sleep(1000)
'''


def test_a_timeout_also_stops_what_the_reward_function_started(tmp_path):
    pid_file = tmp_path / "pid"
    fn = load_reward_function(write(tmp_path, "starts.py", STARTS_A_PROCESS), call_timeout=1, pid_file=str(pid_file))
    with pytest.raises(RewardError, match="did not return within"):
        fn([sample("a", "1")])
    assert ends_within(int(pid_file.read_text()), 5.0)


def test_the_reward_process_ends_with_the_trainer(tmp_path):
    """A trainer that dies without clean-up (the OOM killer, SIGKILL) leaves no reward process waiting forever."""
    pid_file = tmp_path / "pid"
    script = textwrap.dedent(f'''
        import os, reward
        fn = reward.load_reward_function("toy", call_timeout=30)
        assert fn([{{"response": "red", "ground_truth": "red", "response_length": 1}}])[0]["overall"] == 1.0
        open({str(pid_file)!r}, "w").write(str(fn._worker[0].pid))
        os._exit(0)
    ''')
    subprocess.run([sys.executable, "-c", script], cwd=os.path.dirname(reward.__file__), timeout=120, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert ends_within(int(pid_file.read_text()), 5.0)


HANGS = '''
import os, time
REWARD_TYPE = "sequential"

def main(x, pid_file):
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(1000)
'''


@pytest.mark.parametrize("name,source", [("hangs.py", HANGS), ("starts.py", STARTS_A_PROCESS)])
def test_a_trainer_killed_during_a_call_takes_the_reward_process_and_what_it_started(tmp_path, name, source):
    """SIGKILL reaches the trainer while the reward function hangs (no pipe read to notice the trainer is gone) or
    waits on a process it started (a sandbox): the process whose pid the function wrote ends too. hangs.py: the
    reward process, killed with the trainer (PR_SET_PDEATHSIG); starts.py: its child, which would outlive it."""
    pid_file = tmp_path / "pid"
    script = textwrap.dedent(f'''
        import reward
        fn = reward.load_reward_function({write(tmp_path, name, source)!r}, call_timeout=300,
                                         pid_file={str(pid_file)!r})
        fn([{{"response": "red", "ground_truth": "red", "response_length": 1}}])
    ''')
    trainer = subprocess.Popen([sys.executable, "-c", script], cwd=os.path.dirname(reward.__file__),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        written = int(pid_file.read_text())
    finally:
        trainer.kill()
        trainer.wait()
    assert ends_within(written, 5.0)


def test_a_function_that_uses_torch_after_the_trainer_did_still_returns(tmp_path):
    """The reward process is forked after torch's OpenMP threads ran (here: at the file's import, in this
    process); a parallel op in the fork then waited on threads that do not exist there, until the call timed out.
    Two threads at least: with one (OMP_NUM_THREADS=1, as the suite runs) no thread pool exists to wait on."""
    import torch

    text = ("import torch\ntorch.nn.Linear(512, 512)(torch.randn(64, 512))\n"
            "def main(xs):\n    torch.nn.Linear(512, 512)(torch.randn(64, 512))\n"
            "    return [{'overall': 1.0} for x in xs]\n")
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, 2))
    try:
        fn = load_reward_function(write(tmp_path, "uses_torch.py", text), call_timeout=10)
        assert fn([sample("a", "1")]) == [{"overall": 1.0}]
        fn.close()
    finally:
        torch.set_num_threads(threads)


def test_a_function_may_start_a_process_pool(tmp_path):
    """Python forbids a daemonic process children, and the reward process was one: a Pool inside the function
    (a parallel grader) raised 'daemonic processes are not allowed to have children'."""
    text = ("import multiprocessing\ndef square(x):\n    return x * x\n"
            "def main(xs):\n    with multiprocessing.get_context('fork').Pool(2) as pool:\n"
            "        return [{'overall': float(v)} for v in pool.map(square, range(len(xs)))]\n")
    fn = load_reward_function(write(tmp_path, "pool.py", text), call_timeout=30)
    assert fn([sample("a", "1")] * 3) == [{"overall": 0.0}, {"overall": 1.0}, {"overall": 4.0}]
    fn.close()


@pytest.mark.parametrize("call_timeout", [float("inf"), 1e12, 0, -1, float("nan")])
def test_a_call_timeout_out_of_range_is_refused_at_load(call_timeout):
    """inf passed the old check (> 0) and crashed the first call with OverflowError from the pipe's poll."""
    with pytest.raises(RewardError, match=r"worker.reward.call_timeout=.*at most 1e6, or null for no limit"):
        load_reward_function("math", call_timeout=call_timeout)


def test_a_function_that_calls_sys_exit_is_an_error_not_the_end_of_the_trainer(tmp_path):
    """Without a reward process, sys.exit (argparse in a helper) ended the trainer with exit code 0 and no word."""
    fn = load_reward_function(write(tmp_path, "exits.py", "import sys\ndef main(xs):\n    sys.exit(0)\n"))
    with pytest.raises(RewardError, match="'exits.py:main' raised SystemExit: 0 on a batch of 1 inputs"):
        fn([sample("a", "1")])


def test_a_collected_reward_function_stops_its_process():
    """The exit hook that closes the reward process holds the RewardFunction weakly: a strong one kept every
    RewardFunction alive, so dropping one no longer stopped its process."""
    import gc

    fn = load_reward_function("math", call_timeout=30)
    fn([sample("\\boxed{1}", "1")])
    pid = fn._worker[0].pid
    del fn
    gc.collect()
    assert ends_within(pid, 5.0)


def test_a_reward_process_killed_between_calls_is_started_again():
    """Killed while idle (the OOM killer, an operator), the reward process is replaced at the next call; a send to
    the dead one read as an input that cannot be pickled."""
    fn = load_reward_function("math", call_timeout=30)
    fn([sample("\\boxed{1}", "1")])
    process = fn._worker[0]
    os.kill(process.pid, signal.SIGKILL)
    process.join()
    assert fn([sample("\\boxed{2}", "2")])[0]["accuracy"] == 1.0 and fn._worker[0].pid != process.pid
    fn.close()
