"""Pre-flight: train the user's workload once, with no plan, in this process, before any trial.

A model that cannot consume the batch, a loss that does not return a tensor, a dataset that cannot
be batched: every plan of the study would crash the same way, and the search would burn its whole
budget finding that out. :func:`preflight` runs one optimizer step of the workload as given (world
1, no transform) and raises :class:`~composable_atorch.errors.WorkloadError` naming the part that
failed and what to set. Running out of memory is not such an error (a plan may fix it: sharding,
checkpointing), so it is reported back, not raised.

The search runs it in a child process under the trial's time limit (:func:`preflight_in_child`):
a forward that hangs, or a step slower than a trial may take, is a WorkloadError after that
limit, not a search that never returns; the child, and whatever it started, is killed as a
trial's processes are.

Some of the user's code runs in the searching process itself: the model is built there to find its
blocks, one forward places tensor-parallel layers while the plans are listed, and each prediction runs
the forward on fake tensors. A forward that hangs there would hang the search past any budget; the
limits here interrupt it (:func:`time_limit`) and name what hung (:func:`user_code_limit`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

from composable_atorch.auto.workload import Workload, make_optimizer
from composable_atorch.errors import WorkloadError


@dataclass(frozen=True)
class PreflightResult:
    ok: bool
    seconds: float
    #: why the step did not finish when a plan might still fix it (out of memory)
    note: str | None = None


def _describe(batch) -> str:
    if isinstance(batch, dict):
        return f"a dict with keys {sorted(map(str, batch))}"
    if isinstance(batch, list | tuple):
        return f"a {type(batch).__name__} of {len(batch)}"
    return type(batch).__name__


def loss_hint(batch, exc: BaseException) -> str:
    """What to set when ``loss_fn(model, batch)`` fails on the plain model (names the argument)."""
    shape = _describe(batch)
    if isinstance(batch, dict):
        return (
            f"the loader yields {shape}; a model whose forward takes those as keyword arguments needs the batch "
            "unpacked: set model_input_format='unpack_dict' in auto_accelerate, or call model(**batch) in loss_fn"
        )
    if isinstance(batch, list | tuple) and isinstance(exc, TypeError | ValueError | AttributeError):
        return (
            f"the loader yields {shape}; a model whose forward takes those as positional arguments needs the batch "
            "unpacked: set model_input_format='unpack_sequence' in auto_accelerate, or call model(*batch) in "
            "loss_fn; or pass prepare_input to pick the model's input"
        )
    return (
        f"make loss_fn(model, batch) run on one batch of the dataset ({shape}) in a single process, without any "
        "plan; check the model's forward signature, prepare_input and loss_func"
    )


def out_of_memory(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, MemoryError) or "out of memory" in text or "can't allocate memory" in text


def _fail(part: str, exc: BaseException, hint: str) -> WorkloadError:
    err = WorkloadError(part, exc, hint)
    err.__cause__ = exc
    return err


def preflight(workload: Workload) -> PreflightResult:
    """One optimizer step of ``workload`` as given; :class:`WorkloadError` when it cannot run at all."""
    import torch
    from torch.utils.data import DataLoader

    start = time.monotonic()
    torch.manual_seed(workload.seed)
    try:
        stage, hint = "model_fn()", "model_fn must build the model with no arguments"
        model = workload.model_fn()
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"returned {type(model).__name__}, not a torch.nn.Module")
        stage, hint = (
            "optim_fn(model)",
            "optim_fn must take the model (or be an optimizer class) and return a torch optimizer",
        )
        optim = make_optimizer(workload.optim_fn, model)
        stage, hint = (
            "the data loader",
            (
                "the dataset must batch with torch's DataLoader at batch_size; check "
                "dataloader_args / loader_kwargs and the dataset's __getitem__"
            ),
        )
        kwargs = {"drop_last": True, **workload.loader_kwargs, "shuffle": False}
        kwargs.pop("generator", None)
        batch = next(iter(DataLoader(workload.dataset, batch_size=workload.batch_size, **kwargs)))
    except StopIteration:
        raise WorkloadError(
            "the data loader", "no full batch", f"give a dataset of at least batch_size={workload.batch_size} samples"
        ) from None
    except Exception as exc:  # noqa: BLE001 - every failure of the user's own code becomes the error
        if out_of_memory(exc):
            return PreflightResult(False, time.monotonic() - start, f"out of memory in {stage}: {exc}")
        raise _fail(stage, exc, hint) from exc
    try:
        loss = workload.loss_fn(model, batch)
        if isinstance(loss, list | tuple) and loss:
            loss = loss[0]
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            what = (
                type(loss).__name__
                if not isinstance(loss, torch.Tensor)
                else f"a tensor of shape {tuple(loss.shape)}, requires_grad={loss.requires_grad}"
            )
            raise WorkloadError(
                "loss_fn(model, batch)",
                f"returned {what}",
                "return the scalar loss tensor of the batch (or a tuple whose first item it is)",
            )
    except WorkloadError:
        raise
    except Exception as exc:  # noqa: BLE001
        if out_of_memory(exc):
            return PreflightResult(False, time.monotonic() - start, f"out of memory in the forward: {exc}")
        raise _fail("loss_fn(model, batch)", exc, loss_hint(batch, exc)) from exc
    try:
        loss.backward()
        optim.step()
        optim.zero_grad()
    except Exception as exc:  # noqa: BLE001
        if out_of_memory(exc):
            return PreflightResult(False, time.monotonic() - start, f"out of memory in the backward: {exc}")
        raise _fail(
            "the backward pass and optimizer step",
            exc,
            "check the loss depends on the model's parameters and the optimizer holds them",
        ) from exc
    return PreflightResult(True, time.monotonic() - start)


def _child(workload: Workload, out_path: str) -> None:
    """The preflight child: the result or the WorkloadError's parts as JSON (nothing pickled back)."""
    os.setsid()  # its own group, killed with what it starts
    try:
        result = {"result": asdict(preflight(workload))}
    except WorkloadError as exc:
        result = {"error": {"part": exc.part, "error": exc.error, "hint": exc.hint}}
    with open(out_path, "w") as f:
        json.dump(result, f)


def preflight_in_child(workload: Workload, timeout: float) -> PreflightResult:
    """:func:`preflight` in a spawned process, killed (with everything it started) after ``timeout`` s.

    In a daemonic process (multiprocessing forbids it children) it runs here, with no limit.
    """
    import multiprocessing as mp

    from composable_atorch.auto.trial import kill_group, marked, new_marker, reap

    if mp.current_process().daemon:  # a daemonic process may not have children: run it here, unbounded
        return preflight(workload)
    ctx = mp.get_context("spawn")
    start, marker = time.monotonic(), new_marker()
    with tempfile.TemporaryDirectory(prefix="composable-atorch-preflight-") as tmp:
        out = os.path.join(tmp, "preflight.json")
        proc = ctx.Process(target=_child, args=(workload, out), name="preflight")
        try:
            with marked(marker):
                proc.start()
            proc.join(timeout)
        finally:
            if proc.exitcode is None:
                kill_group(proc)
            reap(marker)
        data = None
        if os.path.exists(out):
            with open(out) as f, contextlib.suppress(ValueError):
                data = json.load(f)
    seconds = time.monotonic() - start
    if data is None:
        if proc.exitcode == -9 and seconds < timeout:  # the kernel's out-of-memory killer: a plan may fix it
            return PreflightResult(False, seconds, "out of memory (the step was killed by SIGKILL)")
        if proc.exitcode in (0, None) or seconds >= timeout:
            raise WorkloadError(
                "one training step of the workload with no plan",
                f"it did not finish within {timeout:g} s (the trial timeout); killed",
                "make the model's forward, the loss and the backward finish (a hang?), or give the trials "
                "more time (TrialSettings(timeout=...))",
            )
        raise WorkloadError(
            "one training step of the workload with no plan",
            f"the process died (exit code {proc.exitcode})",
            "run one step of the workload in a single process to see why (a crash in native code?)",
        )
    if "error" in data:
        err = data["error"]
        raise WorkloadError(err["part"], err["error"], err["hint"])
    return PreflightResult(**data["result"])


# -- time limits on the user's code in the searching process ---------------------------------------


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
