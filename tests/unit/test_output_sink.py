"""The output sink's group commit: lines written by many threads at once are each whole, once, and a
failed write fails exactly the lines it held, leaving nothing of them in the file."""

from __future__ import annotations

import threading
from pathlib import Path

from tests.support.disks import every_line_is_a_whole_record, fill, mounted_tmpfs
from workers.sink import OutputSink, OutputUnwritable

THREADS = 64
PER_THREAD = 25


def write_from_threads(sink: OutputSink, folder: Path, payload: str = "") -> tuple[list[int], list[int]]:
    """Every thread writes PER_THREAD records at once; the ids written and the ids refused."""
    written: list[int] = []
    refused: list[int] = []
    lock = threading.Lock()
    start = threading.Barrier(THREADS)

    def writer(t: int) -> None:
        start.wait()
        for i in range(PER_THREAD):
            rid = t * PER_THREAD + i
            try:
                sink.write_record(folder, {"id": rid, "payload": payload}, fsync="always")
            except OutputUnwritable:
                with lock:
                    refused.append(rid)
            else:
                with lock:
                    written.append(rid)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in threads), "a writer never got its line's outcome"
    return written, refused


def test_lines_written_by_many_threads_at_once_are_each_whole_and_in_the_file_once(tmp_path: Path) -> None:
    sink = OutputSink()
    written, refused = write_from_threads(sink, tmp_path / "ds")
    sink.close()
    assert not refused
    ids = [r["id"] for r in every_line_is_a_whole_record(tmp_path / "ds")]
    assert sorted(ids) == sorted(written) == list(range(THREADS * PER_THREAD))


def test_on_a_disk_that_fills_every_line_is_whole_and_written_exactly_when_its_writer_was_told_so(
    tmp_path: Path,
) -> None:
    with mounted_tmpfs(tmp_path / "disk", 256 * 1024) as disk:
        sink = OutputSink()
        # about 1,600 records of 1 KiB for 256 KiB: the disk fills part way through
        written, refused = write_from_threads(sink, disk / "ds", payload="x" * 1000)
        assert written and refused, "the disk never filled, or nothing fitted: the test proved nothing"
        ids = [r["id"] for r in every_line_is_a_whole_record(disk / "ds")]
        assert sorted(ids) == sorted(written)  # no line of a refused record, none written twice

        sink.close()


def test_after_a_full_disk_frees_up_the_next_record_lands_after_the_last_whole_one(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "disk", 128 * 1024) as disk:
        sink = OutputSink()
        sink.write_record(disk / "ds", {"id": -2})
        filler = fill(disk)
        # a few may still fit in the file's last page; the rest are refused
        written, refused = write_from_threads(sink, disk / "ds")
        assert len(refused) > len(written)
        filler.unlink()
        sink.write_record(disk / "ds", {"id": -1})
        sink.close()
        ids = [r["id"] for r in every_line_is_a_whole_record(disk / "ds")]
        assert ids[0] == -2 and ids[-1] == -1 and sorted(ids[1:-1]) == sorted(written)
