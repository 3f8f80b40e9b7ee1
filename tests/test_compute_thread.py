"""A peer's compute runs on one thread of its own, with the torch thread count from its configuration."""

from __future__ import annotations

import os
import threading

import torch

from meshd.cli.meshd_main import apply_torch_threads
from meshd.daemon.config import load_config
from meshd.runtime.host import ComputeThread, ShardHost


async def test_every_call_runs_on_the_same_thread_and_errors_come_back():
    compute = ComputeThread()
    idents = {await compute.run(threading.get_ident) for _ in range(5)}
    assert idents == {compute.thread_id} and compute.thread_id != threading.get_ident()
    try:
        await compute.run(int, "not a number")
    except ValueError as exc:
        assert "not a number" in str(exc)
    else:
        raise AssertionError("the error raised on the compute thread must reach the caller")
    compute.close()


async def test_host_loads_and_computes_on_its_compute_thread(tiny_model):
    host = ShardHost(tiny_model)
    await host.load(0, 4)
    assert await host.run_sync(threading.get_ident) == host.compute.thread_id
    host.close()


def test_torch_threads_setting(monkeypatch):
    assert load_config(None, {}).torch_threads == 0
    monkeypatch.setenv("MESHD_TORCH_THREADS", "1")
    assert load_config(None, {}).torch_threads == 1
    before = torch.get_num_threads()
    try:
        assert apply_torch_threads(1) == 1 and torch.get_num_threads() == 1
        assert apply_torch_threads(0) == len(os.sched_getaffinity(0))
    finally:
        torch.set_num_threads(before)
