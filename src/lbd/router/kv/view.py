"""One router worker's exact view of every endpoint's prefix cache, and the per-request lookup.

For each endpoint (``--kv-events auto``: where advertised; ``on``: everywhere, warning where missing) the
view reads ``/kv_event_sources`` (vLLM's) and ``/tokenizer_info`` + ``/tokenizer.json`` (lbd's engine; for
vLLM engines pass ``lbd route --tokenizer``), then follows the event stream (``feed``). A request is rendered
and tokenized once (``tokenize``), its block chain walked once over the index (``index``), and its facts get
the exact cached prefix length of every endpoint whose view is exact: a live or just-disconnected feed (a dead
publisher means a cold cache), events not lagging past ``stale_s``, the same tokenizer. Every other endpoint
is left out, so the policy uses its approximate index there; ``status`` says which and why.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import orjson

from lbd.common.internal_key import IdsSigner
from lbd.router.kv.endpoint import EndpointView
from lbd.router.kv.feed import EventFeed, Source
from lbd.router.kv.forward import PATHS, ExactPrompt, advertised, info_path, with_ids
from lbd.router.kv.index import BlockIndex
from lbd.router.kv.lookup import Lookup
from lbd.router.kv.memory import IndexMemory, estimate
from lbd.router.kv.shared_pending import SharedPending
from lbd.router.kv.tokenize import RouterTokenizer

log = logging.getLogger("lbd.router")
Getter = Callable[[str, float], Awaitable[tuple[int, bytes]]]  # (url, timeout) -> (status, body)
REDISCOVER_S = 2.0  # while an endpoint has no usable feed, ask it again this often
TOKENIZER_RETRY_S = 30.0
_WILDCARDS = ("*", "0.0.0.0", "[::]", "::")


def subscribe_address(advertised: str, engine_url: str) -> str | None:
    """Where to connect for an advertised endpoint: a wildcard host becomes the engine's host; None when
    the publisher connects out (vLLM does so for a specific tcp host) or the address is process-local."""
    if advertised.startswith("inproc://"):
        return None
    if advertised.startswith("ipc://"):
        return advertised
    if not advertised.startswith("tcp://"):
        return None
    hostport = advertised[len("tcp://") :]
    host, _, port = hostport.rpartition(":")
    if host in _WILDCARDS:
        engine_host = urlsplit(engine_url).hostname or "127.0.0.1"
        return f"tcp://[{engine_host}]:{port}" if ":" in engine_host else f"tcp://{engine_host}:{port}"
    if _literal_loopback(host) and not _literal_loopback(urlsplit(engine_url).hostname or "127.0.0.1"):
        return None  # bound to the engine machine's loopback: here it would reach another publisher, or none
    return advertised


def _literal_loopback(host: str) -> bool:
    """A loopback address written out (names are not resolved here: discovery runs on the event loop)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ExactView:
    def __init__(
        self,
        mode: str,
        get: Getter,
        stale_s: float,
        timeout_s: float,
        local_tokenizer: RouterTokenizer | None = None,
        shared: SharedPending | None = None,
        forward_ids: bool = True,
        signer: IdsSigner | None = None,
        index: BlockIndex | None = None,
    ) -> None:
        self.mode = mode
        # --forward-prompt-ids, with the internal key that ranks check the ids' signature with
        self.signer = signer if forward_ids else None
        self.forward_ids = self.signer is not None
        self.shared = shared  # other workers' pending prefixes (--workers > 1)
        self._by_slot: dict[int, EndpointView] = {}
        self.get = get
        self.stale_s = stale_s
        self.timeout_s = timeout_s
        self.local_tokenizer = local_tokenizer
        self.index = index if index is not None else BlockIndex()  # the caps: --kv-index-max-blocks...
        self._memory: tuple[float, IndexMemory] | None = None  # (when, the estimate) for status()
        self.views: dict[str, EndpointView] = {}
        # the request side (lookup): tokenize, walk the chain, mark and settle pending blocks
        self.lookup = Lookup(self.views, self.index, shared, stale_s)
        self.complete, self.annotate = self.lookup.complete, self.lookup.annotate
        self.dispatched, self.settle = self.lookup.dispatched, self.lookup.settle
        self.answered = self.lookup.answered
        self._tokenizers: dict[str, asyncio.Future[RouterTokenizer]] = {}  # tokenizer.json sha256 -> it

    # ---- endpoints ------------------------------------------------------------------------------------
    def add(
        self,
        url: str,
        models: Callable[[], frozenset[str]],
        default_block_size: Callable[[], int],
        slot: int = -1,
        capacity: Callable[[], int] = lambda: 0,
    ) -> None:
        """Follow ``url``'s events; ``slot`` is its shared-counter slot (the same in every worker);
        ``capacity`` its KV capacity in blocks (0: not known), which sets its cap in the index."""
        if self.mode == "off" or url in self.views:
            return
        blocks = self.index.endpoint()
        blocks.capacity = capacity
        view = self.views[url] = EndpointView(
            url, models, blocks, default_block_size=default_block_size, slot=slot
        )
        if slot >= 0:
            self._by_slot[slot] = view
        view.task = asyncio.ensure_future(self._discover(view))

    def remove(self, url: str) -> None:
        view = self.views.pop(url, None)
        if view is None:
            return
        if self._by_slot.get(view.slot) is view:
            del self._by_slot[view.slot]
        if view.task is not None:
            view.task.cancel()
        if view.feed is not None:
            view.feed.cancel()
        self.index.release(view.blocks)

    def restarted(self, url: str, why: str) -> None:
        """The process behind ``url`` was replaced: its cache is cold, its addresses may have changed."""
        view = self.views.get(url)
        if view is None:
            return
        view.blocks.clear()
        if view.task is not None and not view.task.done():
            view.task.cancel()
        view.task = asyncio.ensure_future(self._rediscover(view, why))

    async def close(self) -> None:
        views = list(self.views.values())
        for url in list(self.views):
            self.remove(url)
        tasks = [t for v in views for t in (v.task, v.feed.task if v.feed else None) if t is not None]
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _rediscover(self, view: EndpointView, why: str) -> None:
        log.info("KV events of %s: %s; asking for its event sources again", view.url, why)
        if view.feed is not None:
            await view.feed.close()
            view.feed = None
        view.reason = f"rediscovering ({why})"
        await self._discover(view)

    async def _discover(self, view: EndpointView) -> None:
        """Find the endpoint's publisher and tokenizer, and again whenever its feed is gone (a restart on a
        new port) or the tokenizer is still unknown."""
        tokenizer_due = 0.0
        loop = asyncio.get_running_loop()
        while True:
            feed = view.feed
            try:
                if view.tokenizer is None and loop.time() >= tokenizer_due:
                    view.tokenizer = await self._tokenizer(view)
                    if view.tokenizer is None:  # it answered, without one: ask again now and then
                        tokenizer_due = loop.time() + TOKENIZER_RETRY_S
                        view.reason = (
                            "no tokenizer: the endpoint serves no /tokenizer.json; start lbd route "
                            "with --tokenizer"
                        )
                if feed is None or feed.stats.state in ("disconnected", "failed"):
                    await self._follow(view, await self._source(view))
            except (OSError, TimeoutError, ValueError) as e:
                view.reason = f"discovery failed: {type(e).__name__}: {e}"
            await asyncio.sleep(REDISCOVER_S)

    async def _follow(self, view: EndpointView, source: Source | None) -> None:
        if source == view.source and view.feed is not None:
            return  # same publisher address: the SUB socket reconnects by itself
        if view.feed is not None:
            await view.feed.close()
            view.feed = None
        view.source = source
        if source is not None:
            view.feed = EventFeed(view.url, source, view.blocks)
            view.feed.start()

    async def _json(self, url: str) -> Any:
        status, body = await self.get(url, self.timeout_s)
        if status == 404:
            return None
        if status != 200:
            raise ValueError(f"{urlsplit(url).path} answered {status}")
        return orjson.loads(body)

    async def _source(self, view: EndpointView) -> Source | None:
        sources = await self._json(view.url + "/kv_event_sources")
        if not sources:
            if self.mode == "on" and not view.reason.startswith("no KV events"):
                log.warning("--kv-events on: %s advertises no KV events; routing it approximately", view.url)
            view.reason = "no KV events advertised (/kv_event_sources is empty or absent)"
            return None
        cfg = next(iter(sources.values())) if isinstance(sources, dict) else None
        if (
            not isinstance(cfg, dict)
            or not cfg.get("enable_kv_cache_events")
            or cfg.get("publisher") != "zmq"
        ):
            view.reason = "KV events are not enabled on the endpoint"
            return None
        address = subscribe_address(str(cfg.get("endpoint") or ""), view.url)
        if address is None:
            view.reason = (
                f"publisher endpoint {cfg.get('endpoint')!r} cannot be subscribed to (it connects "
                "out, is process-local or on the engine machine's loopback): give the engine a --host "
                "this router reaches, or a tcp:// endpoint on such an address"
            )
            return None
        replay = cfg.get("replay_endpoint")
        replay_address = subscribe_address(str(replay), view.url) if replay else None
        return Source(address, replay_address, str(cfg.get("topic") or ""))

    async def _tokenizer(self, view: EndpointView) -> RouterTokenizer | None:
        info = await self._json(view.url + info_path(self.signer))  # proves the key: ids only if it matches
        view.takes_ids = advertised(info, self.signer is not None)
        sha = info.get("tokenizer_json_sha256") if isinstance(info, dict) else None
        if not sha:
            return self.local_tokenizer
        loading = self._tokenizers.get(sha)
        if loading is None:  # one download per tokenizer, however many endpoints serve it
            loading = self._tokenizers[sha] = asyncio.ensure_future(self._load_tokenizer(view, sha, info))
        try:
            return await asyncio.shield(loading)
        except (OSError, TimeoutError, ValueError):
            if self._tokenizers.get(sha) is loading:
                del self._tokenizers[sha]  # the next endpoint (or the next try) fetches it again
            raise

    async def _load_tokenizer(self, view: EndpointView, sha: str, info: dict[str, Any]) -> RouterTokenizer:
        status, body = await self.get(view.url + "/tokenizer.json", max(self.timeout_s, 30.0))
        if status != 200 or hashlib.sha256(body).hexdigest() != sha:
            raise ValueError(f"/tokenizer.json answered {status} or does not match its sha256")
        tok = await asyncio.get_running_loop().run_in_executor(None, RouterTokenizer, body.decode(), info)
        log.info("tokenizer %s... learned from %s (pieces cached: %s)", sha[:12], view.url, tok.by_pieces)
        return tok

    def body_for(self, url: str, path: str, prompt: ExactPrompt | None, body: bytes) -> bytes:
        """The body to send ``url``: with the prompt's ids where that endpoint takes ids of its tokenizer."""
        signer = self.signer
        if prompt is None or signer is None or path not in PATHS:
            return body
        view = self.views.get(url)
        if view is None or view.takes_ids != prompt.fingerprint:
            return body
        spliced = with_ids(body, prompt, signer)
        if spliced is None:
            return body
        view.forwarded += 1
        return spliced

    # ---- reporting ------------------------------------------------------------------------------------
    def status(self, url: str) -> dict[str, Any] | None:
        view = self.views.get(url)
        if view is None:
            return None
        feed = view.feed
        out: dict[str, Any] = {
            "mode": "exact" if view.exact(self.stale_s) else "approximate",
            "blocks": len(view.blocks),
            "tokenizer": view.tokenizer is not None,
            "routed_on_head": view.routed_on_head,
            "head_only": view.head_only,
            "forwarded_ids": view.forwarded if view.takes_ids else None,
            "index_bytes": self.memory().endpoint_bytes(len(view.blocks)),
            "cap_blocks": view.blocks.cap,
            "evicted": view.blocks.evicted,
        }
        if feed is None:
            out["reason"] = view.reason
            return out
        st = feed.stats
        out.update(
            state=st.state,
            endpoint=feed.source.endpoint,
            replay_endpoint=feed.source.replay_endpoint,
            last_seq=st.last_seq,
            batches=st.batches,
            events=dict(st.events),
            gaps=st.gaps,
            resyncs=st.resyncs,
            lost=st.lost,
            partial=st.partial,
            orphans=view.blocks.orphans,
            lag_s=round(st.lag_s, 4),
            age_s=round(time.time() - st.last_batch_at, 3) if st.last_batch_at else None,
            error=st.error or None,
        )
        if out["mode"] == "approximate":
            if view.tokenizer is None:
                out["reason"] = view.reason
            elif st.state == "live":
                out["reason"] = f"events lag {st.lag_s:.3f} s (over {self.stale_s:g} s)"
            else:
                out["reason"] = f"event feed {st.state}"
        return out

    def memory(self) -> IndexMemory:
        """The index's memory estimate, at most a second old (one status page asks once per endpoint)."""
        now = time.monotonic()
        if self._memory is None or now - self._memory[0] > 1.0:
            self._memory = (now, estimate(self.index))
        return self._memory[1]

    def index_status(self) -> dict[str, Any]:
        """The whole index: /router/status's ``kv_index``."""
        m, index = self.memory(), self.index
        return {
            "bytes": m.bytes,
            "blocks": m.blocks,
            "keys": m.keys,
            "endpoints": m.endpoints,
            "bytes_per_block": round(m.per_block, 1),
            "max_blocks": index.max_blocks,
            "max_blocks_per_endpoint": index.max_blocks_per_endpoint,
            "evicted": index.evicted,
            "answers_tokenized_ahead": self.lookup.answers.started,  # (kv.answers)
        }

    def metric_rows(self) -> list[tuple[str, float, float, int]]:
        """(url, event lag s, seconds since the last batch, indexed blocks) per endpoint with a feed."""
        now = time.time()
        rows = []
        for url, v in self.views.items():
            if v.feed is not None:
                st = v.feed.stats
                rows.append(
                    (url, st.lag_s, now - st.last_batch_at if st.last_batch_at else -1.0, len(v.blocks))
                )
        return rows

