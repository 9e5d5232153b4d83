"""Models: the builds the fleet holds, bundle upload, delegated signing's metadata, and the TUF repository agents
download them from (``/tuf``)."""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse, Response, StreamingResponse

from .. import ranges
from .. import schemas as out
from ..auth import Caller
from ..errors import BadRequest, RepositoryError
from .context import Fleet


def router(fleet: Fleet) -> APIRouter:
    r = APIRouter()
    models, repo, max_upload_bytes = fleet.service.models, fleet.repo, fleet.max_upload_bytes  # this area's service
    viewer, operator = fleet.roles.viewer, fleet.roles.operator

    @r.get("/api/v1/models", response_model=list[out.ModelBuild])
    def list_models(_: Caller = Depends(viewer)) -> list[out.ModelBuild]:
        return models.list_models()

    @r.post("/api/v1/bundles", status_code=201, response_model=out.ModelBuild)
    async def upload_bundle(request: Request, _: Caller = Depends(operator)) -> out.ModelBuild:
        """Upload a bundle archive as the raw request body (Content-Type: application/x-tar)."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_upload_bytes:
            raise BadRequest(f"bundle of {declared} bytes exceeds the {max_upload_bytes}-byte limit", 413)
        repo.upload_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix="upload-", suffix=".tar", dir=repo.upload_dir)
        try:
            size = 0
            with os.fdopen(fd, "wb") as f:
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > max_upload_bytes:
                        raise BadRequest(f"bundle exceeds the {max_upload_bytes}-byte limit", 413)
                    f.write(chunk)
            if size == 0:
                raise BadRequest("empty body: send the bundle archive as the request body")
            from starlette.concurrency import run_in_threadpool

            return await run_in_threadpool(models.upload_bundle, Path(tmp))
        finally:
            Path(tmp).unlink(missing_ok=True)

    @r.get("/api/v1/bundles/signed-metadata", response_model=out.SignedMetadata)
    def get_bundles_metadata(_: Caller = Depends(operator)) -> Response:
        """Delegated signing: the published ``bundles`` TUF metadata, which the compiler's CI extends with a new
        bundle and signs with its key (``edgefleet fleet upload BUNDLE --sign-key``)."""
        try:
            return Response(repo.current_bundles(), media_type="application/json")
        except RepositoryError as exc:
            raise BadRequest(f"{exc}; this fleet signs bundles itself: upload them without --sign-key", 409) from exc

    @r.post("/api/v1/bundles/signed-metadata", status_code=201, response_model=out.Published)
    async def publish_bundles_metadata(request: Request, _: Caller = Depends(operator)) -> dict[str, Any]:
        """Publish ``bundles`` metadata signed by a CI key the offline targets metadata delegates to; then the
        bundles it lists can be uploaded."""
        body = await request.body()  # at most MAX_METADATA_BYTES: BodyLimit
        if not body:
            raise BadRequest("send the signed bundles metadata (JSON, at most 16 MiB) as the request body")
        try:
            repo.publish_bundles(body)
        except RepositoryError as exc:
            raise BadRequest(str(exc), 422) from exc
        return {"published": True}

    safe = re.compile(r"^[A-Za-z0-9._/-]+$")

    @r.get("/tuf/{kind}/{rel:path}")
    def tuf_file(kind: str, rel: str, request: Request) -> Response:
        if kind not in ("metadata", "targets") or not safe.match(rel):
            raise BadRequest("not found", 404)
        found = repo.serve(kind, rel)
        if found is None:
            raise BadRequest(f"{kind}/{rel} not found", 404)
        media = "application/json" if kind == "metadata" else "application/octet-stream"
        headers = {"Cache-Control": "no-store"}
        asked = request.headers.get("range")
        if kind == "targets" and asked is not None:  # a resumed download: fleet/ranges.py
            return ranged(found, asked, media, headers)
        if kind == "targets":
            headers["Accept-Ranges"] = "bytes"
        if isinstance(found, Path):
            return FileResponse(found, media_type=media, headers=headers)
        if isinstance(found, bytes):
            return Response(found, media_type=media, headers=headers)
        size, chunks = found  # a target kept in the database, streamed a chunk at a time
        return StreamingResponse(chunks, media_type=media, headers={**headers, "Content-Length": str(size)})

    def ranged(found: Path | bytes | tuple[int, Iterator[bytes]], asked: str, media: str,
               headers: dict[str, str]) -> Response:
        size = found.stat().st_size if isinstance(found, Path) else len(found) if isinstance(found, bytes) else found[0]
        try:
            want = ranges.parse_range(asked, size)
        except ranges.RangeNotSatisfiable as exc:
            return Response(f"{exc}\n", 416, {**headers, "Content-Range": f"bytes */{size}"}, "text/plain")
        part = {**headers, "Content-Range": want.content_range(), "Content-Length": str(want.length),
                "Accept-Ranges": "bytes"}
        if isinstance(found, Path):
            return StreamingResponse(ranges.slice_file(found, want), 206, part, media)
        chunks = [found] if isinstance(found, bytes) else found[1]
        return StreamingResponse(ranges.slice_chunks(chunks, want), 206, part, media)

    return r
