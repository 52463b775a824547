"""The toy tasks' reward, a reward file in EasyR1's format:

    worker.reward.reward_function: configs/toy_reward.py:compute_score

format   = 1 if the response is exactly one <answer>...</answer> (nothing before or after, no tag repeated inside;
           EOS is not part of the decoded response), else 0
accuracy = 1 if the content of the first <answer>...</answer> (the whole response when there is none), stripped,
           equals the ground truth, else 0
overall  = (1 - format_weight) * accuracy + format_weight * format

EasyR1's r1v.py without the <think> part (a two-layer model has nothing to think about) and with an exact
string match instead of a math grader (the answers are colour words and small numbers; the grader takes
~15 ms to reject a word).
"""

import re

REWARD_TYPE = "sequential"
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def compute_score(reward_input, format_weight=0.5):
    response = reward_input["response"]
    one_block = response.count("<answer>") == response.count("</answer>") == 1  # not <answer>red</answer></answer>
    form = 1.0 if one_block and ANSWER.fullmatch(response) else 0.0
    found = ANSWER.search(response)
    answer = (found.group(1) if found else response).strip()
    accuracy = 1.0 if answer == str(reward_input["ground_truth"]).strip() else 0.0
    return {"overall": (1 - format_weight) * accuracy + format_weight * form, "format": form, "accuracy": accuracy}
