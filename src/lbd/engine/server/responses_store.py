"""Stored /v1/responses: what ``previous_response_id`` continues and ``GET /v1/responses/{id}`` returns.

vLLM keeps them in a dict that never shrinks, and only with ``VLLM_ENABLE_RESPONSES_API_STORE=1`` (otherwise
``store`` is ignored and ``previous_response_id`` answers 404). lbd stores by default (OpenAI's default is
``store: true``) and bounds the store:

- One JSON file per response in the rank's runtime folder (``$LBD_RESPONSES_DIR``, removed when the rank
  stops), so every front end of the rank (``--api-server-count``) reads what any of them stored. A restarted
  rank starts empty: a ``previous_response_id`` from before the restart answers 404.
- Eviction: each front end keeps its own writes within ``1/api_server_count`` of
  ``--responses-store-max-entries`` and of ``--responses-store-max-bytes``, dropping its oldest first
  (first stored, first evicted; a read does not refresh). 0 entries stores nothing.
- A record holds the response object and the conversation without ``instructions`` (input messages of the
  whole chain plus this response's output), so a chain costs one read per turn, not one per ancestor.

Ids are chosen by the front end (``resp_r<rank>-<hex>``); anything else is refused before a path is built.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import orjson

RESPONSES_DIR_ENV = "LBD_RESPONSES_DIR"
_ID = re.compile(r"^resp_[A-Za-z0-9_-]{1,120}$")


class ResponseStore:
    def __init__(self, folder: str | Path | None, max_entries: int, max_bytes: int) -> None:
        self.folder = Path(folder) if folder else Path(tempfile.mkdtemp(prefix="lbd-responses-"))
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._mine: OrderedDict[str, int] = OrderedDict()  # ids this process stored -> bytes, oldest first
        self._bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0 and self.max_bytes > 0

    def _path(self, response_id: str) -> Path | None:
        return self.folder / f"{response_id}.json" if _ID.match(response_id) else None

    def put(self, response_id: str, record: dict[str, Any]) -> None:
        path = self._path(response_id)
        if path is None or not self.enabled:
            return
        data = orjson.dumps(record)
        if len(data) > self.max_bytes:
            return  # larger than the whole store: keeping it would evict everything else
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # readers in other front ends see the whole file or none
        self._mine[response_id] = len(data)
        self._bytes += len(data)
        while self._mine and (len(self._mine) > self.max_entries or self._bytes > self.max_bytes):
            old, size = self._mine.popitem(last=False)
            self._bytes -= size
            with contextlib.suppress(OSError):
                (self.folder / f"{old}.json").unlink()

    def get(self, response_id: str) -> dict[str, Any] | None:
        path = self._path(response_id)
        if path is None:
            return None
        try:
            return orjson.loads(path.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return None

    def delete(self, response_id: str) -> bool:
        path = self._path(response_id)
        if path is None:
            return False
        try:
            path.unlink()
        except OSError:
            return False
        size = self._mine.pop(response_id, None)
        if size is not None:
            self._bytes -= size
        return True
