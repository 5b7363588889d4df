"""A tier in an S3 bucket (AWS, MinIO, or any S3-compatible store).

Settings come from the standard AWS variables and boto3's default chain:
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` (or a profile or role),
``AWS_REGION``, and ``AWS_ENDPOINT_URL_S3`` for MinIO or another endpoint
(path-style addressing is used when an endpoint is set).  TLS verification
follows ``AWS_CA_BUNDLE``.

Throttling, 5xx answers and timeouts are retried by botocore (adaptive
mode), and then by this backend with exponential backoff until
``retry_deadline_s`` has passed, so an endpoint that is down for a while
delays tiering instead of failing it.
"""

from __future__ import annotations

import io
import os
from typing import Iterator

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config as BotoConfig
from botocore.exceptions import BotoCoreError, ClientError, ConnectionError as BotoConnectionError
from botocore.exceptions import FlexibleChecksumError, HTTPClientError, IncompleteReadError

from connectors.tier.backend import Backend, ObjectInfo, check_name
from connectors.tier.retry import RETRY_DEADLINE_S, patience, retry_transient
from connectors.tier.errors import AccessDenied, BucketNotFound, ObjectNotFound, TierError, TransientTierError

S3_MAX_KEY_BYTES = 1024
_TRANSIENT_CODES = {"500", "502", "503", "504", "SlowDown", "Throttling", "ThrottlingException",
                    "RequestTimeout", "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable"}


def parse_location(location: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` to ``(bucket, "prefix/")``."""
    rest = location[len("s3://") :]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise TierError(f"tier.location {location!r} names no bucket: use s3://bucket/prefix")
    prefix = prefix.strip("/")
    return bucket, f"{prefix}/" if prefix else ""


class S3Backend(Backend):
    def __init__(
        self,
        location: str,
        *,
        multipart_threshold: int = 64 << 20,
        multipart_chunksize: int = 16 << 20,
        retry_deadline_s: float | None = None,
        botocore_attempts: int | None = None,
        retry_mode: str = "adaptive",
        client=None,
    ):
        self.location = location
        self.bucket, self.prefix = parse_location(location)
        self.retry_deadline_s = patience() if retry_deadline_s is None else retry_deadline_s
        if botocore_attempts is None:  # botocore's own backoff between attempts outlasts a short patience
            botocore_attempts = 8 if self.retry_deadline_s >= RETRY_DEADLINE_S else 2
        self.transfer = TransferConfig(
            multipart_threshold=multipart_threshold, multipart_chunksize=multipart_chunksize, use_threads=False
        )
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        self.client = client or boto3.session.Session().client(
            "s3",
            config=BotoConfig(
                retries={"max_attempts": botocore_attempts, "mode": retry_mode},
                connect_timeout=5,
                read_timeout=30,
                s3={"addressing_style": "path"} if endpoint else {},
            ),
        )

    # ------------------------------------------------------------ error handling

    def _call(self, what: str, name: str, fn, *args, deadline_s: float | None = None, **kwargs):
        """Run one S3 call, retrying transient failures with backoff until the deadline."""
        def once():
            try:
                return fn(*args, **kwargs)
            except (ClientError, BotoCoreError) as exc:
                raise self._translate(exc, what, name) from None

        return retry_transient(once, self.retry_deadline_s if deadline_s is None else deadline_s)

    def _translate(self, exc: Exception, what: str, name: str) -> TierError:
        where = f"s3://{self.bucket}/{self.prefix}{name}"
        if isinstance(exc, ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
            if code == "NoSuchBucket":
                return BucketNotFound(
                    f"S3 bucket {self.bucket!r} (tier.location) does not exist: create it or fix tier.location"
                )
            if code in ("NoSuchKey", "404", "NotFound"):
                return ObjectNotFound(f"tier object {where} not found")
            if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                return AccessDenied(
                    f"access denied to S3 bucket {self.bucket!r} ({what} {name!r}): check the AWS_* "
                    "credentials and the bucket policy"
                )
            if code in _TRANSIENT_CODES or status in _TRANSIENT_CODES:
                return TransientTierError(f"S3 {what} {where} failed with {code or status}")
            return TierError(f"S3 {what} {where} failed: {code} {exc.response.get('Error', {}).get('Message', '')}")
        if isinstance(exc, (BotoConnectionError,)) or "timeout" in type(exc).__name__.lower():
            return TransientTierError(f"S3 {what} {where}: endpoint unreachable, {self.client.meta.endpoint_url} "
                                      f"({type(exc).__name__}; AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL names it)")
        # A connection closed mid-answer, or a body that arrived short or damaged (its checksum does
        # not match, as when a proxy cuts it): the object is fine, reading it again is the remedy.
        if isinstance(exc, (HTTPClientError, IncompleteReadError, FlexibleChecksumError)):
            return TransientTierError(f"S3 {what} {where}: the answer was cut or damaged in transit "
                                      f"({type(exc).__name__}: {exc})")
        return TierError(f"S3 {what} {where} failed: {exc}")

    # ------------------------------------------------------------ operations

    def _key(self, name: str) -> str:
        return self.prefix + check_name(name, max_bytes=S3_MAX_KEY_BYTES - len(self.prefix.encode()),
                                        where=f"an S3 key under the prefix {self.prefix!r}")

    def put(self, name: str, data: bytes) -> None:
        key = self._key(name)
        if len(data) >= self.transfer.multipart_threshold:
            # An object assembled from parts appears only when the upload completes.
            self._call("multipart upload", name, lambda: self.client.upload_fileobj(
                io.BytesIO(data), self.bucket, key, Config=self.transfer))
        else:
            self._call("put", name, self.client.put_object, Bucket=self.bucket, Key=key, Body=data)

    def read(self, name: str, start: int = 0, length: int | None = None) -> bytes:
        kwargs = {}
        if start or length is not None:
            end = "" if length is None else str(start + length - 1)
            if length == 0:
                return b""
            kwargs["Range"] = f"bytes={start}-{end}"
        key = self._key(name)
        # The GET and its body in one retried call: a body cut in transit is read again with a new GET.
        return self._call("get", name, lambda: self.client.get_object(Bucket=self.bucket, Key=key, **kwargs)["Body"].read())

    def size(self, name: str) -> int:
        resp = self._call("head", name, self.client.head_object, Bucket=self.bucket, Key=self._key(name))
        return int(resp["ContentLength"])

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        paginator = self.client.get_paginator("list_objects_v2")
        pages = self._call("list", prefix, lambda: list(paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix)))
        for page in pages:
            for obj in page.get("Contents", []):
                yield ObjectInfo(obj["Key"][len(self.prefix) :], int(obj["Size"]))

    def delete(self, name: str) -> None:
        self._call("delete", name, self.client.delete_object, Bucket=self.bucket, Key=self._key(name))

    def check(self) -> None:
        """Fail fast (naming the bucket) when the bucket is missing or not ours to use."""
        try:
            self._call("head bucket", "", self.client.head_bucket, Bucket=self.bucket, deadline_s=10)
        except ObjectNotFound:
            raise BucketNotFound(
                f"S3 bucket {self.bucket!r} (tier.location) does not exist: create it or fix tier.location"
            ) from None

    def close(self) -> None:
        self.client.close()
