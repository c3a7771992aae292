"""The console script: it turns off gRPC's EventEngine I/O for channels and listeners before any command imports
grpc (its CPU effect is `bench live`'s to show), and leaves an operator's own GRPC_EXPERIMENTS alone."""

from __future__ import annotations

import os

import pytest

from switchyard import cli


def test_sets_the_grpc_experiments_before_the_command_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRPC_EXPERIMENTS", "")  # recorded, so the teardown restores the test run's own state
    monkeypatch.delenv("GRPC_EXPERIMENTS")
    assert cli.main(["--help"]) == 0
    assert os.environ["GRPC_EXPERIMENTS"] == "-event_engine_client,-event_engine_listener"


@pytest.mark.parametrize("theirs", ["", "-event_engine_dns"])
def test_an_operators_grpc_experiments_win(monkeypatch: pytest.MonkeyPatch, theirs: str) -> None:
    monkeypatch.setenv("GRPC_EXPERIMENTS", theirs)
    assert cli.main(["--help"]) == 0
    assert os.environ["GRPC_EXPERIMENTS"] == theirs
