"""Validation (trainer.Run.validate) with fake workers and a fake scorer: what it draws, logs and reports. Every
expected number is worked out by hand in the test."""

import types

import pytest

from test_loop import bare_run


def test_validation_over_several_batches_draws_new_streams_for_each():
    """Two val batches (3 prompts, then 1; a response each of lengths 1, 2, 3 and 4, scored 1, 0, 0, 1): the metrics
    are over all four responses, and each batch gets its own seed. Sample j of prompt i draws from derive_seed(seed,
    i, j), so one seed for both batches made prompt 0 of the second batch replay the stream of prompt 0 of the first."""
    run, seeds = val_run("trainer.val_generations_to_log=0")
    metrics = run.validate()
    assert metrics["val/reward_score"] == metrics["val/overall_reward"] == 0.5
    assert (metrics["val_response_length/mean"], metrics["val_response_length/max"]) == (2.5, 4)
    assert len(seeds) == 2 and seeds[0] != seeds[1]
    assert run.validate() and seeds[2:] == seeds[:2]  # the same streams at every validation: comparable scores


@pytest.mark.parametrize("override, n", [("{temperature: 0}", 1), ("{temperature: 0.6, n: 3}", 3)])
def test_validation_draws_one_response_a_prompt_unless_val_override_config_sets_n(override, n):
    """As EasyR1 means it (val_override_config.get("n", 1)); the training n made a greedy validation n times the
    work."""
    run, asked = val_run(f"worker.rollout.val_override_config={override}", "worker.rollout.n=5", record="n")
    run.validate()
    assert asked == [n, n]


def test_validation_generates_from_synced_weights_and_puts_the_engine_to_sleep_after():
    """validate() runs after a step's update (and on a resume before any step): the engine gets the actor's weights
    before its first generation, else it scores the policy of the last sync; it sleeps after its last generation,
    freeing its memory for the checkpoint saved next and the next step's passes."""
    run = val_run("trainer.val_generations_to_log=0")[0]
    calls, generate = [], run.workers.generate
    run.workers.sync_weights = lambda: calls.append("sync")
    run.workers.sleep = lambda: calls.append("sleep")
    run.workers.generate = lambda prompts, s: calls.append("generate") or generate(prompts, s)
    run.validate()
    assert calls == ["sync", "generate", "generate", "sleep"]


def val_run(*overrides, record="seed"):
    """Val batches [a, b, c] and [d], prompts of 4, 2, 3, 4 tokens (max_prompt_length 4), a response each of 1, 2, 3
    and 4 tokens (d's without an EOS), scored 1, 0, 0, 1. -> (run, the seeds (or `record`) each batch drew)."""
    run = bare_run("data.max_prompt_length=4", *overrides)
    batches = [[{"name": "a"}, {"name": "b"}, {"name": "c"}], [{"name": "d"}]]
    length, prompt_length = {"a": 1, "b": 2, "c": 3, "d": 4}, {"a": 4, "b": 2, "c": 3, "d": 4}
    run.val_loader = types.SimpleNamespace(epoch=lambda: iter([[{**p, "prompt_ids": [7] * prompt_length[p["name"]],
                                                                 "prompt_text": p["name"], "ground_truth": "g"}
                                                                for p in batch] for batch in batches]))
    seeds = []
    run.workers = types.SimpleNamespace(sync_weights=lambda: None, sleep=lambda: None, generate=lambda prompts, s: (
        seeds.append(s[record]) or [{"prompt_index": i, "response_ids": [5] * length[p["name"]], "name": p["name"],
                                     "finish_reason": "length" if p["name"] == "d" else "stop"}
                                    for i, p in enumerate(prompts)]))
    run.score = lambda prompts, responses: [{"overall": float(r["name"] in "ad")} for r in responses]
    run.tokenizer = types.SimpleNamespace(decode=lambda ids: f"{len(ids)} tokens")
    run.logger.log_generations = lambda rows, step: run.logger.generations.extend(rows)
    run.logger.generations = []
    return run, seeds


def test_validation_logs_prompt_and_response_lengths_as_training_does():
    """EasyR1 logs val_prompt_length/* and val_response_length/clip_ratio too (compute_length_metrics of the val
    batch, prefixed val_): prompts 4, 2, 3, 4 tokens -> mean 13 / 4, 2 of 4 at max_prompt_length; d has no EOS."""
    metrics = val_run()[0].validate()
    assert {k: v for k, v in metrics.items() if "length/" in k} == {
        "val_response_length/mean": 2.5, "val_response_length/max": 4, "val_response_length/min": 1,
        "val_response_length/clip_ratio": 0.25, "val_prompt_length/mean": 3.25, "val_prompt_length/max": 4,
        "val_prompt_length/min": 2, "val_prompt_length/clip_ratio": 0.5}


@pytest.mark.parametrize("count, logged", [(2, ["a", "b"]), (4, ["a", "b", "c", "d"]), (0, []), (-1, [])])
def test_val_generations_to_log_rows_and_none_when_not_positive(count, logged):
    """The first `count` responses in val-file order (listed in the README); 0 or less logs none, as EasyR1
    (-1 logged every response of a batch but its last)."""
    run = val_run(f"trainer.val_generations_to_log={count}")[0]
    run.validate()
    assert [row["prompt"] for row in run.logger.generations] == logged
    assert run.logger.generations[:1] in ([], [{"prompt": "a", "response": "1 tokens", "ground_truth": "g",
                                                "score": 1.0}])


def test_val_reward_score_is_the_overall_mean_with_several_reward_keys():
    """Scores 1, 0, 0, 1 (overall) and accuracy 1, 1, 1, 0 over the two val batches: val/reward_score is the overall
    mean 2 / 4, each key has its val/<key>_reward mean (accuracy 3 / 4), the last key's mean is no stand-in."""
    run = val_run("trainer.val_generations_to_log=0")[0]
    run.score = lambda prompts, responses: [{"accuracy": float(r["name"] != "d"), "overall": float(r["name"] in "ad")}
                                            for r in responses]  # overall not first: it is still the score
    metrics = run.validate()
    assert {k: v for k, v in metrics.items() if k.startswith("val/")} == {
        "val/overall_reward": 0.5, "val/accuracy_reward": 0.75, "val/reward_score": 0.5}


def test_a_reward_key_of_some_responses_is_their_mean_over_the_batches():
    """math_acc from a (1) and b (0.5) of the first batch, geo from d (0.25) of the second, overall from all four (1,
    0, 0, 1): each key's mean over the responses that return it, as EasyR1 (a KeyError after the whole validation)."""
    run = val_run("trainer.val_generations_to_log=0")[0]
    extra = {"a": {"math_acc": 1.0}, "b": {"math_acc": 0.5}, "c": {}, "d": {"geo": 0.25}}
    run.score = lambda prompts, responses: [{"overall": float(r["name"] in "ad"), **extra[r["name"]]}
                                            for r in responses]
    assert {k: v for k, v in run.validate().items() if k.startswith("val/")} == {
        "val/overall_reward": 0.5, "val/math_acc_reward": 0.75, "val/geo_reward": 0.25, "val/reward_score": 0.5}
