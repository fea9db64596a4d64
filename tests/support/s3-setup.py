"""Prepares the moto S3 server of the s3:// origin tests (run with the test venv's python).

    s3-setup.py ENDPOINT BUCKET PREFIX DIR

moto must run with INITIAL_NO_AUTH_ACTION_COUNT=3: the first three requests (the IAM calls
below) go unauthenticated; every later request must be signed with a key of an IAM user
whose policy allows it, so wrong credentials are refused as by real S3. Creates such a user
with an access key allowed everything, then (signed with that key) the bucket, and uploads
every regular file under DIR to PREFIX/<relative path>. Prints {"key": ..., "secret": ...}.
"""

import json
import os
import sys

import boto3

endpoint, bucket, prefix, root = sys.argv[1:5]
common = dict(endpoint_url=endpoint, region_name="us-east-1")
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
s3 = boto3.client(
    "s3",
    aws_access_key_id=key["AccessKeyId"],
    aws_secret_access_key=key["SecretAccessKey"],
    **common,
)
s3.create_bucket(Bucket=bucket)
for dirpath, _, names in os.walk(root):
    for name in names:
        path = os.path.join(dirpath, name)
        rel = os.path.relpath(path, root)
        with open(path, "rb") as f:
            s3.put_object(Bucket=bucket, Key=f"{prefix}/{rel}", Body=f.read())
print(json.dumps({"key": key["AccessKeyId"], "secret": key["SecretAccessKey"]}))
