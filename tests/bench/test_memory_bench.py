"""``hicache bench memory``'s readings: the RSS of a process and the peak of a burst."""

from __future__ import annotations

import os
import time
from pathlib import Path

from hicache.bench.memory import RssSampler, rss_mib


def test_rss_is_the_resident_set_of_the_process() -> None:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    expected = pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    assert abs(rss_mib(os.getpid()) - expected) < 8


def test_the_sampler_sees_a_peak_that_is_gone_when_it_stops() -> None:
    sampler = RssSampler(os.getpid(), period_s=0.005).start()
    before = sampler.peak
    block = bytearray(b"\x01") * (96 * 2**20)  # written: resident
    time.sleep(0.05)
    del block  # above the mmap threshold: unmapped at once
    peak = sampler.stop()
    assert peak - before > 80
    assert rss_mib(os.getpid()) < peak - 80
