"""Host-device copies overlapped with compute on side CUDA streams (issue 25).

* :func:`device_batches`: the batches of a DataLoader on the device. On CUDA the next
  batch's (pinned) uint8 images are copied on a side stream, issued as soon as the current
  batch is handed out, so the copy runs while the current batch's forward does.
* :class:`HostCopy`: a batch's outputs on their way back to the host. On CUDA they are cast
  on the compute stream (fp16 storage: half the bytes), then copied into pinned memory on a
  side stream while the next batch is encoded; :meth:`HostCopy.wait` (the cache's writer
  thread) waits for that copy alone. On the CPU the cast happens in :meth:`~HostCopy.wait`.

On the CPU nothing is pinned and nothing runs ahead: the same tensors, in the same order.
The values never depend on the streams (copies are exact), so outputs are the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .stopwatch import Stopwatch, timed


def device_batches(loader: Iterable[Any], dev: Any, stopwatch: Stopwatch | None = None
                   ) -> Iterator[tuple[Any, Any]]:
    """``(got, images)`` for each item ``got`` of ``loader`` (``got[1]``: a tensor of images),
    ``images`` being ``got[1]`` on ``dev``. With a stopwatch, the wait for each item is
    ``load wait`` and the copy (issue, and on CUDA its completion) ``h2d``."""
    items = loader if stopwatch is None else stopwatch.iterate(loader)
    if getattr(dev, "type", "cpu") != "cuda":
        for got in items:
            with timed(stopwatch, "h2d"):
                x = got[1].to(dev)
            yield got, x
        return
    yield from _cuda_ahead(iter(items), dev, stopwatch)


def _cuda_ahead(it: Iterator[Any], dev: Any, stopwatch: Stopwatch | None) -> Iterator[tuple[Any, Any]]:
    import torch

    side = torch.cuda.Stream(dev)

    def issue(got: Any) -> tuple[Any, Any] | None:
        if got is None:
            return None
        with timed(stopwatch, "h2d"), torch.cuda.stream(side):
            return got, got[1].to(dev, non_blocking=True)

    ahead = issue(next(it, None))
    while ahead is not None:
        got, x = ahead
        current = torch.cuda.current_stream(dev)
        current.wait_stream(side)  # this batch's copy (the next one is issued after)
        x.record_stream(current)  # allocated on the side stream, used on this one
        ahead = issue(next(it, None))
        yield got, x


class HostCopy:
    """The tensors of ``arrays`` (``{key: {name: tensor}}``) on their way to the host, each
    converted by ``convert(name, tensor)`` (the storage dtype) first; :meth:`wait` gives
    ``{key: {name: numpy array}}``. On CUDA the conversion is queued on the compute stream
    and the copy on ``side`` (pinned memory, non-blocking); elsewhere both run in
    :meth:`wait`."""

    def __init__(self, arrays: dict[Any, dict[str, Any]], convert: Callable[[str, Any], Any],
                 side: Any = None) -> None:
        self.arrays, self.convert, self._event = arrays, convert, None
        if side is None:
            self._host = None
            return
        import torch

        dev_arrays = {key: {k: convert(k, t) for k, t in d.items()} for key, d in arrays.items()}
        side.wait_stream(torch.cuda.current_stream(side.device))
        self._host = {}
        with torch.cuda.stream(side):
            for key, d in dev_arrays.items():
                self._host[key] = {}
                for k, t in d.items():
                    pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                    pinned.copy_(t, non_blocking=True)
                    t.record_stream(side)
                    self._host[key][k] = pinned
            self._event = torch.cuda.Event()
            self._event.record(side)

    def wait(self) -> dict[Any, dict[str, Any]]:
        if self._host is None:
            return {key: {k: self.convert(k, t).cpu().numpy() for k, t in d.items()}
                    for key, d in self.arrays.items()}
        self._event.synchronize()
        return {key: {k: t.numpy() for k, t in d.items()} for key, d in self._host.items()}


def side_stream(dev: Any) -> Any:
    """A new side stream on a CUDA ``dev``; None elsewhere."""
    if getattr(dev, "type", "cpu") != "cuda":
        return None
    import torch

    return torch.cuda.Stream(dev)
