"""Fixtures of the security tests: the s3 and redis fixtures are reused, not duplicated."""

from ..redis.conftest import redis_server_factory  # noqa: F401  (fixture)
from ..s3.conftest import _fake_aws_env, bucket, moto_endpoint, s3  # noqa: F401  (fixtures)
