"""Suite-wide fixtures and rules.

Under CI=true a test skipped for a missing prerequisite is a failure: a skip there means CI did not install
what the README's `make test` promises.
"""

from __future__ import annotations

import os

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if (
        os.environ.get("CI") == "true"
        and report.skipped
        and call.when in ("setup", "call")
        and not item.get_closest_marker("skip_in_ci_ok")
    ):
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true (missing prerequisite?): {report.longrepr}"


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A throwaway CA with server and client certificates (tests/tls_certs.py), made once per run."""
    import shutil

    from tls_certs import make_pki

    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is missing (Debian package openssl; make sysdeps installs it)")
    return make_pki(tmp_path_factory.mktemp("pki"))
