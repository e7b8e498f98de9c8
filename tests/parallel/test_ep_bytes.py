"""The planner's expert-parallel traffic is what a real training step sends (ep_bytes.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import torchrun

pytestmark = pytest.mark.dist

SCRIPT = Path(__file__).with_name("ep_bytes.py")
CASES = {
    "ep=2": (2, ["parallel.ep=2"]),
    # ep borrows the tp pair, each tp rank routes half the tokens; full recompute runs the
    # forward all-to-alls once more in backward.
    "tp=2 x ep=2, recompute=full": (4, ["parallel.tp=2", "parallel.ep=2", "recompute=full"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_all_to_all_bytes_equal_the_planner(name, tmp_path):
    n, layout = CASES[name]
    ranks = torchrun(SCRIPT, n, tmp_path, "model=mixtral_debug", f"hardware.devices_per_node={n}",
                     *layout)  # fmt: skip
    for rank, out in ranks.items():
        assert out["planned"] > 0
        assert out["sent"] == pytest.approx(out["planned"], rel=1e-9), f"rank {rank}: {out}"
