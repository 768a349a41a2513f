"""Measured tiles kept on disk (:mod:`xinfer_cuda.tile_cache`): a later start takes what an earlier one measured,
and measures again where the candidates, the kernels or the file changed. Over a Q8_0 weight in planes with a fake
timer (the second candidate fastest), under the interpreter on the CPU or on the GPU."""

from __future__ import annotations

import json
import os

import pytest
import torch

import xinfer_cuda.tile_cache
from tests.backends.test_gguf_planes import weight
from xinfer_cuda.kernels.gguf_planes import LAYOUTS
from xinfer_cuda.quant_weights import MeasuredTiles, plane_candidates
from xinfer_cuda.tile_cache import NotMeasured, TileCache, default_tile_cache, remembered

DEVICE = torch.device(os.environ["XINFER_KERNEL_DEVICE"])
ROWS = (1, 3)


def choices(path, timed: list[int]) -> list:
    """The tiles a new MeasuredTiles over the cache at ``path`` picks for 1 and 3 rows; ``timed`` gets the rows of
    each candidate it times."""

    def timer(call, weights):
        y = call(weights[0])
        timed.append(y.shape[0])
        return 1.0 if timed.count(y.shape[0]) == 2 else 2.0

    tiles = MeasuredTiles(timer, copies=lambda w: [w], planes=True, cache=TileCache(path))
    _, planes, k = weight("Q8_0", n=4, tiles=1)
    return [tiles(torch.randn(rows, k, device=DEVICE), planes, "Q8_0", None) for rows in ROWS]


def candidates(rows: int) -> tuple:
    return plane_candidates(LAYOUTS["Q8_0"], rows, int8_activations=False)


def test_a_later_start_takes_the_tiles_an_earlier_one_measured(tmp_path):
    path, timed = tmp_path / "tiles.json", []
    first = choices(path, timed)
    assert first == [candidates(1)[1], candidates(16)[1]]
    assert timed == [1] * len(candidates(1)) + [3] * len(candidates(16))
    assert len(json.loads(path.read_text())) == 2
    again: list[int] = []
    assert choices(path, again) == first and again == []  # nothing timed


def test_a_stored_tile_no_longer_offered_is_measured_again(tmp_path):
    path = tmp_path / "tiles.json"
    choices(path, [])
    stored = json.loads(path.read_text())
    one_row = next(key for key in stored if "'Q8_0', 1," in key)
    path.write_text(json.dumps({**stored, one_row: "PlaneGemvConfig(block_n=3)"}))
    timed: list[int] = []
    assert choices(path, timed)[0] == candidates(1)[1]
    assert timed == [1] * len(candidates(1))  # the 3-row tile still from the file


def test_changed_kernels_or_an_unreadable_file_measure_again(tmp_path, monkeypatch):
    path = tmp_path / "tiles.json"
    choices(path, [])
    monkeypatch.setattr(xinfer_cuda.tile_cache, "kernels_digest", lambda: "another")
    timed: list[int] = []
    choices(path, timed)
    assert len(timed) == len(candidates(1)) + len(candidates(16))
    path.write_text("{not json")
    timed.clear()
    choices(path, timed)
    assert len(timed) == len(candidates(1)) + len(candidates(16))
    assert len(json.loads(path.read_text())) == 2  # written whole again


@pytest.mark.parametrize(("setting", "expected"), [("off", None), ("{tmp}/t.json", "{tmp}/t.json"),
                                                   ("", "{tmp}/xdg/xinfer/tiles.json")])  # fmt: skip
def test_the_cache_file_is_the_one_the_environment_names(tmp_path, monkeypatch, setting, expected):
    monkeypatch.setenv("XINFER_TILE_CACHE", setting.format(tmp=tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    cache = default_tile_cache()
    assert (cache.path if cache else None) == (expected and tmp_path.joinpath(expected.format(tmp=tmp_path)))


def test_a_baseline_choice_is_kept_too(tmp_path):
    """None (cuBLAS, the heuristic's tiles: what the float linears and the experts choose where no tile beats it)
    is an option like the tiles."""
    measured: list[int] = []

    def measure() -> None:
        measured.append(1)

    for _ in range(2):  # two starts
        cache = TileCache(tmp_path / "tiles.json")
        assert remembered(cache, torch.device("cpu"), ("linear", 4), ("a tile", None), measure) is None
    assert measured == [1]


def test_a_choice_made_without_measuring_is_not_kept(tmp_path):
    """Out of memory, a measurement falls back on its first option (:class:`NotMeasured`): taken now, measured
    again next start."""

    def out_of_memory() -> str:
        raise NotMeasured("first tile")

    cache = TileCache(tmp_path / "tiles.json")
    assert remembered(cache, torch.device("cpu"), ("linear", 2), ("first tile", "best tile"), out_of_memory) == (
        "first tile"
    )
    assert cache.choices == {} and not (tmp_path / "tiles.json").exists()
    assert remembered(None, torch.device("cpu"), ("linear", 2), ("first tile",), out_of_memory) == "first tile"
