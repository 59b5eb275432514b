"""The checksums of watcher/runtime/checksum.py: wordsum.c (one pass, built
here with the system compiler) and the torch fallback must give the same
value for every tensor, or a replay would disagree with its record."""

import pytest
import torch

from watcher.runtime import checksum, wordsum


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    built = wordsum.build(tmp_path_factory.mktemp("wordsum"))
    assert built is not None, "wordsum.c did not build (is gcc installed?)"
    loaded = wordsum.load(str(built))
    assert loaded is not None
    return loaded


def tensors():
    g = torch.Generator().manual_seed(7)
    out = [torch.randn(n, generator=g) for n in (1, 3, 17, 1000, 1 << 20)]
    out += [torch.randn(33, 9, generator=g, dtype=torch.float64), torch.randint(-9, 9, (301,), generator=g),
            torch.randint(-9, 9, (77,), generator=g, dtype=torch.int32), torch.randn(40, 40, generator=g).t(),
            torch.randn(5, generator=g, dtype=torch.bfloat16), torch.tensor([True, False, True]),
            torch.randn(6, generator=g, dtype=torch.complex64), torch.empty(0), torch.tensor(-0.0),
            torch.tensor(float("nan")), torch.full((1 << 16,), -1, dtype=torch.int32)]  # the last wraps
    return out


def bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def with_lib(monkeypatch, value):
    monkeypatch.setattr(checksum, "LIB", value)


def test_wordsum_and_torch_agree_on_every_tensor(lib, monkeypatch):
    with_lib(monkeypatch, None)
    expected = [checksum.tensor_sum(t) for t in tensors()]
    with_lib(monkeypatch, lib)
    assert [checksum._words(t) is not None for t in tensors()] == \
        [True] * 8 + [False, False, False, False, True, True, True, True]
    assert [checksum.tensor_sum(t) for t in tensors()] == expected
    # A flipped bit changes the sum.
    t = torch.randn(1000)
    before = checksum.tensor_sum(t)
    t.view(torch.int32)[123] ^= 1 << 30
    assert checksum.tensor_sum(t) != before


def test_clone_with_sum_copies_exactly_and_sums_like_tensors_sum(lib, monkeypatch):
    ts = tensors()
    with_lib(monkeypatch, None)
    expected = checksum.tensors_sum(ts)
    for value in (None, lib):
        with_lib(monkeypatch, value)
        copies, total = checksum.clone_with_sum(ts)
        assert total == expected
        for c, t in zip(copies, ts):
            assert c.dtype == t.dtype and c.shape == t.shape and (c.data_ptr() != t.data_ptr() or not t.numel())
            assert torch.equal(bits(c), bits(t))  # bit for bit: NaNs and -0.0 included


def test_parameter_checksum_is_the_same_with_and_without_wordsum(lib, monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 3))
    params = list(model.parameters())
    with_lib(monkeypatch, None)
    expected = checksum.params_sum(params)
    assert checksum.ParamChecksum()(params) == expected
    with_lib(monkeypatch, lib)
    ps = checksum.ParamChecksum()
    assert ps(params) == expected
    assert ps.ranges  # the one-pass path was taken
    with torch.no_grad():
        params[2].view(-1)[5] += 1.0  # a change after the views were built is seen
    with_lib(monkeypatch, None)
    changed = checksum.params_sum(params)
    with_lib(monkeypatch, lib)
    assert changed != expected and ps(params) == changed


def test_each_part_of_the_parameter_checksum_sees_exactly_its_own_words(lib, monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(64, 129), torch.nn.GELU(), torch.nn.Linear(129, 3))
    params = list(model.parameters())
    words = sum(p.numel() for p in params)
    with_lib(monkeypatch, None)
    expected = [checksum.params_sum(params, q) for q in range(checksum.PARTS)]
    with_lib(monkeypatch, lib)
    ps = checksum.ParamChecksum()
    assert [ps(params, q) for q in range(checksum.PARTS)] == expected
    assert ps(params) == checksum.params_sum(params)
    # Every word lies in exactly one part: a change to any one word changes
    # that part's sum and no other.
    flat_at = 0
    for i, p in enumerate(params):
        for j in (0, p.numel() // 2, p.numel() - 1):
            word = flat_at + j
            part = next(q for q in range(checksum.PARTS) if checksum.part_range(words, q)[0] <= word
                        < checksum.part_range(words, q)[1])
            with torch.no_grad():
                saved = p.view(-1)[j].clone()
                p.view(-1)[j] += 1.0
            got = [ps(params, q) for q in range(checksum.PARTS)]
            assert [q for q in range(checksum.PARTS) if got[q] != expected[q]] == [part]
            with torch.no_grad():
                p.view(-1)[j] = saved
            assert [ps(params, q) for q in range(checksum.PARTS)] == expected
        flat_at += p.numel()


def test_grad_norm_in_one_pass_matches_the_norm_and_repeats_bit_for_bit(lib, monkeypatch):
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(n, generator=g) * s for n, s in ((1, 1.0), (15, 1e-3), (1000, 10.0), (300_001, 0.5))]
    exact = float(torch.sqrt(sum((t.double() ** 2).sum() for t in grads)))
    with_lib(monkeypatch, lib)
    norm = checksum.GradNorm()
    fast = norm(grads)
    assert norm.ptrs is not None  # the C path ran
    assert abs(fast - exact) <= 1e-6 * exact
    assert norm([t.clone() for t in grads]) == fast  # same values elsewhere in memory: same bits
    grads[2][500] = float("nan")
    assert norm(grads) != norm(grads)  # NaN propagates (the non-finite detector reads it)
    grads[2][500] = float("inf")
    assert norm(grads) == float("inf")
    for big in (3e38, 4e36, 2e19):  # finite, but the squares overflow float32: infinite, as torch's norm
        grads[2][500] = big
        assert norm(grads) == float("inf") == float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))))
    grads[2][500] = 1e19
    assert abs(norm(grads) / float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))) - 1) < 1e-6
    with_lib(monkeypatch, None)
    grads[2][500] = 1.0
    slow = checksum.GradNorm()([t.clone() for t in grads])
    assert abs(slow - float(torch.sqrt(sum((t.double() ** 2).sum() for t in grads)))) <= 1e-9 * slow
    assert checksum.GradNorm()([]) == 0.0


def test_reduced_gradient_norm_comes_from_the_output_checksum_pass(lib, monkeypatch):
    g = torch.Generator().manual_seed(5)
    # Two "buckets" holding the gradients back to back, as DDP's reducer lays them out.
    grads = [torch.randn(n, generator=g) * s for n, s in ((7, 1.0), (1000, 0.1), (40_003, 2.0), (70_000, 1e-2))]
    buckets = [torch.cat([t.reshape(-1) for t in grads[:2]]), torch.cat([t.reshape(-1) for t in grads[2:]])]
    with_lib(monkeypatch, lib)
    expected_sums = [checksum.tensors_sum([b]) for b in buckets]
    parts = [checksum.tensors_sum_sumsq([b]) for b in buckets]
    assert [p[0] for p in parts] == expected_sums  # the checksum is unchanged
    assert [p[2] for p in parts] == [1007, 110_003]
    exact = float(torch.sqrt(sum((t.double() ** 2).sum() for t in grads)))

    norm = checksum.ReducedGradNorm()
    # Completed out of order (gloo's threads): the parts are added by issue order.
    norm.add({"step": 4, "group": "0", "seq": 9, "reduce_op": "SUM"}, parts[1][1], parts[1][2])
    norm.add({"step": 4, "group": "0", "seq": 8, "reduce_op": "SUM"}, parts[0][1], parts[0][2])
    got = norm(4, grads)
    assert abs(got - exact) <= 1e-6 * exact
    in_order = checksum.ReducedGradNorm()
    for seq, p in zip((8, 9), parts):
        in_order.add({"step": 4, "group": "0", "seq": seq, "reduce_op": "SUM"}, p[1], p[2])
    assert in_order(4, grads) == got  # bit for bit, whatever the completion order

    # Reductions that do not cover the gradients exactly (a user's loss
    # allreduce besides, a MAX, none at all): the gradients are read instead.
    direct = checksum.GradNorm()(grads)
    assert norm(5, grads) == direct
    norm.add({"step": 6, "group": "0", "seq": 10, "reduce_op": "SUM"}, parts[0][1], parts[0][2])
    assert norm(6, grads) == direct
    for p in parts:
        norm.add({"step": 7, "group": "0", "seq": 11, "reduce_op": "MAX"}, p[1], p[2])
    assert norm(7, grads) == direct
    norm.add({"step": 8, "group": "0", "seq": 12, "reduce_op": "SUM"}, None, 0)  # not float32
    assert norm(8, grads) == direct and not norm.parts

    # Overflow and NaN behave as the direct norm's.
    buckets[1][5] = 3e38
    over = checksum.tensors_sum_sumsq([buckets[1]])
    norm.add({"step": 9, "group": "0", "seq": 13}, parts[0][1], parts[0][2])
    norm.add({"step": 9, "group": "0", "seq": 14}, over[1], over[2])
    assert norm(9, grads) == float("inf")
    with_lib(monkeypatch, None)
    assert checksum.tensors_sum_sumsq(buckets)[1] is None  # without wordsum.c: no fused pass


def test_fused_pass_gives_the_same_bits_as_the_separate_ones_and_gather_copies_exactly(lib):
    # The checksum-and-sum-of-squares pass (vector code) must give the word
    # sum of ws_sum and the sum of squares of ws_sumsq_f32_many bit for bit,
    # whatever the length and alignment: a replay recomputes one with the other.
    import ctypes

    g = torch.Generator().manual_seed(11)
    base = torch.randn(300_100, generator=g) * 3
    base[17] = float("inf")
    for start in (0, 1, 3):
        for n in (1, 15, 16, 17, 1023, 1024, 1025, 4103, 300_000):
            x = base[start:start + n]
            part = ctypes.c_double()
            words = lib.ws_sum_sumsq_f32(x.data_ptr(), n, ctypes.byref(part))
            assert words == lib.ws_sum(x.data_ptr(), n)
            many = lib.ws_sumsq_f32_many((ctypes.c_uint64 * 1)(x.data_ptr()), (ctypes.c_uint64 * 1)(n), 1)
            assert part.value == many or (part.value != part.value and many != many), (start, n)
    # State copies: streamed into any alignment, every byte exact.
    srcs = [torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, generator=g) for n in (1, 7, 4096, 65_537)]
    sizes = [t.numel() * 4 - (3 if i == 1 else 0) for i, t in enumerate(srcs)]  # one odd byte count
    for off in (0, 1, 8, 13):
        dst = torch.zeros(sum(sizes) + 32, dtype=torch.uint8)
        lib.ws_gather(dst.data_ptr() + off, (ctypes.c_uint64 * 4)(*(t.data_ptr() for t in srcs)),
                      (ctypes.c_uint64 * 4)(*sizes), 4)
        want = torch.cat([t.view(torch.uint8)[:s] for t, s in zip(srcs, sizes)])
        assert torch.equal(dst[off:off + len(want)], want)
        assert not dst[:off].any() and not dst[off + len(want):].any()
