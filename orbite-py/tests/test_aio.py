# SPDX-License-Identifier: Apache-2.0
"""`await transfer` under asyncio: many awaited at once, the event loop
kept free while they run, an await cancelled, and one never posted."""

import asyncio

import numpy as np
import pytest

import orbite


def test_transfers_are_awaited_concurrently():
    e = orbite.Engine()
    n = 1 << 20
    src = np.arange(8 * n, dtype=np.uint64).astype(np.uint8)
    dst = np.zeros_like(src)
    a, b = e.register(src), e.register(dst)

    async def main():
        ts = [e.prepare("write", [(a, i * n, n)], [(b, i * n, n)]) for i in range(8)]
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        tick = asyncio.ensure_future(ticker())
        for t in ts:
            t.post()
        outs = await asyncio.gather(*ts)
        tick.cancel()
        for t in ts:
            t.release()
        return outs, ticks

    outs, ticks = asyncio.run(main())
    assert all(o.success and o.transferred_bytes == n for o in outs)
    assert np.array_equal(src, dst)
    assert ticks > 0, "the loop ran while the transfers did"
    e.close()


def test_an_await_can_be_cancelled_and_a_transfer_never_posted_is_refused():
    target = orbite.Engine({"listen": "127.0.0.1:0"})
    init = orbite.Engine({"listen": "127.0.0.1:0", "route": "tcp"})
    src = np.ones(64 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    s, d = init.register(src), target.register(dst)
    peer = init.open_peer(target.endpoint)

    async def main():
        t = init.prepare("write", [(s, 0, src.nbytes)], [(d, 0, dst.nbytes)], peer=peer)
        with pytest.raises(orbite.TransferError, match="never posted"):
            await t
        t.post()
        waiter = asyncio.ensure_future(asyncio.wait_for(t, timeout=0.0001))
        with pytest.raises(asyncio.TimeoutError):
            await waiter
        out = await t  # the transfer went on: await it again
        assert out.success
        t.release()

    asyncio.run(main())
    assert (dst == 1).all()
    init.close()
    target.close()
