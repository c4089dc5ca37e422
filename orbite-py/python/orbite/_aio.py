# SPDX-License-Identifier: Apache-2.0
"""`await transfer`: a thread waits for the execution (without the GIL)
and hands the outcome to the event loop; cancelling the await stops the
thread's wait, not the transfer."""

import asyncio
import threading

from orbite._orbite import TransferError

# How often a waiting thread looks whether its await was cancelled.
_SLICE_S = 0.05


async def wait(transfer):
    """The outcome of the execution `transfer` posted, once it retired."""
    if transfer.status == "not_posted":
        raise TransferError("await of a transfer never posted")
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    stop = threading.Event()

    def settle(result, error):
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run():
        result, error = None, None
        try:
            while not stop.is_set():
                result = transfer.wait(_SLICE_S)
                if result is not None:
                    break
        except BaseException as e:  # handed to the awaiting task
            error = e
        if stop.is_set():
            return
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:
            pass  # the loop closed meanwhile: no one awaits any more

    threading.Thread(target=run, name="orbite-await", daemon=True).start()
    try:
        return await future
    finally:
        stop.set()
