"""Memory probes (core, no Qt): resident memory and its private / file-mapped split."""

import sys

import pytest

from specplay.core.memory import memory_split, memory_text, process_rss


def test_resident_memory_is_read_and_grows_with_a_private_allocation():
    import mmap

    before = process_rss()
    assert before and before > 10 * 2**20
    # Fresh anonymous pages (a malloc could reuse pages this long-lived process already holds).
    with mmap.mmap(-1, 64 * 2**20) as block:
        for i in range(0, len(block), 4096):
            block[i] = 1  # touched: resident and private
        after = process_rss()
        assert after - before > 32 * 2**20
        if sys.platform == "linux":
            private, mapped = memory_split()
            assert private > 64 * 2**20 and mapped >= 0
    assert memory_text().startswith("RAM ")


@pytest.mark.skipif(sys.platform != "linux", reason="the split comes from /proc")
def test_a_mapped_file_counts_as_mapped_not_private(tmp_path):
    import mmap

    path = tmp_path / "weights.bin"
    path.write_bytes(b"\1" * (64 * 2**20))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        private_before, mapped_before = memory_split()
        sum(m[i] for i in range(0, len(m), 4096))  # touch every page
        private_after, mapped_after = memory_split()
    assert mapped_after - mapped_before > 32 * 2**20
    assert private_after - private_before < 16 * 2**20
