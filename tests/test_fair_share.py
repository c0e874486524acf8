"""FairShare: the batch worker's lines in flight split evenly among the keys running batches."""

from __future__ import annotations

import asyncio

import pytest

from qwenbatch.batch.fair_share import FairShare


async def hold(share: FairShare, owner: str, release: asyncio.Event, holding: list[str]) -> None:
    async with share.slot(owner):
        holding.append(owner)
        try:
            await release.wait()
        finally:
            holding.remove(owner)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_key_alone_gets_the_whole_capacity_and_no_more():
    async def scenario():
        share, release, holding = FairShare(4), asyncio.Event(), []
        share.join("a")
        tasks = [asyncio.create_task(hold(share, "a", release, holding)) for _ in range(6)]
        await settle()
        assert holding.count("a") == 4
        release.set()
        await asyncio.gather(*tasks)
        assert share.held("a") == 0

    asyncio.run(scenario())


def test_a_newcomer_gets_its_share_as_the_first_keys_lines_finish():
    async def scenario():
        share, holding = FairShare(4), []
        releases = [asyncio.Event() for _ in range(8)]
        share.join("a")
        a_tasks = [asyncio.create_task(hold(share, "a", releases[i], holding)) for i in range(8)]
        await settle()
        assert holding.count("a") == 4  # a holds everything
        share.join("b")
        b_release = asyncio.Event()
        b_tasks = [asyncio.create_task(hold(share, "b", b_release, holding)) for _ in range(3)]
        await settle()
        assert share.share() == 2 and holding.count("b") == 0  # the capacity is in use: b waits
        releases[0].set()
        await settle()
        assert holding.count("a") == 3 and holding.count("b") == 1  # a's freed slot went to b
        for i in range(1, 4):  # more of a's lines finish: each freed slot to whoever holds fewer
            releases[i].set()
        await settle()
        assert holding.count("a") == 2 and holding.count("b") == 2
        share.leave("b")
        b_release.set()
        await asyncio.gather(*b_tasks)
        await settle()
        assert holding.count("a") == 4  # b is gone: a's share is the whole capacity again
        for event in releases:
            event.set()
        await asyncio.gather(*a_tasks)

    asyncio.run(scenario())


def test_a_sender_granted_a_slot_then_cancelled_passes_it_on():
    async def scenario():
        share, holding, release = FairShare(1), [], asyncio.Event()
        share.join("a")
        mine = share.slot("a")
        await mine.__aenter__()
        second = asyncio.create_task(hold(share, "a", release, holding))
        third = asyncio.create_task(hold(share, "a", release, holding))
        await settle()
        await mine.__aexit__(None, None, None)  # the slot is handed to `second`, which has not run yet
        second.cancel()
        await settle()
        assert holding == ["a"] and second.cancelled()  # `third` has it: the slot was not lost
        release.set()
        await third
        assert share.held("a") == 0

    asyncio.run(scenario())


def test_a_sender_cancelled_while_waiting_leaves_the_queue():
    async def scenario():
        share, holding, release = FairShare(1), [], asyncio.Event()
        share.join("a")
        first = asyncio.create_task(hold(share, "a", release, holding))
        await settle()
        waiting = asyncio.create_task(hold(share, "a", release, holding))
        await settle()
        waiting.cancel()
        await settle()
        release.set()
        await first
        assert share.held("a") == 0 and not share._waiting

    asyncio.run(scenario())


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity"):
        FairShare(0)


def test_a_sender_behind_cancelled_ones_takes_a_free_slot_at_once():
    async def scenario():
        share, holding, release = FairShare(2), [], asyncio.Event()
        share.join("a")
        mine, other = share.slot("a"), share.slot("a")
        await mine.__aenter__()
        await other.__aenter__()  # both slots held
        stale = asyncio.create_task(hold(share, "a", release, holding))
        await settle()  # queued
        stale.cancel()  # its future is cancelled, but it has not run its handler yet
        await mine.__aexit__(None, None, None)  # a slot is free; the queue holds only the cancelled sender
        fresh = asyncio.create_task(hold(share, "a", release, holding))
        await settle()
        assert holding == ["a"] and stale.cancelled()
        release.set()
        await fresh
        await other.__aexit__(None, None, None)
        assert share.held("a") == 0

    asyncio.run(scenario())
