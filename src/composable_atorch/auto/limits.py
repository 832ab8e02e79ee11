"""Time limits on the user's code where the search runs it in its own process.

Trials and the preflight run the user's model in child processes, killed at their timeout. Some of
it runs in the searching process: the model is built there to find its blocks, one forward places
tensor-parallel layers while the plans are listed, and each prediction runs the forward on fake
tensors. A forward that hangs there would hang the search past any budget; these limits interrupt
it (:func:`time_limit`) and name what hung (:func:`user_code_limit`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time

from composable_atorch.errors import WorkloadError


class PredictionTimeout(BaseException):
    """The user's code, run in the searching process (a prediction, the forward that places tensor-parallel
    layers), ran past its time limit.

    A BaseException, as KeyboardInterrupt is: a user forward's ``except Exception`` (a retry loop) or the
    estimator's own error handling must not swallow it and go on hanging."""


#: after the first alarm, it rings again this often until the limited block has left (a handler that
#: swallowed one, even with ``except BaseException``, is interrupted again)
_REPEAT_S = 1.0


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise :class:`PredictionTimeout` in this thread after ``seconds``, and every second after that
    until the block ends: a hang in Python code (a sleep, a loop, a blocking call that returns to the
    interpreter on a signal) is interrupted.

    In the main thread (POSIX) by SIGALRM, which also interrupts a sleep or a blocking read; in another
    thread by an asynchronous exception, raised when the thread next runs Python code. A hang inside
    native code that never returns to Python cannot be interrupted in this process (the trials and the
    preflight, in their own processes, are killed instead)."""
    if not seconds or seconds <= 0 or seconds == float("inf"):
        yield
        return
    armed = [True]

    def expired(_sig=None, _frame=None):
        if armed[0]:
            raise PredictionTimeout(f"did not finish within {seconds:g} s")

    if hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGALRM, expired)
        signal.setitimer(signal.ITIMER_REAL, seconds, _REPEAT_S)
        try:
            yield
        finally:
            armed[0] = False  # first: an alarm ringing from here on does nothing
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        return
    with _async_timer(threading.get_ident(), seconds, armed):
        try:
            yield
        finally:
            armed[0] = False


@contextlib.contextmanager
def _async_timer(thread_id: int, seconds: float, armed: list):
    """Raise PredictionTimeout in thread ``thread_id`` after ``seconds`` (and each second after), while armed."""
    import ctypes

    done = threading.Event()

    def ring():
        if done.wait(seconds):
            return
        while armed[0] and not done.is_set():
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(PredictionTimeout))
            done.wait(_REPEAT_S)

    timer = threading.Thread(target=ring, name="composable_atorch-time-limit", daemon=True)
    timer.start()
    try:
        yield
    finally:
        armed[0] = False
        done.set()
        timer.join()
        # an exception set just as the block ended is not raised later, elsewhere
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), None)


def in_process_limit(trial, budget, started: float) -> tuple[float, str]:
    """Seconds the user's code may run in the searching process now, and what bounds it: one trial's
    timeout (a forward slower than that cannot train in a trial either), and never past the budget plus
    one trial's timeout, the bound the whole search keeps. A listing that ends after the budget is spent
    is not an error: the search then stops by its time limit, as after any other part."""
    limit, why = trial.timeout, "the trial timeout"
    if budget.time_limit is not None:
        left = started + budget.time_limit + trial.timeout - time.monotonic()
        if left < limit:
            limit, why = max(left, 0.1), "the search's time_limit plus one trial timeout"
    return limit, why


@contextlib.contextmanager
def user_code_limit(bound: tuple[float, str], part: str):
    """Run the block (which runs the user's model) for at most ``bound``'s seconds; a WorkloadError
    naming ``part`` and the bound after that (:func:`time_limit` interrupts it)."""
    seconds, why = bound
    try:
        with time_limit(seconds):
            yield
    except PredictionTimeout:
        raise WorkloadError(
            f"the model's construction and forward, run in the searching process while {part} (model_fn(), "
            "and one forward to place tensor-parallel layers)",
            f"it did not finish within {seconds:.3g} s ({why}); interrupted",
            "make the model's forward finish (a hang?), give the trials more time (TrialSettings(timeout=)) or the "
            "search (Budget(time_limit=)); without tensor-parallel plans (SpaceOptions(excluded=('tensor_parallel',"
            "))) and sequence splits (excluded=('context_parallel', 'sequence_parallel'): their meta-device forward "
            "measures the activations) no forward runs here",
        ) from None
