"""The hang diagnosis's parts in one process: what a rank publishes about itself when a peer asks."""

import json
import time

import pytest
import torch.distributed as dist

from ddplab.distributed import hangs

pytestmark = pytest.mark.timeout(30)


class LoadedStore:
    """A store on a loaded machine: the peer's entry takes a moment to read, and the peer asks for
    this rank's stack during that moment. Records every entry rank 0 publishes."""

    def __init__(self):
        self.inner = dist.HashStore()
        self.published: list[str] = []

    def check(self, keys):
        if keys == [hangs.PREFIX + "stack/1"]:
            self.inner.set(hangs.PREFIX + "request", "1")
            time.sleep(0.3)
        return self.inner.check(keys)

    def set(self, key, value):
        if key == hangs.PREFIX + "stack/0":
            self.published.append(json.loads(value)["doing"])
        self.inner.set(key, value)

    def get(self, key):
        return self.inner.get(key)

    def add(self, key, amount):
        return self.inner.add(key, amount)


def test_a_rank_whose_collective_already_failed_is_named_by_it_not_by_where_it_formats_the_error():
    # rank 1 timed out first and reports; rank 0's broadcast ended with the lost connection
    store = LoadedStore()
    peer = {"rank": 1, "host": "h", "pid": 1, "doing": "in broadcast (train.py:9 in main)", "stack": ""}
    store.inner.set(hangs.PREFIX + "stack/1", json.dumps(peer))
    hangs._watcher = hangs.StackWatcher(store, 0, poll_s=0.02)
    hangs._watcher.start()
    try:
        try:
            raise RuntimeError("Connection closed by peer")
        except RuntimeError as e:
            cause, _ = hangs.diagnose(e, world_size=2, timeout_s=5, wait_s=2)
    finally:
        hangs.stop()
    assert "rank 1 in broadcast (train.py:9 in main)" in cause
    # the watcher did not answer the peer with the main thread's place in the diagnosis itself
    assert store.published and all(doing.startswith("in ") for doing in store.published), store.published
