"""Where batch lines run: a Celery worker's processes, or the web process (LLMGW_BATCH_RUNNER).

With Redis configured (production), each process of the Celery worker's pool runs a batch runner
(apps.batches.runner) beside its tasks, in a thread with an event loop of its own and a gateway of
its own (apps.gateway.asgi.GatewayApp, serving nobody over HTTP): a line is sent through every
stage of the gateway as an interactive request is, and the slots and the fair queue it takes part in
are the ones every web process shares through Redis, so a line never takes a slot a web process
counts as free, and gives way as soon as an interactive request waits for its model in any process.
The web processes then only take files and batches; a flood of lines never shares their event loop
with the interactive requests.

Without Redis, slots are counted by each process on its own: a worker's lines could neither see the
web process's queue nor be seen by it, so the web process, then the only gateway, runs them
(llmgw/asgi.py). `llmgw up` on its embedded defaults runs that way.

The thread is started when a pool process starts (Celery's worker_process_init) and stopped when it
ends (worker_process_shutdown): the lines it holds are cut off and given back. The worker keeps no
database pool (llmgw.settings: PROCESS; Celery would close it after every task, under the thread's
feet): the runner's queries run on a few threads of its loop (at most LLMGW_DATABASE_POOL_SIZE),
each with a connection of its own while it queries. A pass of the runner that fails (the database
away) is run again (apps.batches.runner), and so is the start, with a growing wait. A process killed
with kill -9 stops nothing: the leases of its lines run out (LLMGW_BATCH_LEASE_SECONDS) and the runner of
another process, or of the process the worker starts in its place, runs them again under the same
request ids (apps.batches.runner explains why each line is answered once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import Any

__all__ = ["RunnerHost", "connect_worker_signals"]

log = logging.getLogger("llmgw.batches")

#: How long a stopping host waits for its runner to give its lines back.
STOP_TIMEOUT_S = 15.0
#: The longest wait between two tries to start the runner after a failure.
START_RETRY_MAX_S = 30.0


class RunnerHost:
    """A batch runner and the gateway it sends lines through, on an event loop in a thread."""

    def __init__(self, **runner_options: Any) -> None:
        self.runner_options = runner_options
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self.app: Any = None
        self.runner: Any = None
        self.started = threading.Event()
        self.failure: BaseException | None = None
        self._stop: asyncio.Event | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._main, name="batch-runner", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # logged; the worker's tasks go on without lines run here
            self.failure = exc
            log.exception("batch runner: stopped on an error; this worker process runs no more batch lines")
        finally:
            self.started.set()
            from django.db import connections

            connections.close_all()

    async def _serve(self) -> None:
        """Start the gateway and the runner, and again after a failure to start (the database
        away), until the process stops."""
        from concurrent.futures import ThreadPoolExecutor

        from django.conf import settings
        from django.db import connections

        self.loop = asyncio.get_running_loop()
        # The runner's and its gateway's queries run on the loop's default executor, each thread with
        # a connection of its own while it queries (a worker keeps no pool): its size bounds them.
        self.loop.set_default_executor(
            ThreadPoolExecutor(max_workers=settings.DATABASE_POOL_SIZE, thread_name_prefix="batch-runner")
        )
        self._stop = asyncio.Event()
        wait = 1.0
        while not self._stop.is_set():
            try:
                await self._run()
                return
            except Exception as exc:
                self.failure = exc
                log.warning("batch runner: could not start (%s); trying again in %g s", exc, wait, exc_info=True)
            await asyncio.to_thread(connections.close_all)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), wait)
            wait = min(wait * 2, START_RETRY_MAX_S)

    async def _run(self) -> None:
        from apps.batches.runner import BatchRunner
        from apps.gateway.asgi import GatewayApp

        app = GatewayApp()
        try:
            await app.startup()
        except BaseException:
            with contextlib.suppress(Exception):
                await app.shutdown()
            raise
        self.app = app
        self.runner = BatchRunner(app, **self.runner_options)
        self.runner.start()
        self.failure = None
        self.started.set()
        log.info("batch runner: running batch lines in this worker process")
        try:
            assert self._stop is not None
            await self._stop.wait()
        finally:
            await self.runner.stop()
            await app.shutdown()

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop the runner (its lines are given back) and the gateway; wait for the thread."""
        loop, stop = self.loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop ended meanwhile
                loop.call_soon_threadsafe(stop.set)
        if self.thread is not None:
            self.thread.join(timeout)


_host: RunnerHost | None = None


def _process_started(**_kwargs: Any) -> None:
    global _host
    from django.conf import settings

    if settings.BATCH_RUNNER != "worker" or _host is not None:
        return
    _host = RunnerHost()
    _host.start()


def _process_stopping(**_kwargs: Any) -> None:
    global _host
    host, _host = _host, None
    if host is not None:
        host.stop()


def connect_worker_signals() -> None:
    """Run lines in each process of the worker's pool while LLMGW_BATCH_RUNNER says worker."""
    from celery.signals import worker_process_init, worker_process_shutdown

    worker_process_init.connect(_process_started, weak=False, dispatch_uid="llmgw-batch-runner-start")
    worker_process_shutdown.connect(_process_stopping, weak=False, dispatch_uid="llmgw-batch-runner-stop")
