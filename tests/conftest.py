"""Fixtures shared across the test suite."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    """One SeaweedFS server for the whole session (tests use their own buckets or prefixes)."""
    # Imported here: boto3 is needed only by the tests that use the server.
    from tests.s3server import SeaweedServer

    server = SeaweedServer(tmp_path_factory.mktemp("seaweed"), bucket="lorafleet-test")
    server.start()
    yield server
    server.stop()
