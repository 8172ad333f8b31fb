"""The layer-streamed engine's weights, read ahead: layer ``l+1`` is read (and dequantized) while layer ``l`` computes.

:class:`LayerFeed` hands the skeleton each decoder layer's tensors: from the layers kept across passes, from the read
started ahead, or read now (then the engine waits). After each layer it starts reading the layer the sweep will most
likely ask for next (one below going down, one above going up; at the end of a pass, the first layer of the next).
A wrong guess is dropped when another layer is asked for. A reader is the one small interface between the feed and
how bytes reach the device: :class:`ThreadReader` (a background thread, any device) and :class:`CudaReader` (a thread
that pins the layer and copies it on a side stream with ``non_blocking=True``; only ever made for a CUDA device).

Memory: the layer in use plus the one in flight (the cost model's budget counts two layers), plus the layers kept,
at most :attr:`LayerFeed.keep_bytes` (what the plan leaves of the budget; without a budget none are kept, so the
engine holds at most two layers). Time the engine waited on weights is counted in
:attr:`~detjac.engine.interface.EngineStats.weight_wait_seconds`. Exactness: the tensors are the same whichever way
they arrive. Details: docs/engine.md, "Reading ahead"."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

Tensors = dict[str, torch.Tensor]
Read = Callable[[int], tuple[Tensors, int]]  # layer -> (its tensors by relative name, bytes read from the source)
THREAD_NAME = "detjac-layer-reader"


class Pending:
    """One layer's read, run by a :class:`Worker`; :meth:`result` waits for it and raises the read's error."""

    def __init__(self, layer: int, work: Callable[[], Any], finish: Callable[[Any], tuple[Tensors, int]]) -> None:
        self.layer, self._work, self._finish = layer, work, finish
        self._value: Any = None
        self._error: BaseException | None = None
        self._done = threading.Event()

    def run(self) -> None:
        try:
            self._value = self._work()
        except BaseException as e:  # handed to the caller by result()
            self._error = e
        finally:
            self._done.set()

    def wait(self) -> None:
        """Until the read has ended."""
        self._done.wait()

    def result(self) -> tuple[Tensors, int]:
        self.wait()
        if self._error is not None:
            raise self._error
        return self._finish(self._value)


class Worker:
    """One background thread running reads one after another, started at the first and stopped by :meth:`stop`:
    one thread for all of a call's reads, not one per read (the layers' tensors themselves can be made in the
    caller's thread, :class:`ThreadReader`'s ``alloc``)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Pending | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, job: Pending) -> Pending:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=THREAD_NAME, daemon=True)
            self._thread.start()
        self._queue.put(job)
        return job

    def _loop(self) -> None:
        while (job := self._queue.get()) is not None:
            job.run()

    def stop(self) -> None:
        """After the reads submitted, end the thread and wait for it."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None


class LayerReader(Protocol):
    """How a layer's tensors reach the compute device, started in the background: ``start`` returns what has
    ``layer``, ``wait()`` (until the read has ended) and ``result()`` (the tensors and the bytes read; raises the
    read's error); ``stop`` ends any thread the reader runs (after its reads)."""

    def start(self, layer: int) -> Any: ...

    def stop(self) -> None: ...


class ThreadReader:
    """``read`` (to the compute device) in a background thread: any device. With ``alloc``, the layer's tensors
    are made in the caller's thread and ``read(layer, into)`` fills them."""

    def __init__(self, read: Callable[..., tuple[Tensors, int]], alloc: Callable[[int], Tensors] | None = None
                 ) -> None:
        self.read, self.alloc, self.worker = read, alloc, Worker()

    def start(self, layer: int) -> Pending:
        into = self.alloc(layer) if self.alloc is not None else None
        work = (lambda: self.read(layer)) if into is None else (lambda: self.read(layer, into))
        return self.worker.submit(Pending(layer, work, lambda value: value))

    def stop(self) -> None:
        self.worker.stop()


class SyncReader:
    """``read`` in the caller's thread when the layer is asked for: no reading ahead (the engine waits for every
    read; the baseline the benchmarks compare with)."""

    def __init__(self, read: Read) -> None:
        self.read = read

    def start(self, layer: int) -> Deferred:
        return Deferred(layer, self.read)

    def stop(self) -> None:
        pass


class Deferred:
    """A read not started: :meth:`result` reads in the caller's thread (:class:`SyncReader`)."""

    def __init__(self, layer: int, read: Read) -> None:
        self.layer, self.read = layer, read

    def wait(self) -> None:
        pass

    def result(self) -> tuple[Tensors, int]:
        return self.read(self.layer)


class CudaReader:
    """``read_host`` (to CPU, compute dtype) in a background thread, then pinned and copied to ``device`` on a side
    stream with ``non_blocking=True``; the compute stream waits for the copy's event before it uses the tensors."""

    def __init__(self, read_host: Read, device: torch.device) -> None:
        self.read_host, self.device, self.worker = read_host, device, Worker()
        self.stream = torch.cuda.Stream(device=device)

    def stop(self) -> None:
        self.worker.stop()

    def start(self, layer: int) -> Pending:
        def work() -> tuple[Tensors, int, Any]:
            host, nbytes = self.read_host(layer)
            with torch.cuda.stream(self.stream):
                out = {k: t.pin_memory().to(self.device, non_blocking=True) for k, t in host.items()}
                event = torch.cuda.Event()
                event.record(self.stream)
            return out, nbytes, event

        def finish(value: tuple[Tensors, int, Any]) -> tuple[Tensors, int]:
            out, nbytes, event = value
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(event)
            for t in out.values():
                t.record_stream(compute)  # the allocator may not reuse them before the compute stream is done
            return out, nbytes

        return self.worker.submit(Pending(layer, work, finish))


class LayerFeed:
    """Each decoder layer's tensors for the skeleton, read ahead and kept across passes (see the module docstring).

    Parameters
    ----------
    n_layers
        Decoder layers.
    reader
        Starts a layer's read in the background.
    stats
        Where the reads, hits and waits are counted (:class:`~detjac.engine.interface.EngineStats`).
    """

    def __init__(self, n_layers: int, reader: LayerReader, stats: Any) -> None:
        self.n_layers, self.reader, self.stats = n_layers, reader, stats
        self.keep_bytes = 0
        self.kept: dict[int, Tensors] = {}
        self.pending: Any = None  # what the reader's start returned (Pending, Deferred)
        self.in_use: dict[int, int] = {}  # layers handed out and not yet given back: their bytes
        self._last: int | None = None

    def get(self, i: int) -> Tensors:
        """Layer ``i``'s tensors on the compute device; then the read of the next layer starts."""
        t0 = time.perf_counter()
        tensors = self.kept.pop(i, None)
        if tensors is not None:
            self.stats.layers_kept += 1
        else:
            pending = self.pending if self.pending is not None and self.pending.layer == i else None
            if pending is None:
                self.drop()
                pending = self.reader.start(i)
            else:
                self.stats.layers_prefetched += 1
            self.pending = None
            try:
                tensors, nbytes = pending.result()
            except BaseException:
                self.reader.stop()  # no thread left behind the error
                raise
            self.stats.bytes_read += nbytes
        self.stats.weight_wait_seconds += time.perf_counter() - t0
        self.in_use[i] = _nbytes(tensors)
        self._ahead(self._next(i))
        self._last = i
        self._held()
        return tensors

    def give_back(self, i: int, tensors: Tensors) -> None:
        """Layer ``i`` is released: its tensors are kept for the next pass where :attr:`keep_bytes` has room."""
        self.in_use.pop(i, None)
        if self.pending is not None and self.pending.layer == i:
            return  # read again already (the next pass starts with it)
        if _nbytes(tensors) + sum(map(_nbytes, self.kept.values())) <= self.keep_bytes:
            self.kept[i] = tensors

    def keep(self, limit: int) -> None:
        """Keep at most ``limit`` bytes of layers across passes (layers beyond it are freed now)."""
        self.keep_bytes = max(0, int(limit))
        while self.kept and sum(map(_nbytes, self.kept.values())) > self.keep_bytes:
            self.kept.pop(max(self.kept))

    def drain(self) -> None:
        """Wait for the read in flight to end (its result stays for the next :meth:`get`) and end the reader's
        thread; the wait counts."""
        t0 = time.perf_counter()
        if self.pending is not None:
            self.pending.wait()
        self.reader.stop()
        self.stats.weight_wait_seconds += time.perf_counter() - t0

    def drop(self) -> None:
        """Wait for the read in flight to end and forget it (its error too): a wrong guess, or an error elsewhere."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.wait()
            self.stats.layers_read_unused += 1

    def abort(self) -> None:
        """After an error: forget the read in flight and end the reader's thread."""
        self.drop()
        self.reader.stop()

    def _next(self, i: int) -> int:
        """The layer the sweep most likely asks for after ``i``."""
        last = self._last
        step = i - last if last is not None and abs(i - last) == 1 else (-1 if i == self.n_layers - 1 else 1)
        j = i + step
        if 0 <= j < self.n_layers:
            return j
        return self.n_layers - 1  # a pass has ended: the next one (or a reverse sweep after the trace) starts on top

    def _ahead(self, j: int) -> None:
        if j in self.kept or (self.pending is not None and self.pending.layer == j):
            return
        self.drop()
        self.pending = self.reader.start(j)

    def _held(self) -> None:
        """The most layers held at once: in use, in flight and kept."""
        held = len(self.in_use) + (self.pending is not None) + len(self.kept)
        self.stats.max_layers_held = max(self.stats.max_layers_held, held)


def _nbytes(tensors: Tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def make_reader(read: Callable[..., tuple[Tensors, int]], read_host: Read, device: torch.device,
                quantize: str | None, alloc: Callable[[int], Tensors] | None = None) -> LayerReader:
    """:class:`CudaReader` for a CUDA device (a quantize round trip runs on the device: then :class:`ThreadReader`),
    else :class:`ThreadReader` (``alloc``: see there)."""
    if device.type == "cuda" and quantize is None:
        return CudaReader(read_host, device)
    return ThreadReader(read, alloc)
