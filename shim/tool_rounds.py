"""Each tool round's calls of all rollouts at once, under TRL's own, unchanged ``_tool_call_loop``.

GRPOTrainer's loop calls the tools of rollout 0, then those of rollout 1, and
so on: with remote sandboxes a round costs the *sum* of the rollouts' command
latencies. Nothing is copied from TRL here. :class:`ToolCallsAhead` stands in
for the trainer's per-rollout sync tool dicts (``_sync_tool_dicts``) for the
length of one ``_tool_call_loop``; the first sync call TRL makes in a round
starts every rollout's calls of that round on a thread pool, each rollout's in
its own order, read from the assistant message the round answers (the last
message of each rollout's completion, which TRL has not yet touched). TRL's
loop then goes on as it always does, one rollout after another, and each call
it makes returns (or raises) what that call gave when it ran ahead: so a round
costs about its *slowest* rollout, while the messages, their order, the
``{"error": ...}`` results, the counts, masks and logprobs are TRL's own,
whatever TRL release is installed.

What runs ahead is exactly what TRL calls: ``function`` calls to a sync tool
with keyword arguments, in order. Async tools are TRL's to run (it gathers
them on its own loop after the rollout's sync calls, as before). A call TRL
makes that was not foreseen (no such message, other arguments) runs as TRL
would run it, on TRL's thread. Tools passed as ``tools=`` are shared by all
rollouts, so they must be thread-safe.

For comparison, TRL's ``AsyncGRPOTrainer`` rollout worker already runs
rollouts concurrently and sync tools on a thread pool; it needs none of this.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

import anyio

from harbor_async.core.errors import HarborAsyncError
from harbor_async.engine.loop import wait_done, wait_result
from shim import engines

__all__ = ["CallNotRunError", "ToolCallsAhead", "worker_threads"]

#: A rollout's sync tools by name, as TRL keeps them (``GRPOTrainer._sync_tool_dicts[i]``).
ToolDict = Mapping[str, Callable[..., Any]]


@dataclass
class _Call:
    """One foreseen call: what TRL will ask for, and what it gave when run ahead."""

    name: str
    arguments: dict[str, Any]
    result: Future[Any] = field(default_factory=Future)


class ToolCallsAhead:
    """Runs each round's sync tool calls of every rollout at once, ahead of the caller that asks for them in turn.

    Args:
        completions: each rollout's completion messages, as the tool loop
            grows them (read, never changed, here).
        tool_dicts: each rollout's sync tools by name (the originals).
        run_ahead: starts one rollout's calls of a round in another thread and
            returns its future (``ThreadPoolExecutor.submit`` will do; the
            trainer's, :func:`worker_threads`, do not hold up the exit); ``None``:
            nothing runs ahead, every call runs in the caller's thread (TRL's
            serial rounds), still timed.
    """

    def __init__(
        self,
        completions: Sequence[list[dict[str, Any]]],
        tool_dicts: Sequence[ToolDict],
        run_ahead: Callable[..., Future[None]] | None,
    ) -> None:
        self._completions = completions
        self._originals = tool_dicts
        self._run_ahead = run_ahead
        self._queues: list[deque[_Call]] = [deque() for _ in tool_dicts]
        # The messages whose calls ran ahead, kept alive so that an id is never reused for another message.
        self._answered: dict[int, dict[str, Any]] = {}
        self._running: list[Future[None]] = []
        self._lock = threading.Lock()
        #: Seconds the caller waited on results (their calls running ahead, or run in its thread).
        self.waited = 0.0
        #: Rounds started ahead.
        self.rounds = 0

    def tool_dicts(self) -> list[dict[str, Callable[..., Any]]]:
        """Stand-ins for the sync tool dicts: the same names, each call served from the round run ahead."""
        return [
            {name: functools.wraps(tool)(functools.partial(self._call, index, name)) for name, tool in tools.items()}
            for index, tools in enumerate(self._originals)
        ]

    def __enter__(self) -> ToolCallsAhead:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        # An error the program may catch and go on from waits (the envs are reset for the next batch); an exit
        # (Ctrl-C, SystemExit) does not.
        self.close(wait=kind is None or issubclass(kind, Exception))

    def close(self, wait: bool = True) -> None:
        """Wait for every call that was started (none is left running behind the caller).

        ``wait=False`` (what leaving a ``with`` block on ``KeyboardInterrupt`` or
        ``SystemExit`` does): the calls still running end with their sandboxes,
        when the engine is closed at exit. The wait itself is interruptible.
        """
        if wait:
            for running in self._running:
                wait_done(running)

    def _call(self, index: int, name: str, **arguments: Any) -> Any:
        begin = time.perf_counter()
        try:
            with self._lock:
                if not self._queues[index] and self._run_ahead is not None:  # this rollout's first call of a round: it starts
                    self._start_round()
                queue = self._queues[index]
                call = queue.popleft() if queue and queue[0].name == name and queue[0].arguments == arguments else None
            if call is None:  # not foreseen: as TRL calls it
                return self._originals[index][name](**arguments)
            return wait_result(call.result)  # the call's own exception, raised here as TRL would have met it
        finally:
            self.waited += time.perf_counter() - begin

    def _start_round(self) -> None:
        """Start the calls of every rollout whose last message asks for tools not yet run ahead."""
        assert self._run_ahead is not None
        self.rounds += 1
        for index, messages in enumerate(self._completions):
            message = messages[-1] if messages else None
            if not isinstance(message, dict) or id(message) in self._answered:
                continue
            calls = self._foreseen(message.get("tool_calls") or [], self._originals[index])
            if not calls:
                continue
            self._answered[id(message)] = message
            self._queues[index] = deque(calls)
            running = self._run_ahead(_run_in_order, calls, self._originals[index])
            running.add_done_callback(functools.partial(_fail_unanswered, calls))
            self._running.append(running)

    @staticmethod
    def _foreseen(tool_calls: Sequence[Any], tools: ToolDict) -> list[_Call]:
        """The sync calls TRL's loop makes for these tool calls, in its order."""
        calls = []
        for tool_call in tool_calls:
            function = tool_call.get("function") if isinstance(tool_call, dict) and tool_call.get("type") == "function" else None
            if not isinstance(function, dict) or function.get("name") not in tools:
                continue  # another type, an async or unknown tool: not a sync call
            arguments = function.get("arguments")
            if isinstance(arguments, dict) and all(isinstance(key, str) for key in arguments):
                calls.append(_Call(function["name"], dict(arguments)))
        return calls


def worker_threads(workers: int) -> Callable[..., Future[None]] | None:
    """A ``run_ahead`` for :class:`ToolCallsAhead`: anyio's worker threads of the loop thread, ``workers`` at once.

    ``None`` for one worker (TRL's serial rounds). Not a ``ThreadPoolExecutor``:
    the interpreter joins its threads before the exit handlers that close the
    engines, so after Ctrl-C mid-round a trainer waited for every command still
    running ahead (up to its timeout). anyio's worker threads are daemons, and
    the engines' close at exit ends their commands.
    """
    if workers == 1:
        return None
    slots: list[anyio.CapacityLimiter] = []  # made on the loop thread at the first round, for its event loop

    async def in_worker_thread(job: Callable[[], None]) -> None:
        if not slots:
            slots.append(anyio.CapacityLimiter(workers))
        await anyio.to_thread.run_sync(job, limiter=slots[0], abandon_on_cancel=True)

    def run_ahead(fn: Callable[..., None], *args: Any) -> Future[None]:
        return engines.submit(in_worker_thread, functools.partial(fn, *args))

    return run_ahead


class CallNotRunError(HarborAsyncError, RuntimeError):
    """A call run ahead never ran: its round's worker was cancelled (the loop thread stopping, say)."""


def _run_in_order(calls: Sequence[_Call], tools: ToolDict) -> None:
    """One rollout's calls of a round, one after another (a later call may read what an earlier one wrote)."""
    for call in calls:
        try:
            _settle(call.result, value=tools[call.name](**call.arguments))
        except BaseException as exc:  # noqa: BLE001 - handed to TRL's thread, which catches what it catches
            _settle(call.result, error=exc)


def _fail_unanswered(calls: Sequence[_Call], running: Future[None]) -> None:
    """Once a rollout's worker is done, however it ended: a call it left without an answer fails, never waits on."""
    for call in calls:
        _settle(call.result, error=CallNotRunError(f"{call.name} was not run: its round's worker ended first"))


def _settle(result: Future[Any], *, value: Any = None, error: BaseException | None = None) -> None:
    """Answer a call once (a worker abandoned on cancel may still finish after its calls were failed)."""
    try:
        if error is not None:
            result.set_exception(error)
        else:
            result.set_result(value)
    except InvalidStateError:
        pass
