"""``--pd-transport`` is refused in one line where no PD role is taken, and reaches both roles."""

from __future__ import annotations

import pytest

from xinfer.server.args import build_parser, pd_problem


@pytest.mark.parametrize(
    "flags, problem",
    [
        (["--pd-transport", "shm"], "--pd-transport needs --pd-server or --pd-client"),
        (["--pd-transport", "gloo", "--pd-server"], None),
        (["--pd-transport", "shm", "--pd-client", "--pd-url", "http://x"], None),
        (["--pd-server"], None),
    ],
)
def test_pd_transport_needs_a_role(flags, problem):
    assert pd_problem(build_parser().parse_args(flags)) == problem


def test_an_unknown_transport_is_refused():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--pd-transport", "tcp", "--pd-server"])
