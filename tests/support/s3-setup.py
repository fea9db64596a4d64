"""Prepares an S3 test server for the s3:// origin tests and the `origin` benchmark (run
with the test venv's python).

    s3-setup.py ENDPOINT BUCKET PREFIX DIR [KEY:SECRET]

Waits (at most 60 s) for the server to accept connections. Without KEY:SECRET the server is
moto, which must run with INITIAL_NO_AUTH_ACTION_COUNT=3: the first three requests (the IAM
calls below) go unauthenticated; every later request must be signed with a key of an IAM
user whose policy allows it, so wrong credentials are refused as by real S3. Creates such a
user with an access key allowed everything. With KEY:SECRET (a server with fixed
credentials, such as s3rver's S3RVER:S3RVER) that key is used and no IAM call is made.
Then (signed with the key) creates the bucket and uploads every regular file under DIR to
PREFIX/<relative path>. Prints {"key": ..., "secret": ...}.
"""

import json
import os
import socket
import sys
import time
from urllib.parse import urlparse

import boto3

endpoint, bucket, prefix, root = sys.argv[1:5]
static = sys.argv[5] if len(sys.argv) > 5 else None

url = urlparse(endpoint)
deadline = time.monotonic() + 60
while True:
    try:
        socket.create_connection((url.hostname, url.port), timeout=2).close()
        break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit(f"no S3 server answered at {endpoint} within 60 s")
        time.sleep(0.2)

common = dict(endpoint_url=endpoint, region_name="us-east-1")
if static:
    key_id, secret = static.split(":", 1)
else:
    iam = boto3.client("iam", aws_access_key_id="setup", aws_secret_access_key="setup", **common)
    iam.create_user(UserName="shardcast")
    iam.put_user_policy(
        UserName="shardcast",
        PolicyName="all",
        PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
        ),
    )
    key = iam.create_access_key(UserName="shardcast")["AccessKey"]
    key_id, secret = key["AccessKeyId"], key["SecretAccessKey"]
s3 = boto3.client("s3", aws_access_key_id=key_id, aws_secret_access_key=secret, **common)
s3.create_bucket(Bucket=bucket)
for dirpath, _, names in os.walk(root):
    for name in names:
        path = os.path.join(dirpath, name)
        rel = os.path.relpath(path, root)
        with open(path, "rb") as f:
            s3.put_object(Bucket=bucket, Key=f"{prefix}/{rel}", Body=f.read())
print(json.dumps({"key": key_id, "secret": secret}))
