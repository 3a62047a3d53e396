"""What the object-storage tests share: a real S3-compatible server (moto's, on 127.0.0.1) and a new
bucket in it for each test."""

import logging
import os
import uuid

import pytest

from helpers import free_port, s3_client


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server in a thread of this process, and the environment every ddplab process
    reads its endpoint and credentials from (as it would AWS's own)."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield env
    server.stop()
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def bucket(s3):
    """A new, empty bucket: s3://NAME."""
    name = f"b-{uuid.uuid4().hex[:12]}"
    s3_client(s3["AWS_ENDPOINT_URL"]).create_bucket(Bucket=name)
    return f"s3://{name}"
