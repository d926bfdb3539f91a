"""The s3 backend suites run on moto and on a real Ceph RGW (tests/servers.py)."""

from tests.servers import s3_server_fixture

s3_endpoint = s3_server_fixture()
