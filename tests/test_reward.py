"""reward.py: the built-in scorers on tables of tricky cases, loading EasyR1-format reward files, and
the errors a broken reward function produces. Expected values are written out by hand."""

import random
import re
import textwrap
import threading
import time
import traceback as tb

import pytest

import reward
from reward import RewardError, load_reward_function


def sample(response, ground_truth, response_length=None, **extra):
    return {"response": response,
            "response_length": len(response.split()) if response_length is None else response_length,
            "ground_truth": ground_truth, "prompt": "Solve it.", "extra": extra}


LONG = "<think>" + "Let me think. " * 714 + "</think> so \\boxed{7}"  # 10,000+ characters

# (response, ground truth, format, accuracy)
MATH_CASES = [
    ("<think>half</think> The answer is \\boxed{\\frac{1}{2}}.", "0.5", 1, 1),
    ("<think>half</think> \\boxed{0.5}", "\\frac{1}{2}", 1, 1),
    ("<think>half</think> \\boxed{1/2}", "\\frac{1}{2}", 1, 1),
    ("<think>d</think> \\boxed{\\dfrac{3}{4}}", "0.75", 1, 1),
    ("<think>d</think> \\boxed{\\dfrac34}", "\\frac{3}{4}", 1, 1),
    ("<think>nested</think> \\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{\\sqrt2}{2}", 1, 1),
    ("<think>set</think> \\boxed{\\{1, 2\\}}", "\\{2,1\\}", 1, 1),
    ("<think>a</think> first \\boxed{3}, on reflection \\boxed{4}", "4", 1, 1),     # the LAST box counts
    ("<think>a</think> first \\boxed{4}, on reflection \\boxed{3}", "4", 1, 0),
    ("<think>units</think> \\boxed{3\\text{ cm}}", "3", 1, 1),
    ("<think>deg</think> \\boxed{60^{\\circ}}", "60", 1, 1),
    ("<think>eq</think> \\boxed{x = 3}", "3", 1, 1),
    ("<think>r</think> \\boxed{2\\sqrt{3}}", "\\sqrt{12}", 1, 1),
    ("<think>w</think> \\boxed{5}", "6", 1, 0),
    ("< think > spaced tags </ think >\n\\boxed{5}", "5", 1, 1),                     # whitespace in tags
    ("\n  <think>\nlines\n</think>\n\n\\boxed{5}\n", "5", 1, 1),                      # around the response
    ("<think>a</think>\\boxed{5}\n", "5", 1, 1),                                     # trailing newline: .* takes it
    ("x <think>a</think>\\boxed{5}", "5", 0, 1),                                      # text before <think>
    ("<think><think>a</think></think>\\boxed{5}", "5", 1, 1),                         # nested tags
    ("<think>a</think>\\boxed{1 / 2}", "0.5", 1, 1),                                  # tidied to 1/2
    ("\\boxed{5}", "5", 0, 1),                                                        # no think tags
    ("<think>x</think> 5", "5", 0, 0),                                                # no box
    ("5", "5", 0, 0),                                                                 # no box: no answer at all
    ("<think>x</think> \\boxed{3} and then \\boxed{4", "4", 1, 0),                    # last box never closes
    ("<think>no end tag \\boxed{5}", "5", 0, 1),
    ("", "5", 0, 0),                                                                  # empty response
    ("<think>x</think> \\boxed{}", "5", 1, 0),                                        # empty box
    (LONG, "7", 1, 1),
]


@pytest.mark.parametrize("response,truth,form,acc", MATH_CASES)
def test_math_table(response, truth, form, acc):
    got = reward.math_reward(sample(response, truth))
    assert got == {"overall": 0.9 * acc + 0.1 * form, "format": float(form), "accuracy": float(acc)}


def test_math_format_weight_and_long_response_length():
    assert len(LONG) > 10_000
    got = reward.math_reward(sample("\\boxed{5}", "5"), format_weight=0.5)
    assert got["overall"] == 0.5


MATH_REGEX = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)  # EasyR1's definition, after its tidy:


def easyr1_math_format(text):
    return float(bool(MATH_REGEX.fullmatch(re.sub(r"\s*(<|>|/)\s*", r"\1", text))))


@pytest.mark.parametrize("text", [
    "<think></think>\\boxed{}", "<think>a</think>b\\boxed{c}d", "<think>\\boxed{1}</think>", "<think>a</think>\\boxed{",
    "x<think>a</think>\\boxed{1}", "<think>a</think></think>\\boxed{}}", "<think>\\boxed{</think>}",
    "</think><think>\\boxed{1}", "<think>a</think>}\\boxed{", "<think>a</think> \\boxed{\\boxed{} x",
    " \n<think>a</think>\\boxed{1}\n", "x <think>a</think>\\boxed{1}", "< think >a< / think >\\boxed{1}",
    "<think>a</thi nk>\\boxed{1}", "<think>a<\n/think>\\boxed{1} ", "\\boxed{1}<think>a</think>",
    "<think>a</think>\\boxed {1}", "<think>a</think>\\boxed{1}</think>", "\t<think>\n</think>\n\\boxed{x > 1}",
])
def test_math_format_equals_easyr1(text):
    """The linear-time format check agrees with EasyR1's: its tidy, then the fullmatch regex."""
    assert reward.math_reward(sample(text, "0"))["format"] == easyr1_math_format(text)


def test_tidy_is_easyr1s_substitution():
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice(" \n\t\u00a0<>/ab") for _ in range(rng.randrange(12)))
        assert reward.tidy(text) == re.sub(r"\s*(<|>|/)\s*", r"\1", text), repr(text)
    start = time.perf_counter()
    assert reward.tidy(" " * 200_000 + "a < b") == " " * 200_000 + "a<b"  # EasyR1's regex: minutes
    assert time.perf_counter() - start < 2.0


def test_math_degenerate_long_response_is_fast():
    """Repeated tags with no closing brace: a backtracking regex would take minutes here."""
    text = "<think>" + "</think>\\boxed{" * 800
    start = time.perf_counter()
    assert reward.math_reward(sample(text, "1")) == {"overall": 0.0, "format": 0.0, "accuracy": 0.0}
    assert time.perf_counter() - start < 2.0


@pytest.mark.parametrize("answer,truth,expected", [
    ("\\frac{1}{2}", "0.5", True), ("0.5", "1/2", True), ("\\dfrac{1}{2}", "\\frac12", True), ("1,000", "1000", True),
    ("4.0", "4", True), ("x^2+2x+1", "(x+1)^2", True), ("\\frac{1}{3}", "0.333", False), ("", "", False),
    ("abc", "abc", True), ("}{", "3", False), ("\\pi", "3.14159", False),
    ("(-\\infty,2]", "a \\le 2", True),  # math-verify is asymmetric here: the ground truth comes first
])
def test_is_equivalent(answer, truth, expected):
    assert reward.is_equivalent(answer, truth) is expected


def test_pathological_expression_times_out_as_wrong():
    """9^(9^9) has 370 million digits: without the timeout the comparison would run for a very long time (then
    faulthandler ends the test run after 120 s, with the stack, rather than let it hang)."""
    import faulthandler

    start = time.perf_counter()
    faulthandler.dump_traceback_later(120, exit=True)
    try:
        assert reward.is_equivalent("9^{9^{9}}", "1", timeout=1) is False
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert time.perf_counter() - start < 10.0


def test_grader_outside_the_main_thread_is_a_clear_error():
    errors = []
    worker = threading.Thread(target=lambda: errors.append(_catch(reward.is_equivalent, "0.5", "\\frac12")))
    worker.start()
    worker.join()
    assert "main thread" in str(errors[0])
    results = []
    worker = threading.Thread(target=lambda: results.append(reward.is_equivalent("0.5", "\\frac12", timeout=0)))
    worker.start()
    worker.join()
    assert results == [True]  # timeout=0: no SIGALRM, so it works in any thread


def _catch(fn, *args):
    try:
        fn(*args)
    except Exception as e:
        return e


R1V_CASES = [  # (response, ground truth, format, accuracy)
    ("<think>a</think><answer>5</answer>", "5", 1, 1),
    ("<think>a</think>\n\n<answer> \\frac{1}{2} </answer>", "0.5", 1, 1),
    ("<think>a</think><answer>\n12\n</answer>", "12", 1, 1),                       # multi-line answer
    ("< think >a</ think > < answer >5</answer >", "5", 0, 0),                       # raw: no tidying of tags
    ("<think>a</think><answer>5</answer>\n", "5", 0, 1),                            # newline after </answer>
    ("<think>a</think><answer>5</answer> ", "5", 0, 1),
    ("  <think>a</think><answer>5</answer>", "5", 0, 1),                             # leading spaces
    ("<think>a</think> \n <answer>5</answer>", "5", 1, 1),                           # white space between: \s*
    ("<think><think>a</think></think><answer>5</answer>", "5", 1, 1),               # nested think
    ("<think>a</think><answer>5</answer><answer>6</answer>", "5", 1, 1),            # the first answer counts
    ("<think>a</think><answer>5</answer> trailing", "5", 0, 1),                      # text after the answer
    ("<answer>5</answer>", "5", 0, 1),                                               # no think
    ("<think>a</think><answer>6</answer>", "5", 1, 0),
    ("5", "5", 0, 1),                                                                # no tags: whole response
    ("", "5", 0, 0),
    ("<think>" + "x " * 5000 + "</think><answer>7</answer>", "7", 1, 1),
]


@pytest.mark.parametrize("response,truth,form,acc", R1V_CASES)
def test_r1v_table(response, truth, form, acc):
    got = reward.r1v_reward(sample(response, truth))
    assert got == {"overall": 0.5 * acc + 0.5 * form, "format": float(form), "accuracy": float(acc)}


def test_r1v_format_equals_easyr1():
    """The linear-time format check agrees with EasyR1's r1v.py fullmatch on random tag soups."""
    easyr1 = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)
    rng, parts = random.Random(0), ["<think>", "</think>", "<answer>", "</answer>", " ", "\n", "a", "<", "/"]
    for _ in range(5000):
        text = "".join(rng.choice(parts) for _ in range(rng.randrange(9)))
        assert reward.r1v_reward(sample(text, "zz"), timeout=0)["format"] == float(bool(easyr1.fullmatch(text))), text


def test_r1v_degenerate_long_response_is_fast():
    """Repeated complete tag pairs then one stray character: EasyR1's lazy fullmatch retries every </answer> for
    every </think><answer>, quadratic (6,000 pairs, 192k characters: ~9 s)."""
    text = "<think></think><answer></answer>" * 6000 + "x"
    start = time.perf_counter()
    assert reward.r1v_reward(sample(text, "1"), timeout=0) == {"overall": 0.0, "format": 0.0, "accuracy": 0.0}
    assert time.perf_counter() - start < 2.0


@pytest.mark.parametrize("raw,normalized", [
    ("1,000", "1000"), ("\\boxed{5}", "5"), ("$\\frac12$", "\\frac{1}{2}"), ("x = 7", "7"), ("5 degrees", "5"),
    ("\\text{(B)}", "(B)"), ("\\sqrt2", "\\sqrt{2}"), ("10^{\\circ}", "10"), ("an apple", "apple"), ("12 cm", "12"),
    ("The answer is $42$ dollars", "42"), ("(1, 2)", "(1,2)"), ("1,2", "12"), ("$1$ or $2$", "1"),
])
def test_minerva_normalize(raw, normalized):
    assert reward.minerva_normalize(raw) == normalized


DAPO_KW = {"max_response_length": 100, "overlong_buffer_length": 20, "overlong_penalty_factor": 0.5}


@pytest.mark.parametrize("response,truth,acc", [
    ("work... Answer: 1,000", "1000", 1), ("Answer: \\boxed{5}", "5", 1), ("answer : $\\frac12$", "\\frac{1}{2}", 1),
    ("Answer: 3\nmore text\nAnswer: 4", "4", 1), ("Answer: 4\nAnswer: 3", "4", -1), ("no marker 4", "4", -1),
    ("Answer: 4" + " " * 300, "4", -1),                          # outside the last 300 characters
    ("x" * 10_000 + "Answer: 4", "4", 1), ("", "4", -1), ("Answer: 5 degrees", "5", 1),
    ("Answer: 1000", "1,000", 1),                                # the ground truth is normalised too
    ("Answer: \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1), ("Answer: \\sqrt2", "\\sqrt{2}", 1),
])
def test_dapo_accuracy(response, truth, acc):
    got = reward.dapo_reward(sample(response, truth, response_length=10), **DAPO_KW)
    assert got == {"overall": acc, "accuracy": acc, "overlong": 0.0, "accuracy_normalized": (acc + 1) / 2}
    if truth.isdigit():  # a number given as one (by a caller other than data.py) is compared as its text
        assert reward.dapo_reward(sample(response, int(truth), response_length=10), **DAPO_KW) == got


@pytest.mark.parametrize("length,overlong", [(0, 0.0), (80, 0.0), (81, -0.05), (90, -0.5), (100, -1.0), (101, -1.0),
                                             (5000, -1.0)])
def test_dapo_overlong_penalty(length, overlong):
    got = reward.dapo_reward(sample("Answer: 4", "4", response_length=length), **DAPO_KW)
    assert got["overlong"] == pytest.approx(overlong, abs=1e-12)
    assert got["overall"] == pytest.approx(1.0 + 0.5 * overlong, abs=1e-12)


def test_dapo_overlong_buffer_bounds():
    """L_buf = 0: -1 as soon as L > L_max (EasyR1: L <= 100 -> 0, else -1); a buffer outside [0, L_max] is an error
    (EasyR1, L_buf = 120 > L_max = 100, penalises an empty response: (100 - 120 - 0) / 120 = -1/6)."""
    no_buffer = {**DAPO_KW, "overlong_buffer_length": 0}
    assert [reward.dapo_reward(sample("Answer: 4", "4", response_length=n), **no_buffer)["overlong"]
            for n in (0, 100, 101)] == [0.0, 0.0, -1.0]
    part = {**DAPO_KW, "overlong_buffer_length": 0.5}  # EasyR1: (99.5 - 100) / 0.5 = -1 (was -0.5: divided by 1)
    assert reward.dapo_reward(sample("Answer: 4", "4", response_length=100), **part)["overlong"] == -1.0
    for buffer in (-1, 120):
        with pytest.raises(RewardError, match="overlong_buffer_length"):
            load_reward_function("dapo", **{**DAPO_KW, "overlong_buffer_length": buffer})([sample("Answer: 4", "4")])


def test_dapo_needs_its_kwargs_at_load_time():
    with pytest.raises(RewardError, match="max_response_length"):
        load_reward_function("dapo")
    scores = load_reward_function("dapo", **DAPO_KW)([sample("Answer: 4", "4", response_length=90)])
    assert scores == [{"overall": 0.75, "accuracy": 1.0, "overlong": -0.5, "accuracy_normalized": 1.0}]


@pytest.mark.parametrize("response,truth,form,acc", [
    ("red", "red", 1, 1), ("Red.", "red", 1, 1), ("  blue green", "blue", 1, 1), ("blue", "red", 1, 0),
    ("7", "7", 1, 1), ("8, surely", "7", 1, 0), ("hello red", "red", 0, 0), ("", "red", 0, 0), ("7!", "7", 1, 1),
    ("purple", "purple", 0, 1), ("red " * 2500, "red", 1, 1), ("", "", 0, 0),  # nothing is never right
])
def test_toy_table(response, truth, form, acc):
    got = reward.toy_reward(sample(response, truth))
    assert got == {"overall": 0.9 * acc + 0.1 * form, "format": float(form), "accuracy": float(acc)}


# ---------------------------------------------------------------------------------------------------
# Loading reward files written for EasyR1.

SEQUENTIAL_FILE = '''
REWARD_NAME = "length"
REWARD_TYPE = "sequential"

def compute_score(reward_input, bonus=0.0):
    assert isinstance(reward_input, dict)
    hit = float(reward_input["response"].strip() == reward_input["ground_truth"])
    return {"overall": hit + bonus, "accuracy": hit, "difficulty": reward_input["extra"].get("difficulty", 0)}
'''

BATCH_FILE = '''
from dataclasses import dataclass

@dataclass
class Counter:
    n: int = 0

def main(reward_inputs, scale=1.0):
    assert isinstance(reward_inputs, list)
    return [{"overall": scale * x["response_length"], "prompt_chars": len(x["prompt"])} for x in reward_inputs]
'''


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_sequential_file_with_kwargs_and_extra_columns(tmp_path):
    fn = load_reward_function(write(tmp_path, "seq.py", SEQUENTIAL_FILE) + ":compute_score", bonus=0.25)
    assert (fn.name, fn.reward_type) == ("seq.py:compute_score", "sequential")
    got = fn([sample("4", "4", difficulty=3), sample("5", "4")])
    assert got == [{"overall": 1.25, "accuracy": 1.0, "difficulty": 3.0},
                   {"overall": 0.25, "accuracy": 0.0, "difficulty": 0.0}]


def test_batch_file_defaults_to_main_and_batch(tmp_path):
    fn = load_reward_function(write(tmp_path, "batch.py", BATCH_FILE), scale=0.5)
    assert (fn.name, fn.reward_type) == ("batch.py:main", "batch")
    assert fn([sample("a b c", "x"), sample("a", "x")]) == [{"overall": 1.5, "prompt_chars": 9.0},
                                                            {"overall": 0.5, "prompt_chars": 9.0}]
    assert load_reward_function(write(tmp_path, "b2.py", BATCH_FILE) + ":")([sample("a", "x")])[0]["overall"] == 1.0


def test_builtin_names_and_kwargs():
    fn = load_reward_function("math", format_weight=0.5)
    assert (fn.name, fn.reward_type) == ("math", "sequential")
    assert fn([sample("\\boxed{2}", "2")]) == [{"overall": 0.5, "format": 0.0, "accuracy": 1.0}]
    assert load_reward_function("toy")([sample("red", "red")]) == [{"overall": 1.0, "format": 1.0, "accuracy": 1.0}]
    assert load_reward_function("r1v")([sample("<answer>2</answer>", "2")])[0]["overall"] == 0.5


@pytest.mark.parametrize("spec_tail,kwargs,message", [
    (":nope", {}, "has no function 'nope' .*compute_score"),
    (":compute_score", {"bonsu": 1}, "cannot be called with the keyword arguments \\['bonsu'\\]"),
])
def test_load_errors(tmp_path, spec_tail, kwargs, message):
    with pytest.raises(RewardError, match=message):
        load_reward_function(write(tmp_path, "seq.py", SEQUENTIAL_FILE) + spec_tail, **kwargs)


def test_load_errors_for_paths_and_types(tmp_path):
    with pytest.raises(RewardError, match="does not exist"):
        load_reward_function(str(tmp_path / "missing.py:main"))
    with pytest.raises(RewardError, match="neither a built-in"):
        load_reward_function("maths")
    with pytest.raises(RewardError, match="REWARD_TYPE = 'stream'"):
        load_reward_function(write(tmp_path, "t.py", "REWARD_TYPE = 'stream'\ndef main(x):\n    return x\n"))


# ---------------------------------------------------------------------------------------------------
# Broken reward functions: every failure names the function and the sample.

BROKEN = '''
REWARD_TYPE = "{kind}"
import math

def score(x):
    if x["ground_truth"] == "raise":
        raise KeyError("answer")
    value = {{"nan": math.nan, "inf": math.inf, "text": "high", "numeric_text": "1.0", "huge_int": 10**400}}.get(
        x["ground_truth"], 1.0)
    out = {{"overall": value, "accuracy": 1.0}}
    if x["ground_truth"] == "no_overall":
        del out["overall"]
    return out

def main(inputs):
    {body}
'''
SEQUENTIAL_BODY = "return score(inputs)"
BATCH_BODY = "return [score(x) for x in inputs]"


@pytest.mark.parametrize("kind,body", [("sequential", SEQUENTIAL_BODY), ("batch", BATCH_BODY)])
@pytest.mark.parametrize("bad,message", [
    ("raise", "raised KeyError: 'answer'"), ("nan", "returned 'overall' = nan"), ("inf", "returned 'overall' = inf"),
    ("no_overall", "without 'overall'"), ("text", "'overall' = 'high', which is not a number"),
    ("numeric_text", "'overall' = '1.0', which is not a number"), ("huge_int", "which is not a number"),
])
@pytest.mark.parametrize("call_timeout", [None, 30])
def test_bad_reward_function_names_function_and_sample(tmp_path, kind, body, bad, message, call_timeout):
    fn = load_reward_function(write(tmp_path, "broken.py", BROKEN.format(kind=kind, body=body)),
                              call_timeout=call_timeout)
    inputs = [sample("fine", "1"), sample("fine too", "2"), sample("the bad one " + "z" * 300, bad)]
    with pytest.raises(RewardError) as caught:
        fn(inputs)
    text = str(caught.value)
    if kind == "batch" and bad == "raise":  # a raise inside the batch call: the batch, with the traceback chained
        assert "'broken.py:main' raised KeyError: 'answer' on a batch of 3 inputs" in text
        traceback_text = "".join(tb.format_exception(caught.value.__cause__))
        assert 'raise KeyError("answer")' in traceback_text
        return
    assert "'broken.py:main'" in text and message in text and "sample 2" in text
    assert f"ground_truth={bad!r}" in text and "the bad one zz" in text
    assert "z" * 200 not in text  # only the head of the response


def test_batch_function_with_wrong_length_or_type(tmp_path):
    short = load_reward_function(write(tmp_path, "short.py", "def main(xs):\n    return [{'overall': 1.0}]\n"))
    with pytest.raises(RewardError, match="'short.py:main' .*returned 1 results for 3 inputs"):
        short([sample("a", "1")] * 3)
    extra = load_reward_function(write(tmp_path, "extra.py", "def main(xs):\n    return [{'overall': 1.0}] * 3\n"))
    with pytest.raises(RewardError, match="'extra.py:main' .*returned 3 results for 2 inputs"):  # one score too many
        extra([sample("a", "1")] * 2)
    single = load_reward_function(write(tmp_path, "single.py", "def main(xs):\n    return {'overall': 1.0}\n"))
    with pytest.raises(RewardError, match="returned dict for 2 inputs"):
        single([sample("a", "1")] * 2)
    not_dict = load_reward_function(write(tmp_path, "nd.py", "def main(xs):\n    return [1.0 for x in xs]\n"))
    with pytest.raises(RewardError, match="returned float, not a dict of floats on sample 0"):
        not_dict([sample("a", "1")])


@pytest.mark.parametrize("call_timeout", [None, 30])
def test_a_failed_batch_is_not_called_again_sample_by_sample(tmp_path, call_timeout):
    """A batch function that raises is reported for the batch, called once: a retry per sample would repeat its
    side effects (a paid request per sample) and report the retry's error, not the batch's."""
    calls = tmp_path / "calls.txt"
    text = (f"def main(xs):\n    open({str(calls)!r}, 'a').write(f'{{len(xs)}}\\n')\n"
            f"    assert len(xs) == 1, 'expected one'\n    return [{{'overall': 0.0}}]\n")
    fn = load_reward_function(write(tmp_path, "pair.py", text), call_timeout=call_timeout)
    with pytest.raises(RewardError, match="'pair.py:main' raised AssertionError: expected one on a batch of 2 inputs"):
        fn([sample("a", "1"), sample("b", "2")])
    assert calls.read_text() == "2\n"
    fn.close()


CHANGES_ITS_INPUT = '''
REWARD_TYPE = "{kind}"

def score(x):
    x["extra"]["seen"] = x["extra"].get("seen", 0) + 1
    x["response"] = "changed"
    return {{"overall": float(x["extra"]["seen"])}}

def main(inputs):
    {body}
'''


@pytest.mark.parametrize("kind,body", [("sequential", SEQUENTIAL_BODY), ("batch", BATCH_BODY)])
@pytest.mark.parametrize("call_timeout", [None, 30])
def test_a_function_that_changes_its_input_changes_no_other_sample(tmp_path, kind, body, call_timeout):
    """Every call gets its own copy of the inputs, with or without a reward process: the n responses of a
    prompt share its extra dict, and a change made while scoring one must not reach the next."""
    fn = load_reward_function(write(tmp_path, "changes.py", CHANGES_ITS_INPUT.format(kind=kind, body=body)),
                              call_timeout=call_timeout)
    extra = {"difficulty": 2}
    inputs = [{**sample("a", "1"), "extra": extra}, {**sample("b", "1"), "extra": extra}]
    assert fn(inputs) == [{"overall": 1.0}, {"overall": 1.0}]
    assert extra == {"difficulty": 2} and [x["response"] for x in inputs] == ["a", "b"]
    fn.close()


def test_a_reward_file_that_fails_to_load_is_a_reward_error_naming_it(tmp_path):
    """A syntax error, or a package the file imports that is not installed (EasyR1's example files import
    mathruler), is a one-line RewardError naming the file (it was a raw traceback)."""
    with pytest.raises(RewardError, match=r"syntax.py failed to load: SyntaxError"):
        load_reward_function(write(tmp_path, "syntax.py", "def main(xs)\n    return xs\n") + ":main")
    with pytest.raises(RewardError,
                       match=r"needs.py failed to load: ModuleNotFoundError: No module named 'mathrulerx'"):
        load_reward_function(write(tmp_path, "needs.py", "import mathrulerx\ndef main(xs):\n    return xs\n"))


def test_a_reward_file_imports_its_sibling_files(tmp_path):
    """Its folder is on the import path, as when the file runs as a script (appended: it shadows no module)."""
    write(tmp_path, "grading_helpers.py", "def grade(x):\n    return {'overall': 2.0}\n")
    fn = load_reward_function(write(tmp_path, "uses_helper.py", "REWARD_TYPE = 'sequential'\n"
                                    "from grading_helpers import grade\ndef main(x):\n    return grade(x)\n"))
    assert fn([sample("a", "1")]) == [{"overall": 2.0}]


def test_a_function_of_one_input_without_reward_type_gets_a_hint(tmp_path):
    """The default REWARD_TYPE is batch (EasyR1's): a function written for one input fails on the list with
    'list indices must be integers', which says nothing of REWARD_TYPE; the message now does."""
    fn = load_reward_function(write(tmp_path, "one.py",
                                    "def main(x):\n    return {'overall': float(x['ground_truth'] == '1')}\n"))
    with pytest.raises(RewardError, match=r"raised TypeError: list indices .* on a batch of 2 inputs "
                                          r"\(REWARD_TYPE batch, the default: one call with the list; "
                                          r"'sequential': one call per input\)"):
        fn([sample("a", "1"), sample("b", "2")])


def test_keys_that_are_not_strings_are_an_error_naming_the_sample(tmp_path):
    """A non-string key crashed the error path itself (sorted() of int and str keys): a bare TypeError."""
    fn = load_reward_function(write(tmp_path, "intkey.py",
                                    "def main(xs):\n    return [{'overall': 1.0, 0: 1.0} for x in xs]\n"))
    with pytest.raises(RewardError, match=r"returned keys \['overall', 0\]; they must be strings .* on sample 0"):
        fn([sample("a", "1")])


@pytest.mark.parametrize("timeout", [3e9, float("inf")])
def test_a_grader_timeout_beyond_what_sigalrm_takes_still_grades(timeout):
    """worker.reward.timeout above ~2.1e9 s overflowed SIGALRM's counter, and the error counted as 'not equal':
    every answer that was not the same string scored 0."""
    assert reward.math_reward({"response": "<think>a</think>\\boxed{\\frac{1}{2}}", "ground_truth": "0.5"},
                              timeout=timeout)["accuracy"] == 1.0


# ---------------------------------------------------------------------------------------------------
# Boundaries and rules the tables above leave open (each case fails on a plausible wrong version).

@pytest.mark.parametrize("raw,normalized", [
    ("\\overline{AB}", "AB"), ("\\textbf{C}", "C"), ("\\mbox{B}", "B"),       # wrappers dropped (mbox -> text first)
    ("x\\text{and}y", "x,y"), ("x,\\text{and}y", "x,y"), ("a dog", "dog"),    # "and" as a comma; the article "a "
    ("\t7\n", "7"),                                                             # white space other than " " stripped
    ("$5.$", "5"),                                                              # ".$" -> "$" before the $ go
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # the box's last brace, not its first inner one, closes it
    ("\\sqrt{2}", "\\sqrt{2}"),                   # already braced: left alone (\sqrt2 -> \sqrt{2} above)
])
def test_minerva_normalize_wrappers_articles_and_white_space(raw, normalized):
    assert reward.minerva_normalize(raw) == normalized


@pytest.mark.parametrize("spaces,acc", [(291, 1), (292, -1)])
def test_dapo_answer_window_is_exactly_the_last_300_characters(spaces, acc):
    # "Answer: 4" is 9 characters: with 291 spaces after it, it ends the last 300 (9 + 291); with 292 its "A" is
    # character 301 from the end and only "nswer: 4" is in the window.
    got = reward.dapo_reward(sample("x" * 500 + "Answer: 4" + " " * spaces, "4", response_length=10), **DAPO_KW)
    assert got["accuracy"] == acc


def test_dapo_buffer_as_long_as_the_limit_is_allowed():
    # L_buf = L_max = 100: the penalty starts at L = 0; L = 50 -> (100 - 100 - 50) / 100 = -0.5; L = 100 -> -1.
    kw = {**DAPO_KW, "overlong_buffer_length": 100}
    assert [reward.dapo_reward(sample("Answer: 4", "4", response_length=n), **kw)["overlong"]
            for n in (0, 50, 100)] == [0.0, -0.5, -1.0]


def test_r1v_answer_spans_lines_even_when_the_whole_response_would_not_grade():
    # <answer>\nB\n</answer>: the content "\nB\n" strips to "B" (exact match); the whole response is no "B".
    got = reward.r1v_reward(sample("<think>a</think><answer>\nB\n</answer>", "B"))
    assert got == {"overall": 1.0, "format": 1.0, "accuracy": 1.0}


def test_a_blank_answer_is_never_right_even_against_a_blank_ground_truth():
    assert reward.is_equivalent(" \n", " \n") is False and reward.is_equivalent("\t", "") is False


def test_toy_ground_truth_is_lowercased_too_and_brackets_and_quotes_are_stripped():
    assert reward.toy_reward(sample("RED", " Red ")) == {"overall": 1.0, "format": 1.0, "accuracy": 1.0}
    for response in ("(blue)", "[blue]", "{blue}", '"blue"', "'blue'"):
        assert reward.toy_reward(sample(response, "blue"))["overall"] == 1.0, response
    # the warm-started toy models answer in tags: the word is the tag's (it was '<answer>blue</answer>': 0)
    assert reward.toy_reward(sample("<answer>Blue</answer>", "blue"))["overall"] == 1.0
    assert reward.toy_reward(sample("<answer>7 red</answer> blue", "blue"))["accuracy"] == 0.0


@pytest.mark.parametrize("call_timeout", [None, 30])
def test_samples_may_return_other_keys_beside_overall(tmp_path, call_timeout):
    """A key of one task only (EasyR1's rewards may: its metrics average each key over the samples that have it)."""
    text = "def main(xs):\n    return [{'overall': 1.0, 'acc' if i == 0 else 'fmt': 0.5} for i, x in enumerate(xs)]\n"
    fn = load_reward_function(write(tmp_path, "per_task.py", text), call_timeout=call_timeout)
    assert fn([sample("a", "1"), sample("b", "2")]) == [{"overall": 1.0, "acc": 0.5}, {"overall": 1.0, "fmt": 0.5}]


def test_bytes_are_not_a_number(tmp_path):
    text = "def main(xs):\n    return [{'overall': b'1.0'} for x in xs]\n"
    fn = load_reward_function(write(tmp_path, "bytes.py", text))
    with pytest.raises(RewardError, match="returned 'overall' = b'1.0', which is not a number on sample 0"):
        fn([sample("a", "1")])


def test_grader_timeout_is_rounded_up_to_whole_seconds(monkeypatch):
    # timeout=1.5 -> ceil -> 2 s for each step (SIGALRM counts whole seconds); 0.2 -> at least 1.
    seen = []
    monkeypatch.setattr(reward, "parse", lambda text, parsing_timeout: seen.append(parsing_timeout) or [text])
    monkeypatch.setattr(reward, "verify", lambda gold, guess, timeout_seconds: seen.append(timeout_seconds) or False)
    reward.is_equivalent("1", "2", timeout=1.5)
    reward.is_equivalent("1", "2", timeout=0.2)
    assert seen == [2, 2, 2, 1, 1, 1]
