"""docs/slurm.md's sweeps, run on the test cluster as the page shows them (tests/test_docs.py)."""

from __future__ import annotations

import pytest
from test_docs import check, params

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("block", params("slurm"))
def test_block_matches_what_its_command_prints(block, slurm_env):
    check(block)
