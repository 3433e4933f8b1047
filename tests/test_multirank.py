"""tests/multirank.py's own bookkeeping: which tests a shared torchrun that
died fails, and that the real launches mark the sections they finish."""

from __future__ import annotations

import pytest

from tests import multirank


def test_a_dead_launch_fails_only_the_sections_its_ranks_did_not_finish(tmp_path, request, multirank_launched):
    """A launch that dies (a rank killed by a signal) fails the sections some
    rank had not finished, with the launch's log; sections every rank got
    through keep their written results. And the real launches of this run
    that ended well marked every section they ran on every rank."""
    fake = multirank.Launched({}, tmp_path / "parity", tmp_path / "gather", {2: "log of 2", 4: "log of 4"}, tmp_path)
    for section, rank in (("parity", 0), ("parity", 1), ("gather", 0), ("test_llama_tied", 0), ("test_llama_tied", 1)):
        (tmp_path / multirank.marker(section, 2, rank)).touch()
    assert fake.failed("parity") == {4: "log of 4"}
    assert fake.failed("gather") == {2: "log of 2", 4: "log of 4"}  # rank 1 never got through it
    assert fake.extra("test_llama_tied") == tmp_path / "test_llama_tied"
    with pytest.raises(pytest.fail.Exception, match="log of 2"):
        fake.extra("test_expert_parallel")

    real = multirank_launched
    for nproc, (parity, gather, _, extras) in multirank.launches(multirank.session_files(request.session)).items():
        if nproc in real.errors:  # a dead launch: its unfinished sections' own tests report it
            continue
        for section in ["parity"] * bool(parity) + ["gather"] * bool(gather) + list(extras):
            assert len(list(real.root.glob(multirank.marker(section, nproc)))) == nproc, (section, nproc)
