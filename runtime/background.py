"""A low-priority background thread for work that must not take CPU from training (``runtime.snapshots``)."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


def start_worker(nice: int, *, name: str) -> queue.SimpleQueue:
    """A daemon thread running the callables put into the returned queue, one at a time (daemon: work stuck on a
    dead peer must not keep the process from exiting), at nice value ``nice`` (Linux: a thread's own, inherited by
    the threads it starts; 19, the lowest priority: where training keeps every core busy, training preempts it
    instead of sharing the cores with it)."""
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def serve() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except (AttributeError, OSError):  # not Linux: the thread runs at training's priority
            pass
        while True:
            inbox.get()()

    threading.Thread(target=serve, name=name, daemon=True).start()
    return inbox


def in_worker(inbox: queue.SimpleQueue, action: Callable[[], T]) -> T:
    """``action()`` run on the worker thread of ``inbox``; its value (or exception) here."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(action())
        except BaseException as error:
            future.set_exception(error)

    inbox.put(run)
    return future.result()
