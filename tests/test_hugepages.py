"""Huge-page buffers (engine/hugepages.py): the same values in other memory, and engines built
with them give the same outputs as engines without."""
from __future__ import annotations

import pytest
import torch

from eagle_serve.engine import hugepages, kernels
from eagle_serve.engine.layers import Linear

native = kernels.native()
thp = hugepages.thp_mode() in ("always", "madvise")


def test_thp_mode_reads_the_bracketed_choice(tmp_path, monkeypatch):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    monkeypatch.setattr(hugepages, "_THP_ENABLED", str(f))
    assert hugepages.thp_mode() == "madvise"
    f.write_text("always madvise [never]\n")
    assert hugepages.thp_mode() == "never"
    assert not hugepages.enabled()
    monkeypatch.setattr(hugepages, "_THP_ENABLED", str(tmp_path / "absent"))
    assert hugepages.thp_mode() == "unavailable"
    assert not hugepages.enabled()


def test_env_switch_turns_them_off(monkeypatch):
    monkeypatch.setenv("EAGLE_SERVE_HUGEPAGES", "0")
    assert not hugepages.enabled()
    before = hugepages.stats()["advised_bytes"]
    t = hugepages.empty(5 << 20)
    assert t.numel() == 5 << 20 and t.dtype == torch.uint8
    assert hugepages.stats()["advised_bytes"] == before  # an ordinary allocation


@pytest.mark.skipif(not thp, reason="the kernel offers no transparent huge pages")
def test_empty_and_zeros_start_on_a_huge_page_and_are_advised(monkeypatch):
    monkeypatch.setenv("EAGLE_SERVE_HUGEPAGES", "1")
    before = hugepages.stats()["advised_bytes"]
    t = hugepages.empty(3 << 20)
    assert t.numel() == 3 << 20 and t.data_ptr() % hugepages.HUGE_PAGE == 0
    assert hugepages.stats()["advised_bytes"] - before == 4 << 20  # rounded up to whole huge pages
    t.fill_(7)  # writable, all of it
    assert int(t[-1]) == 7
    z = hugepages.zeros((3, 1000, 700), torch.bfloat16)
    assert z.shape == (3, 1000, 700) and z.dtype == torch.bfloat16 and not z.any()
    assert z.data_ptr() % hugepages.HUGE_PAGE == 0
    small = hugepages.empty(4096)  # below a huge page: an ordinary tensor
    assert small.numel() == 4096


@pytest.mark.parametrize("on", [False, True])
def test_arena_keeps_values_dtypes_and_shapes_each_on_its_own_page(monkeypatch, on):
    monkeypatch.setenv("EAGLE_SERVE_HUGEPAGES", "1" if on else "0")
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(64, 48, generator=g).to(torch.bfloat16), torch.empty(0),
          torch.randint(-128, 127, (3, 100, 64), generator=g, dtype=torch.int8),
          torch.randn(1000, 700, generator=g), None, torch.randn(5, generator=g, dtype=torch.float64)]
    out = hugepages.arena(ts)
    assert out[1] is ts[1] and out[4] is None  # empty / absent: as they were
    moved = [0, 2, 3, 5]
    for i in moved:
        assert out[i].dtype == ts[i].dtype and out[i].shape == ts[i].shape and out[i].is_contiguous()
        assert torch.equal(out[i], ts[i]) and out[i].data_ptr() != ts[i].data_ptr()
        assert out[i].data_ptr() % 64 == 0  # the kernels' vector loads
    ptrs = sorted(out[i].data_ptr() for i in moved)
    assert all((p - ptrs[0]) % hugepages.ALIGN == 0 for p in ptrs)
    assert ptrs[-1] - ptrs[0] < 4 << 20  # one buffer, one after another
    if on and thp:
        assert ptrs[0] % hugepages.HUGE_PAGE == 0
    out[0].zero_()  # views of the arena, not of the originals
    assert ts[0].abs().sum() > 0


@pytest.mark.skipif(native is None, reason="no native kernels on this CPU or no compiler")
def test_packed_weights_move_to_the_arena_and_compute_the_same(monkeypatch):
    from eagle_serve.engine.layers import weights_to_arena
    monkeypatch.setenv("EAGLE_SERVE_HUGEPAGES", "1")
    g = torch.Generator().manual_seed(1)
    lins = []
    for n, k in ((128, 64), (64, 96)):
        lin = Linear(k, n)
        lin.weight.data = torch.randn(n, k, generator=g).to(torch.bfloat16)
        lin.prepack()
        lins.append(lin)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    want = lins[0](x)
    old = [lin.native_weight.data_ptr() for lin in lins]
    moved = weights_to_arena(lins) if thp else 0
    if thp:
        assert moved > 0 and [lin.native_weight.data_ptr() for lin in lins] != old
    assert torch.equal(lins[0](x), want)


@pytest.mark.skipif(native is None, reason="no native kernels on this CPU or no compiler")
def test_engine_in_huge_pages_decodes_as_one_without(tiny_llama, monkeypatch):
    """bf16 (packed weights, native stack): greedy ids and logprobs equal, huge pages or not."""
    from eagle_serve.engine.sampling_params import SamplingParams
    from eagle_serve.server.llm import LLM
    outs = {}
    for on in ("0", "1"):
        monkeypatch.setenv("EAGLE_SERVE_HUGEPAGES", on)
        before = hugepages.stats()["advised_bytes"]
        llm = LLM(tiny_llama[0], dtype="bfloat16", device="cpu", kv_cache_tokens=16384, block_size=16)
        advised = hugepages.stats()["advised_bytes"] - before
        assert (advised > 0) == (on == "1" and thp)  # the KV cache at least (4 MiB here)
        if on == "1" and thp:
            assert llm.runner.kv.data.data_ptr() % hugepages.HUGE_PAGE == 0
        params = SamplingParams(max_tokens=12, temperature=0, logprobs=3, ignore_eos=True)
        res = llm.generate([[5, 9, 13, 40, 41], list(range(3, 40))], params)
        outs[on] = [(o.token_ids, [(x.logprob, x.top) for x in o.logprobs]) for o in res]
    assert outs["0"] == outs["1"]
