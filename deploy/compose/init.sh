#!/bin/sh
# The compose farm's init step (service `init`, runs to completion before the farm starts):
# the dev encoder on the `models` volume (the embedding worker's model; the chat model, SmolLM2-135M-
# Instruct, is in the image), the archive signing key pair on `keys` (the public half copied to
# /models/trust/, the only part replicas see), the S3 bucket on the moto server.
# Everything is made once and reused on the next `make compose-up`.
set -eu
E=/models/lorafarm-dev-embed
if [ ! -s "$E/modules.json" ]; then
    echo "init: generating the dev embedding model in $E"
    lorafarm devmodel --kind embedding --out "$E" --force
fi
if [ ! -s /keys/private.pem ]; then
    echo "init: generating the archive signing key pair"
    lorafarm archive keygen --out /keys
fi
chmod 600 /keys/private.pem
mkdir -p /models/trust
cp /keys/public.pem /models/trust/public.pem
python - <<'PY'
import os, time
from urllib.parse import urlparse

import boto3
from botocore.exceptions import ClientError, EndpointConnectionError

bucket = urlparse(os.environ["LORAFARM_STORE_URL"]).netloc
s3 = boto3.client("s3", endpoint_url=os.environ["LORAFARM_S3_ENDPOINT_URL"])
for attempt in range(60):
    try:
        s3.create_bucket(Bucket=bucket)
        print(f"init: created bucket {bucket}")
        break
    except ClientError as e:
        if e.response["Error"]["Code"] in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            print(f"init: bucket {bucket} exists")
            break
        raise
    except EndpointConnectionError:
        time.sleep(1)
else:
    raise SystemExit("init: the S3 endpoint did not answer")
PY
echo "init: done"
