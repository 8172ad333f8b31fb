"""Reading ahead in the layer-streamed engine (engine/streamed/prefetch.py): the order of reads, the layers held
within the budget (the one in flight counted), errors of the reader thread raised in the caller, no thread left
running, and the same Jacobian whichever way the weights arrived."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from tiny_models import swept

from detjac.engine.streamed import prefetch
from detjac.engine.streamed.streamed_engine import StreamedEngine
from detjac.errors import CheckpointError
from detjac.targets import OUTPUTS

EXACT = 1e-12


_BEFORE: set[threading.Thread] = set()


@pytest.fixture(autouse=True)
def _threads_before() -> None:
    """The reader threads alive before each test (left by code that drove a skeleton's layers directly, outside the
    engine's calls): what the test's own engine leaves is counted against them."""
    _BEFORE.clear()
    _BEFORE.update(t for t in threading.enumerate() if t.name.startswith(prefetch.THREAD_NAME))


def _readers() -> list[threading.Thread]:
    """The reader threads alive now that were not before the test."""
    return [t for t in threading.enumerate()
            if t.name.startswith(prefetch.THREAD_NAME) and t.is_alive() and t not in _BEFORE]


def _spy_reads(sm: StreamedEngine) -> list[tuple[int, str]]:
    """(layer, thread name) of every layer read the skeleton starts, in order."""
    seen: list[tuple[int, str]] = []
    reader = sm.skeleton.feed.reader
    real = reader.read

    def read(i: int, *into):  # type: ignore[no-untyped-def]
        seen.append((i, threading.current_thread().name))
        return real(i, *into)

    reader.read = read
    return seen


def test_layers_are_read_ahead_in_sweep_order_and_the_jacobian_is_unchanged(llama_checkpoint: Path,
                                                                           prompt_ids: list[int]) -> None:
    sm = StreamedEngine(llama_checkpoint, dtype=torch.float64)
    assert isinstance(sm.skeleton.feed.reader, prefetch.ThreadReader)  # a CPU run never makes a CUDA reader
    seen = _spy_reads(sm)
    res = swept(sm, prompt_ids, ["output"], row_block=16)
    L, blocks = sm.n_layers, -(-sm.d_model // 16)
    # the trace goes up, each reverse block down; after the trace the top layer is read again for the first block
    want = [*range(L), *[i for _ in range(blocks) for i in range(L - 1, -1, -1)]]
    assert [i for i, _ in seen][:len(want)] == want
    assert len(seen) == len(want) + 1  # and once more: the top layer, for a next pass that did not come
    assert all(name.startswith(prefetch.THREAD_NAME) for _, name in seen)
    s = sm.stats
    assert s.layers_prefetched == s.layers_loaded - 1  # every layer but the very first was read ahead
    assert s.layers_kept == 0 and s.max_layers_held == 2  # no budget: none kept; the one in use and the one in flight
    assert s.layers_read_unused == 0 and s.weight_wait_seconds > 0
    assert not _readers()  # drained when the engine returned
    plain = StreamedEngine(llama_checkpoint, dtype=torch.float64)
    plain.skeleton.feed.reader = prefetch.SyncReader(plain.skeleton.feed.reader.read)
    ref = swept(plain, prompt_ids, ["output"], row_block=16)
    assert torch.equal(res["output"], ref["output"])  # the same tensors, whichever way they came


def test_a_budget_keeps_decoded_layers_across_passes_and_counts_the_one_in_flight(llama_checkpoint: Path,
                                                                                  prompt_ids: list[int]) -> None:
    probe = StreamedEngine(llama_checkpoint, dtype=torch.float64)
    n, layer = len(prompt_ids), probe.skeleton.stored_layer_bytes()  # layers are kept as stored
    ref = swept(probe, prompt_ids, ["output"], row_block=16)
    # a budget whose plan leaves room for exactly two layers to be kept
    cost = probe.cost
    budget = cost.weights_bytes + cost.block_bytes(n, 0) + 16 * cost.vector_bytes(n) + 2 * layer + layer // 2
    sm = StreamedEngine(llama_checkpoint, dtype=torch.float64, max_memory={"cpu": budget})
    plan = sm.plan(sm.trace(prompt_ids), [OUTPUTS], row_block=16)
    spare = sm.cost.spare_bytes(n, plan)
    assert 2 * layer <= spare < 3 * layer
    res = swept(sm, prompt_ids, ["output"], row_block=16)
    assert torch.equal(res["output"], ref["output"])
    s = sm.stats
    assert s.layers_kept > 0 and len(sm.skeleton.feed.kept) == 2
    assert s.max_layers_held <= 2 + 2  # in use + in flight (the budget's two layers) + what the plan spares
    assert s.max_layers_held * layer <= 2 * layer + spare
    assert s.bytes_read < probe.stats.bytes_read  # kept layers are not read again
    sm.skeleton.feed.keep(0)
    assert not sm.skeleton.feed.kept


def _failing(inner: prefetch.ThreadReader, bad: int) -> prefetch.ThreadReader:
    """A reader whose thread raises on one layer."""

    def read(layer: int, *into):  # type: ignore[no-untyped-def]
        if layer == bad:
            raise CheckpointError(f"Expected layer {layer} readable. Got a truncated file.")
        return inner.read(layer, *into)

    return prefetch.ThreadReader(read, inner.alloc)


def test_an_error_in_the_reader_thread_is_raised_in_the_caller_and_no_thread_is_left(llama_checkpoint: Path,
                                                                                     prompt_ids: list[int]) -> None:
    sm = StreamedEngine(llama_checkpoint, dtype=torch.float64)
    sm.skeleton.feed.reader = _failing(sm.skeleton.feed.reader, bad=1)
    with pytest.raises(CheckpointError, match="Expected layer 1 readable"):
        swept(sm, prompt_ids, ["output"], row_block=16)
    assert not _readers() and not sm.stats.resident
    assert all(p.device.type == "meta" for p in sm.layers[1].parameters())


def test_an_error_while_a_layer_computes_leaves_no_read_running(llama_checkpoint: Path,
                                                                prompt_ids: list[int]) -> None:
    sm = StreamedEngine(llama_checkpoint, dtype=torch.float64)
    release = threading.Event()
    inner = sm.skeleton.feed.reader

    def slow(layer: int, *into):  # type: ignore[no-untyped-def]
        release.wait(timeout=30)
        return inner.read(layer, *into)

    sm.skeleton.feed.reader = prefetch.ThreadReader(slow, inner.alloc)
    release.set()  # the first (synchronous) read must not block
    with pytest.raises(RuntimeError, match="boom"):
        with sm.skeleton.layer(0):
            release.clear()  # the read of layer 1, started ahead, is now blocked in its thread
            assert sm.skeleton.feed.pending is not None and sm.skeleton.feed.pending.layer == 1
            threading.Timer(0.2, release.set).start()
            raise RuntimeError("boom")
    assert sm.skeleton.feed.pending is None and not _readers()
    assert sm.stats.layers_read_unused == 1


def test_a_wrong_guess_is_dropped_and_the_asked_layer_read(llama_checkpoint: Path) -> None:
    sm = StreamedEngine(llama_checkpoint, dtype=torch.float64)
    seen = _spy_reads(sm)
    with sm.skeleton.layer(0):
        pass
    with sm.skeleton.layer(0):  # guessed 1
        pass
    sm.skeleton.feed.drain()
    assert [i for i, _ in seen] == [0, 1, 0, 1]
    assert sm.stats.layers_read_unused == 1 and sm.stats.layers_prefetched == 0 and not sm.stats.resident


def test_the_stock_forward_and_a_layer_loaded_from_outside_leave_no_read_running(llama_checkpoint: Path,
                                                                                prompt_ids: list[int]) -> None:
    sm = StreamedEngine(llama_checkpoint, dtype=torch.float64)
    logits = sm.stock_logits(prompt_ids, len(prompt_ids) - 1)  # the skeleton's own modules, outside _linear
    assert torch.isfinite(logits).all() and not _readers()
    sm.load_layer(0)
    sm.release_layer(0)
    assert not _readers()
