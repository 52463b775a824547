"""Shared fixtures: the offline toy world, built once per test session under .toy/ (cached); run_ranks and
leave_rank for the spawned processes of the multi-rank tests."""

import multiprocessing
import os
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def toy():
    """{"vl_model", "text_model", "colors", "sums"}: absolute paths into the toy world."""
    import toy as toy_world

    return toy_world.ensure_toy(os.path.join(ROOT, ".toy"))


@pytest.fixture(scope="module", autouse=True)
def no_process_group_left_behind():
    """vLLM's in-process engine (distributed_executor_backend="external_launcher") starts a one-rank torch.distributed
    group and leaves it, and so does a Worker made in the test process (tests/test_loop.py): a later module's CPU
    Actor would take itself for sharded. End it after each module."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if "vllm" in sys.modules:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
        else:
            dist.destroy_process_group()


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: end-to-end tests (minutes); still run in CI")


def leave_rank():
    """End a spawned test rank whose work is done and saved, skipping the interpreter's teardown: there torch's
    gloo backend sometimes aborts the process (SIGABRT, "terminate called without an active exception"; about 1
    run in 8 of the two-rank AdamW test), which would fail a test whose results are all correct."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(target, args, timeout):
    """Start one spawned process per tuple in `args` (target(*args[r])), wait up to `timeout` seconds in all, kill
    what still runs; -> the exit codes (0 for a rank that ended with leave_rank)."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=a) for a in args]
    for p in procs:
        p.start()
    deadline = time.time() + timeout
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.time()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(5)
    return [p.exitcode for p in procs]
