"""The ingest lane (app.serving.worker.Worker): one job at a time, and a job that yields (a slice of an embeddings
call) waits behind the lane's own work (uploads and deletes), which keep their arrival order."""
from __future__ import annotations

import asyncio
import threading

from app.serving.worker import Worker


def test_an_upload_waits_for_the_running_slice_alone_not_for_the_waiting_ones():
    async def main() -> list[str]:
        lane, release, order = Worker(16, name="test-lane"), threading.Event(), []
        lane.start()

        def job(name: str, hold: bool = False):
            def work(cancelled):
                if hold:
                    release.wait(10)
                order.append(name)
                return [name]
            return work

        running = lane.submit(job("slice 1", hold=True), "embed", yields=True)
        await running.wait_started(10)
        jobs = [running, *(lane.submit(job(f"slice {n}"), "embed", yields=True) for n in (2, 3)),
                lane.submit(job("upload"), "upload"), lane.submit(job("delete"), "delete")]
        release.set()
        assert [await j.result() for j in jobs] == ["slice 1", "slice 2", "slice 3", "upload", "delete"]
        assert lane.stop()
        return order

    assert asyncio.run(main()) == ["slice 1", "upload", "delete", "slice 2", "slice 3"]
