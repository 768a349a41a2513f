"""``--d`` resolved against the machine's accelerator (faked here): kept where it names
devices to choose or split over, ignored with a warning where the accelerator is always one
device (a Mac's GPU), refused in one line where there is none or fewer than it names."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from xinfer.server.args import parse_args
from xinfer.server.launch import device_ids, device_of, parallel_options


@pytest.fixture
def accelerator(monkeypatch):
    def fake(kind: str | None, count: int) -> None:
        device = torch.device(kind) if kind else None
        monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: device)
        monkeypatch.setattr(torch.accelerator, "device_count", lambda: count)

    return fake


def resolved(argv: list[str]) -> tuple[str, dict]:
    args = parse_args(argv)
    ids = device_ids(args)
    return device_of(args, ids), parallel_options(args, ids)


@pytest.mark.parametrize("flag", ["1", "0,1"])
def test_on_a_single_device_other_ids_are_ignored_with_a_warning(accelerator, caplog, flag):
    accelerator("mps", 1)
    with caplog.at_level(logging.WARNING, logger="xinfer"):
        device, parallel = resolved(["--d", flag])
    assert (device, parallel["tensor_parallel_size"], parallel["device_ids"]) == ("mps:0", 1, [0])
    assert f"--d {flag} ignored: this machine's accelerator (mps) is one device" in caplog.text


def test_the_single_device_named_needs_no_warning(accelerator, caplog):
    accelerator("mps", 1)
    with caplog.at_level(logging.WARNING, logger="xinfer"):
        assert resolved(["--d", "0"])[0] == "mps:0"
    assert caplog.text == ""


def test_several_devices_are_chosen_and_split_over(accelerator):
    accelerator("cuda", 4)
    device, parallel = resolved(["--d", "2,3"])
    assert (device, parallel["tensor_parallel_size"], parallel["device_ids"]) == ("cuda:2", 2, [2, 3])


@pytest.mark.parametrize(("flag", "count", "found"), [("0,1", 1, "cuda:0"), ("2", 2, "cuda:0, cuda:1")])
def test_more_gpus_than_found_are_refused_in_one_line(accelerator, flag, count, found):
    accelerator("cuda", count)
    message = f"--d {flag} names cuda devices this machine lacks: it has {count} ({found})"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        resolved(["--d", flag])


def test_cpu_ranks_are_not_devices(accelerator):
    accelerator("mps", 1)
    device, parallel = resolved(["--cpu", "--d", "0,1"])
    assert (device, parallel["tensor_parallel_size"], parallel["device_ids"]) == ("cpu", 2, None)


def test_ids_without_an_accelerator_are_one_line(accelerator):
    accelerator(None, 0)
    with pytest.raises(ValueError, match=r"^--d 1 names an accelerator, and this machine has none: run without --d"):
        resolved(["--d", "1"])
