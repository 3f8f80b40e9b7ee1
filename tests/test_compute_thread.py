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


async def test_torch_threads_setting(monkeypatch):
    from meshd.runtime import host

    assert load_config(None, {}).torch_threads == 0
    monkeypatch.setenv("MESHD_TORCH_THREADS", "1")
    assert load_config(None, {}).torch_threads == 1
    monkeypatch.setattr(host, "_compute_threads", None)
    before = torch.get_num_threads()
    try:
        cpus = len(os.sched_getaffinity(0))
        assert apply_torch_threads(0) == cpus
        # the compute thread computes with them all; this thread, and threads started now, with one
        compute = ComputeThread()
        assert await compute.run(torch.get_num_threads) == cpus and torch.get_num_threads() == 1
        others: list[int] = []
        worker = threading.Thread(target=lambda: others.append(torch.get_num_threads()))
        worker.start()
        worker.join()
        assert others == [1]
        compute.close()
        assert apply_torch_threads(1) == 1
        compute = ComputeThread()
        assert await compute.run(torch.get_num_threads) == 1
        compute.close()
    finally:
        torch.set_num_threads(before)
