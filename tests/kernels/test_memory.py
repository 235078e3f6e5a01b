"""attnlab's caches on transparent huge pages (attnlab.kernels.memory): the same zeros as torch's,
advised on a 2 MiB boundary where Linux offers huge pages, and left to torch where it does not or
``ATTNLAB_HUGE_PAGES=off``."""

from __future__ import annotations

import pytest
import torch

from attnlab import decoding
from attnlab.kernels import memory, routes
from attnlab.modules import KVCache
from attnlab.testing import assert_close

MiB = 1 << 20


def _thp_mode_from_sys() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    mode = text[text.find("[") + 1:text.find("]")]
    return mode if mode in ("always", "madvise") else None


@pytest.mark.parametrize("shape,dtype", [((3, 5), torch.float32), ((0, 4), torch.bfloat16),
                                         ((1, 8, 4096, 128), torch.bfloat16), ((2, 3, 1000, 129), torch.float32),
                                         ((2, 1, 3 * MiB), torch.int8)])
def test_cache_zeros_are_torch_s_zeros_contiguous(shape, dtype):
    t = memory.cache_zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
    assert torch.equal(t, torch.zeros(shape, dtype=dtype))
    t.fill_(1)  # every byte its own: nothing shared with another tensor
    assert torch.equal(t, torch.ones(shape, dtype=dtype))
    e = memory.cache_empty(shape, dtype)
    assert e.shape == shape and e.dtype == dtype and e.is_contiguous()


def test_no_device_is_torch_s_default_device_as_for_torch_empty():
    with torch.device("meta"):  # torch.set_default_device's scope
        small, large = memory.cache_zeros((2, 3), torch.float32), memory.cache_zeros((1, 8, 4100, 128), torch.bfloat16)
    assert small.device.type == large.device.type == "meta" and large.shape == (1, 8, 4100, 128)
    assert memory.cache_zeros((2, 3), torch.float32).device.type == "cpu"


def test_the_mode_is_the_kernel_s():
    assert memory.huge_pages_offered() == _thp_mode_from_sys()


def test_a_large_cache_is_advised_whole_huge_pages_on_a_2_mib_boundary(monkeypatch):
    calls = []
    monkeypatch.setattr(memory, "_advise", lambda address, length: calls.append((address, length)) or True)
    monkeypatch.setattr(memory, "huge_pages_offered", lambda: "madvise")
    t = memory.cache_zeros((1, 8, 1000, 128), torch.bfloat16)  # 2,048,000 bytes: under one huge page
    assert calls == [] and torch.equal(t, torch.zeros_like(t))
    t = memory.cache_zeros((1, 8, 4100, 128), torch.bfloat16)  # 8,396,800 bytes
    assert calls == [(t.data_ptr(), 4 * 2 * MiB)] and t.data_ptr() % (2 * MiB) == 0
    with routes.forced(huge_pages="off"):
        memory.cache_zeros((1, 8, 4100, 128), torch.bfloat16)
    monkeypatch.setattr(memory, "huge_pages_offered", lambda: None)  # THP "never", or not Linux
    memory.cache_zeros((1, 8, 4100, 128), torch.bfloat16)
    assert len(calls) == 1


def _smaps_field(t: torch.Tensor, field: str) -> int:
    """``field`` of the /proc/self/smaps entry of the mapping that holds ``t``'s first element."""
    address, inside = t.data_ptr(), False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0] if line.strip() else ""
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def test_the_advice_takes_where_the_kernel_offers_huge_pages(monkeypatch):
    """Advised, and used when granted: the kernel may refuse huge pages (memory fragmented by a loaded
    machine; a fresh clone's 'make test' saw 0 bytes on them, issue 63), so the test asks what is
    certain: madvise took, the mapping is eligible, and what it holds on huge pages is whole ones."""
    took = []
    real = memory._advise
    monkeypatch.setattr(memory, "_advise", lambda address, length: took.append(real(address, length)) or took[-1])
    t = memory.cache_zeros((1, 8, 8192, 128), torch.bfloat16)  # 16 MiB
    if memory.huge_pages_offered() is None:  # THP "never" (or not Linux): nothing is on huge pages
        assert memory.huge_page_bytes(t) == 0
        return
    assert took == [True]
    if _smaps_field(t, "THPeligible") >= 0:  # kernels since 5.0 say so
        assert _smaps_field(t, "THPeligible") == 1
    assert memory.huge_page_bytes(t) % (2 * MiB) == 0  # granted or not, never a part of a huge page


def test_attnlab_s_caches_ask_for_huge_pages(monkeypatch):
    calls = []
    monkeypatch.setattr(memory, "_advise", lambda address, length: calls.append(length) or True)
    monkeypatch.setattr(memory, "huge_pages_offered", lambda: "madvise")
    KVCache(1, 8, 128, max_len=4096, dtype=torch.bfloat16)  # 8 MiB each for K and V
    assert calls == [8 * MiB, 8 * MiB]
    paged = decoding.PagedKVCache(1, 8, 128, page_size=16, num_pages=512, dtype=torch.bfloat16)
    assert calls[2:] == [16 * MiB, 16 * MiB]  # 512 pages of 16 tokens of 8 heads of 128 bf16
    k = torch.randn(1, 8, 20_000, 128).to(torch.bfloat16)
    decoding.PagedKVCache(1, 8, 128, page_size=16, dtype=torch.bfloat16).append(k, k)  # a pool of 1 page grown
    whole = 1250 * 16 * 8 * 128 * 2 // (2 * MiB) * (2 * MiB)  # to 1250 pages: the whole huge pages in it
    assert calls[4:] == [whole, whole]
    q = torch.randn(1, 32, 1, 128).to(torch.bfloat16)
    paged.append(k[:, :, :8000], k[:, :, :8000])
    dense = decoding.decode_attention(q, k[:, :, :8000], k[:, :, :8000], enable_gqa=True)
    assert_close(decoding.paged_decode_attention(q, paged), dense)  # the pool's pages hold the cache


def test_the_bench_s_machine_line_says_whether_caches_are_on_huge_pages(force_routes, monkeypatch):
    from attnlab.bench.machine import machine_line

    monkeypatch.setattr(memory, "huge_pages_offered", lambda: "madvise")
    assert "attnlab's caches on huge pages: on (transparent huge pages: madvise)" in machine_line()
    monkeypatch.setattr(memory, "huge_pages_offered", lambda: None)
    assert "attnlab's caches on huge pages: no (the kernel offers no transparent huge pages)" in machine_line()
    force_routes(huge_pages="off")
    assert "attnlab's caches on huge pages: off (ATTNLAB_HUGE_PAGES=off)" in machine_line()
