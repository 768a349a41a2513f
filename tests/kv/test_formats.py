import pytest
import torch

from xinfer.kv import KVFormat, codes, formats, get_format, hadamard
from xinfer.kv.codecs import Fp8, LloydMax, Plain, Uniform

HEAD_DIMS = [64, 128, 256]


def _data(head_dim: int, tokens: int = 64, heads: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(head_dim)
    # keys with a few outlier channels, as real keys have
    k = torch.randn(tokens, heads, head_dim, generator=gen)
    k[..., :4] *= 8
    v = torch.randn(tokens, heads, head_dim, generator=gen)
    return k, v


def _uniform_bound(x: torch.Tensor, levels: int) -> torch.Tensor:
    """Half a step of the absmax grid, per (token, head)."""
    return codes.absmax(x).unsqueeze(-1) / (levels - 1) * 1.0001


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_auto_is_lossless(head_dim):
    k, v = _data(head_dim)
    k2, v2 = get_format("auto").dequantize(get_format("auto").quantize(k, v))
    assert torch.equal(k2, k) and torch.equal(v2, v)


E4M3 = KVFormat("e4m3", Fp8(), Fp8())  # the codec on both sides, nothing rotated


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_e4m3_within_its_rounding(head_dim):
    k, v = _data(head_dim)
    k2, v2 = E4M3.dequantize(E4M3.quantize(k, v))
    for x, x2 in ((k, k2), (v, v2)):
        bound = x.abs() / 16 + codes.absmax(x).unsqueeze(-1) * 2**-18
        assert ((x2 - x).abs() <= bound).all()


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_fp8_stores_rotated_keys_and_plain_values_in_e4m3(head_dim):
    k, v = _data(head_dim)
    fmt = get_format("fp8")
    keys, values = fmt.decode(fmt.quantize(k, v))
    want_keys, want_values = E4M3.decode(E4M3.quantize(hadamard.rotate(k), v))
    assert torch.equal(keys, want_keys) and torch.equal(values, want_values)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("name,levels", [("turbo8", 255), ("turbo4", 16)])
def test_rotated_keys_within_half_a_step_of_the_rotated_grid(name, levels, head_dim):
    k, v = _data(head_dim)
    fmt = get_format(name)
    rotated, _ = fmt.decode(fmt.quantize(k, v))
    exact = hadamard.rotate(k)
    assert ((rotated - exact).abs() <= _uniform_bound(exact, levels) + 1e-5).all()
    # and the inverse rotation keeps the error's norm
    k2, _ = fmt.dequantize(fmt.quantize(k, v))
    torch.testing.assert_close((k2 - k).norm(dim=-1), (rotated - exact).norm(dim=-1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("name", ["turbo8", "turbo4", "turbo3"])
def test_rotated_values_within_half_a_step_of_the_rotated_grid(name, head_dim):
    k, v = _data(head_dim)
    fmt = get_format(name)
    _, rotated = fmt.decode(fmt.quantize(k, v))
    exact = hadamard.rotate(v)
    assert ((rotated - exact).abs() <= _uniform_bound(exact, 16) + 1e-5).all()
    _, v2 = fmt.dequantize(fmt.quantize(k, v))
    torch.testing.assert_close((v2 - v).norm(dim=-1), (rotated - exact).norm(dim=-1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("name", ["turbo3-lm", "turbo4-lm"])
def test_lloyd_max_keys_take_the_nearest_scaled_level(name, head_dim):
    k, v = _data(head_dim)
    fmt = get_format(name)
    stored = fmt.quantize(k, v)
    rotated, _ = fmt.decode(stored)
    exact = hadamard.rotate(k)
    levels = fmt.key._levels(k.device) * stored["k_scale"][..., None, None]  # [T, H, 1, L]
    nearest = levels.squeeze(-2).gather(-1, (exact.unsqueeze(-1) - levels).abs().argmin(-1))
    torch.testing.assert_close(rotated, nearest, rtol=0, atol=1e-5)
    torch.testing.assert_close(stored["k_scale"], exact.pow(2).mean(-1).sqrt())  # the RMS


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_value_rotation_is_undone_once_after_attention(head_dim):
    fmt = get_format("turbo4")
    k, v = _data(head_dim, tokens=16)
    probs = torch.rand(8, 16).softmax(-1)  # any convex weights over the tokens
    _, rotated = fmt.decode(fmt.quantize(k, v))
    _, v2 = fmt.dequantize(fmt.quantize(k, v))
    out = torch.einsum("qt,thd->qhd", probs, rotated)
    torch.testing.assert_close(fmt.finish_output(out), torch.einsum("qt,thd->qhd", probs, v2), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_error_shrinks_with_bits(head_dim):
    k, v = _data(head_dim)

    def key_error(name: str) -> float:
        k2, _ = get_format(name).dequantize(get_format(name).quantize(k, v))
        return ((k2 - k).norm() / k.norm()).item()

    errors = [key_error(n) for n in ("turbo8", "fp8", "turbo4", "turbo3")]
    assert errors == sorted(errors) and errors[-1] < 0.2


@pytest.mark.parametrize("levels,bits", [(7, 3), (16, 4)])
def test_lloyd_max_beats_uniform_on_rotated_keys(levels, bits):
    k, v = _data(128, tokens=256)
    uniform = KVFormat("uniform", Uniform(levels, bits), Plain(), rotate_keys=True)
    lloyd_max = KVFormat("lloyd-max", LloydMax(2**bits, bits), Plain(), rotate_keys=True)

    def key_error(fmt: KVFormat) -> float:
        k2, _ = fmt.dequantize(fmt.quantize(k, v))
        return ((k2 - k).norm() / k.norm()).item()

    assert key_error(lloyd_max) < key_error(uniform)


@pytest.mark.parametrize("name", list(formats()))
def test_stored_tensors_match_the_declared_layout(name):
    fmt = get_format(name)
    k, v = _data(128, tokens=3, heads=2)
    stored = fmt.quantize(k.half(), v.half())
    fields = fmt.fields(128, torch.float16)
    assert list(stored) == list(fields)
    for n, t in stored.items():
        assert t.shape == (3, 2, *fields[n].trailing) and t.dtype == fields[n].dtype
    assert sum(t[0, 0].numel() * t.element_size() for t in stored.values()) == fmt.bytes_per_token(128, torch.float16)


def test_packing_round_trips():
    c4 = torch.randint(0, 16, (5, 128), dtype=torch.uint8)
    c3 = torch.randint(0, 8, (5, 128), dtype=torch.uint8)
    c8 = torch.randint(0, 255, (5, 128), dtype=torch.uint8)
    eight = Uniform(255, 8)
    assert torch.equal(eight._unpack(eight._pack(c8)), c8) and eight._pack(c8).shape[-1] == 128
    assert torch.equal(codes.unpack4(codes.pack4(c4)), c4) and codes.pack4(c4).shape[-1] == 64
    assert torch.equal(codes.unpack3(codes.pack3(c3)), c3) and codes.pack3(c3).shape[-1] == 48


def test_4bit_byte_holds_one_dim_of_each_half():
    """The layout the kernels read halves from: byte j = dim j | dim D/2 + j << 4."""
    c4 = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    packed = codes.pack4(c4)
    assert torch.equal(packed & 0xF, c4[:, :32]) and torch.equal(packed >> 4, c4[:, 32:])


def test_3bit_planes_hold_low_pairs_then_high_bits():
    """The layout the kernels read halves from (``codes.pack3``)."""
    c3 = torch.randint(0, 8, (3, 64), dtype=torch.uint8)
    packed = codes.pack3(c3).int()
    low, high = packed[:, :16], packed[:, 16:]
    for q in range(4):
        assert torch.equal((low >> (2 * q)) & 3, c3[:, 16 * q : 16 * (q + 1)].int() & 3)
    for k in range(8):
        assert torch.equal((high >> k) & 1, c3[:, 8 * k : 8 * (k + 1)].int() >> 2)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_turbo3_keys_take_the_nearest_level_of_the_rms_grid(head_dim):
    k, v = _data(head_dim)
    fmt = get_format("turbo3")
    stored = fmt.quantize(k, v)
    rotated, _ = fmt.decode(stored)
    exact = hadamard.rotate(k)
    rms = exact.pow(2).mean(-1).sqrt()
    torch.testing.assert_close(stored["k_scale"], rms * fmt.key.rms_clip)
    step = (stored["k_scale"] / 3.5).unsqueeze(-1)  # 8 levels at +-0.5 .. +-3.5 steps
    inside = exact.abs() <= stored["k_scale"].unsqueeze(-1)
    assert ((rotated - exact).abs()[inside] <= (step / 2 * 1.0001 + 1e-6).expand_as(exact)[inside]).all()
    saturated = stored["k_scale"].unsqueeze(-1).expand_as(exact)[~inside]
    assert (~inside).any() and torch.allclose(rotated.abs()[~inside], saturated)


def test_rms_grid_beats_absmax_grid_on_rotated_keys():
    k, v = _data(128, tokens=256)

    def key_error(codec) -> float:
        fmt = KVFormat("k", codec, Plain(), rotate_keys=True)
        k2, _ = fmt.dequantize(fmt.quantize(k, v))
        return ((k2 - k).norm() / k.norm()).item()

    assert key_error(get_format("turbo3").key) < key_error(Uniform(7, 3))


def test_capacity_against_bf16_in_a_fixed_budget():
    budget = 1 << 30
    tokens = {n: budget // f.bytes_per_token(128, torch.bfloat16) for n, f in formats().items()}
    assert tokens["turbo4"] >= 3.7 * tokens["auto"]
    assert tokens["turbo3"] >= 4.2 * tokens["auto"]
    assert tokens["turbo8"] >= 2.5 * tokens["auto"] and tokens["fp8"] >= 1.9 * tokens["auto"]


def test_bytes_per_token_table():
    table = {
        n: [formats()[n].bytes_per_token(d) for d in HEAD_DIMS] for n in ("auto", "fp8", "turbo8", "turbo4", "turbo3")
    }
    assert table == {
        "auto": [256, 512, 1024],
        "fp8": [136, 264, 520],
        "turbo8": [104, 200, 392],
        "turbo4": [72, 136, 264],
        "turbo3": [64, 120, 232],
    }


def test_prepared_query_scores_like_dequantized_keys():
    fmt = get_format("turbo4")
    q, (k, v) = torch.randn(8, 4, 128), _data(128, tokens=8)
    rotated_keys, _ = fmt.decode(fmt.quantize(k, v))
    k2, _ = fmt.dequantize(fmt.quantize(k, v))
    torch.testing.assert_close((fmt.prepare_query(q) * rotated_keys).sum(-1), (q * k2).sum(-1), rtol=1e-4, atol=1e-3)


def test_the_engine_option_takes_every_registered_format_and_no_other():
    from pydantic import ValidationError

    from xinfer.config import CacheConfig

    assert all(CacheConfig(kv_cache_dtype=name).kv_cache_dtype == name for name in formats())
    with pytest.raises(ValidationError, match="unknown KV cache format 'fp9'"):
        CacheConfig(kv_cache_dtype="fp9")
